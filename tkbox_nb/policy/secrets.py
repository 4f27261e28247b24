"""[secrets.NAME]: bindings of a secret to the hosts and header it may be sent in (never its value); and the decision
on a binding made, a placeholder swapped for its value, or a placeholder found where it does not belong."""

from __future__ import annotations

import re
from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import Verdict, tname

SECRET_KEYS: dict[str, type] = {"hosts": list, "header": str, "format": str, "source": str, "misuse": str}
SECRET_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,63}"
# what the box's environment sets itself (backends, doors/egress_env.egress_env, the CA bundle, doors/model.box_env
# but its dummy API keys, which a binding may replace, doors/packages.box_env): a binding of one of these names would
# override it (any case, as the proxy variables are read in both)
BOX_ENV = frozenset({"PATH", "HOME", "LANG", "USER", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "HTTP_PROXY",
                     "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
                     "PIP_CERT", "NODE_EXTRA_CA_CERTS", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL",
                     "PIP_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_TARGET", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_NO_INPUT",
                     "PIP_TIMEOUT", "PIP_CONFIG_FILE", "UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_HTTP_TIMEOUT"})

# what steers how every process in the box starts: a binding sets its name to a placeholder in each of them, so one of
# these would make the loader, the C library or an interpreter load, run or read what the placeholder names (or fail
# to start). The dynamic loader's LD_*, glibc's own list of variables it strips for setuid programs
# (sysdeps/generic/unsecvars.h: GCONV_PATH loads iconv modules, GLIBC_TUNABLES, ...) and its MALLOC_*, and the
# start-up variables of the interpreters in the box: Python's PYTHON* (PYTHONSTARTUP, PYTHONHOME, PYTHONINSPECT, ...),
# IPython's and Jupyter's (the box's kernel), the shells', Perl's, Ruby's, Node's and the JVM's.
START_ENV_PREFIXES = ("LD_", "MALLOC_", "PYTHON", "JUPYTER_", "PERL5", "BASH_FUNC_")
START_ENV = frozenset({"GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
                       "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR", "IPYTHONDIR",
                       "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "PERLLIB", "PERLIO", "RUBYOPT",
                       "RUBYLIB", "NODE_OPTIONS", "NODE_PATH", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS",
                       "JDK_JAVA_OPTIONS", "CLASSPATH"})


def name_error(secret: str) -> str | None:
    """Why `secret` cannot name a binding (the box sees it as an environment variable), or None."""
    if not re.fullmatch(SECRET_NAME, secret):
        return "the name must be an environment variable name"
    name = secret.upper()
    if name in BOX_ENV or name.startswith("TKBOX_"):
        return f"{secret} is set by the box itself"
    if name in START_ENV or name.startswith(START_ENV_PREFIXES):
        return f"{secret} steers how every process in the box starts (the loader, the C library or an interpreter)"
    return None


def validate(secrets: Any, name: str) -> dict[str, dict[str, Any]]:
    """[secrets.NAME] tables: each a binding (hosts, header, format, source, misuse); values are never here."""
    if not isinstance(secrets, dict):
        raise PolicyError(f"{name}: [secrets] must hold [secrets.NAME] tables")
    out = {}
    for secret, body in secrets.items():
        where = f"{name}: secrets.{secret}"
        if name_error(secret):
            raise PolicyError(f"{where}: {name_error(secret)}")
        if not isinstance(body, dict):
            raise PolicyError(f"{where} must be a table")
        for key, value in body.items():
            if key not in SECRET_KEYS:
                raise PolicyError(f"{where}: unknown key {key} (known: {', '.join(sorted(SECRET_KEYS))})")
            if not isinstance(value, SECRET_KEYS[key]):
                raise PolicyError(f"{where}.{key} must be {tname(SECRET_KEYS[key])}")
        for key in ("hosts", "header", "source"):
            if key not in body:
                raise PolicyError(f"{where}: {key} is required")
        if not body["hosts"] or not all(isinstance(h, str) and h and "/" not in h for h in body["hosts"]):
            raise PolicyError(f"{where}.hosts must be a non-empty list of host names")
        from tkbox_nb.rules.hostnames import HostError, literal_address
        for h in body["hosts"]:
            try:  # an IP literal is matched as the address it spells, so one that spells none is a mistake
                literal_address(h)
            except HostError as e:
                raise PolicyError(f"{where}.hosts entry {h[:80]!r}: {e}") from None
        if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", body["header"]):
            raise PolicyError(f"{where}.header must be one header name")
        if "{value}" not in body.get("format", "{value}"):
            raise PolicyError(f"{where}.format must contain {{value}}")
        if body.get("misuse", "flag") not in ("flag", "refuse"):
            raise PolicyError(f"{where}.misuse must be flag or refuse")
        if not re.fullmatch(r"(env:[A-Za-z_][A-Za-z0-9_]*|file:.+|prompt)", body["source"]):
            raise PolicyError(f"{where}.source must be env:VAR, file:PATH or prompt")
        out[secret] = {"format": "{value}", "misuse": "flag", **body}
    return out


def decide(kind: Any, facts: dict[str, Any]) -> Verdict:
    """A binding made, a placeholder swapped for its value, or a placeholder found where it does not belong.
    The binding's definition travels in the facts (bindings may come from a notebook, not only the policy)."""
    name, hosts, header = facts.get("name"), facts.get("binding_hosts"), facts.get("binding_header")
    if not (isinstance(name, str) and isinstance(hosts, list) and isinstance(header, str)):
        return Verdict("deny", "secrets.binding", "a secret crossing that names no binding")
    if kind == "bind":
        return Verdict("allow", "secrets.bind")
    host = facts.get("host")
    from tkbox_nb.rules.secrets import host_matches
    bound = isinstance(host, str) and host_matches(host, hosts)
    if kind == "swap":
        if bound and str(facts.get("header", "")).lower() == header.lower() and facts.get("tls") is True:
            return Verdict("allow", "secrets.swap")
        return Verdict("deny", "secrets.swap", f"{name} goes only in {header} to {', '.join(hosts)} over TLS")
    if kind == "misuse":
        if facts.get("binding_misuse") == "refuse":
            return Verdict("deny", "secrets.misuse", f"the placeholder of {name} in {facts.get('where')}")
        return Verdict("allow", "secrets.misuse", f"flagged: the placeholder of {name} in {facts.get('where')}")
    return Verdict("deny", "secrets.kind", f"unknown secrets kind {kind!r}")
