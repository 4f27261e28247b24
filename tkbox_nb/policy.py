"""The box policy: what a user writes (TOML), validated strictly, and the pure function that decides a crossing.

The policy is identified by the SHA-256 of its exact source bytes, and the same `decide` runs in the door (to state
the box's verdict to the signer) and in `tkbox verify` (to re-derive every disclosed decision from the disclosed
policy source). So `decide` must be a pure function of (policy, facts): no clock, no environment, no I/O.

Sections not yet enforced by a door are refused, not ignored: a policy that says more than the box can enforce is an
error, never a silent loosening.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PolicyError

MAX_POLICY_BYTES = 256 * 1024
MAX_LIST = 1024
BACKENDS = ("auto", "bwrap", "qemu", "firecracker")
ISOLATION = ("namespace", "vm")  # a minimum: "vm" refuses to start a namespace box rather than fall back to one

DEFAULT_SOURCE = """\
# tkbox-nb default policy: cells and commands run; nothing else leaves the box.
[box]
backend = "auto"

[exec]
cells = true
commands = ["*"]
deny_commands = []
timeout_s = 600
"""

# section -> {key: (type, validator-or-None)}
_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "box": {"backend": str, "isolation": str, "memory_mib": int, "cpus": int, "cpu_time_s": int,
            "max_processes": int, "workspace_mib": int},
    "exec": {"cells": bool, "comms": bool, "commands": list, "deny_commands": list, "timeout_s": (int, float),
             "max_output_bytes": int},
    "egress": {"allow": list, "allow_cidrs": list, "nameservers": list, "connect_timeout_s": (int, float),
               "upstream_ca_file": str},
    "patch": {"apply": str, "allow": list, "deny": list, "max_file_bytes": int, "max_total_bytes": int,
              "max_files": int, "binary": bool},
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "box": {"backend": "auto", "isolation": "namespace", "memory_mib": 2048, "cpus": 1, "cpu_time_s": 3600, "max_processes": 256,
            "workspace_mib": 1024},
    "exec": {"cells": True, "comms": True, "commands": ["*"], "deny_commands": [], "timeout_s": 600,
             "max_output_bytes": 16 << 20},
    "egress": {"allow": [], "allow_cidrs": [], "nameservers": [], "connect_timeout_s": 10, "upstream_ca_file": ""},
    "patch": {"apply": "review", "allow": ["**"], "deny": [], "max_file_bytes": 10 << 20,
              "max_total_bytes": 100 << 20, "max_files": 10_000, "binary": True},
}
PATCH_APPLY = ("never", "review", "auto")
SECRET_KEYS: dict[str, type] = {"hosts": list, "header": str, "format": str, "source": str, "misuse": str}
_LATER = {"models": "the model door"}


@dataclass(frozen=True)
class Verdict:
    """The box policy's answer for one crossing: `verdict` is allow or deny, `rule` names the policy entry."""

    verdict: str
    rule: str
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.verdict == "allow"


@dataclass(frozen=True)
class Policy:
    """A validated box policy. `source` is the exact text it was read from; `hash` names it in every record."""

    source: str
    name: str = "<default>"
    data: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    @property
    def hash(self) -> str:
        return policy_hash(self.source)

    def get(self, section: str, key: str) -> Any:
        return self.data.get(section, {}).get(key, _DEFAULTS[section][key])

    # -- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def default(cls) -> "Policy":
        return cls.from_toml(DEFAULT_SOURCE, "<default>")

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise PolicyError(f"{p}: cannot read the policy: {e.strerror or e}") from None
        if len(raw) > MAX_POLICY_BYTES:
            raise PolicyError(f"{p}: the policy is {len(raw)} bytes, more than {MAX_POLICY_BYTES}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PolicyError(f"{p}: not UTF-8 text (byte {e.start})") from None
        return cls.from_toml(text, p.name)

    @classmethod
    def from_toml(cls, text: str, name: str = "<string>") -> "Policy":
        if len(text.encode("utf-8")) > MAX_POLICY_BYTES:
            raise PolicyError(f"{name}: the policy is larger than {MAX_POLICY_BYTES} bytes")
        if "\x00" in text:
            raise PolicyError(f"{name}: the policy contains a NUL character")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PolicyError(f"{name}: not valid TOML: {e}") from None
        except RecursionError:  # tomllib recurses per nested array or table (a disclosed policy is hostile input)
            raise PolicyError(f"{name}: not valid TOML: nested too deeply") from None
        return cls(source=text, name=name, data=_validate(data, name))

    @classmethod
    def coerce(cls, policy: "Policy | str | Path | None") -> "Policy":
        """A Policy from a Policy, a path, TOML text (a string holding a newline or '['), or None (the default)."""
        if policy is None:
            return cls.default()
        if isinstance(policy, Policy):
            return policy
        if isinstance(policy, str) and ("\n" in policy or policy.lstrip().startswith("[")):
            return cls.from_toml(policy)
        return cls.load(policy)

    # -- deciding ------------------------------------------------------------------------------------------------
    def decide(self, facts: dict[str, Any]) -> Verdict:
        """The verdict for one crossing described by `facts` (the door's statement, as signed). Pure."""
        door, kind = facts.get("door"), facts.get("kind")
        if door == "box":
            if kind in ("start", "stop"):
                return Verdict("allow", f"box.{kind}")
            return Verdict("deny", "box.unknown", f"unknown box event {kind!r}")
        if door == "exec":
            return self._decide_exec(kind, facts)
        if door == "egress":
            return self._decide_egress(kind, facts)
        if door == "secrets":
            return self._decide_secret(kind, facts)
        if door == "patch":
            return self._decide_patch(kind, facts)
        if door == "host":  # a host-side magic (policy, secret binding, status, bundle, restart): the user's own act
            if kind == "magic" and isinstance(facts.get("magic"), str):
                return Verdict("allow", "host.magic")
            return Verdict("deny", "host.unknown", f"unknown host event {kind!r}")
        return Verdict("deny", "door.unknown", f"no door {door!r} in this version")

    def _decide_exec(self, kind: Any, facts: dict[str, Any]) -> Verdict:
        if kind == "cell":
            if self.get("exec", "cells"):
                return Verdict("allow", "exec.cells")
            return Verdict("deny", "exec.cells", "the policy runs no cells ([exec] cells = false)")
        if kind == "comm":  # a widget's message from the frontend into the box
            if self.get("exec", "cells") and self.get("exec", "comms"):
                return Verdict("allow", "exec.comms")
            return Verdict("deny", "exec.comms", "the policy takes no comm messages ([exec] comms = false)")
        if kind == "command":
            argv = facts.get("argv")
            if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
                return Verdict("deny", "exec.argv", "a command needs a non-empty argv of strings")
            program = argv[0].rsplit("/", 1)[-1]
            for i, pattern in enumerate(self.get("exec", "deny_commands")):
                if fnmatch.fnmatchcase(program, pattern):
                    return Verdict("deny", f"exec.deny_commands[{i}]", f"{program!r} matches {pattern!r}")
            for i, pattern in enumerate(self.get("exec", "commands")):
                if fnmatch.fnmatchcase(program, pattern):
                    return Verdict("allow", f"exec.commands[{i}]")
            return Verdict("deny", "exec.commands", f"{program!r} is not in [exec] commands")
        return Verdict("deny", "exec.kind", f"unknown exec kind {kind!r}")


    def allow_cidrs(self) -> tuple:
        import ipaddress
        return tuple(ipaddress.ip_network(c, strict=False) for c in self.get("egress", "allow_cidrs"))

    def _decide_egress(self, kind: Any, facts: dict[str, Any]) -> Verdict:
        """A connection out of the box: the name, every address its lookup gave, then the allow list. Pure: the
        address table is code (doors/addresses.py), and the facts carry the whole lookup answer."""
        import ipaddress

        from .doors.addresses import classify, refused_name
        if kind != "connect":
            return Verdict("deny", "egress.kind", f"unknown egress kind {kind!r}")
        host, port = facts.get("host"), facts.get("port")
        if facts.get("host_error") or not isinstance(host, str) or not isinstance(port, int):
            return Verdict("deny", "egress.host", str(facts.get("host_error") or "no valid host and port")[:300])
        why = refused_name(host)
        if why:
            return Verdict("deny", "egress.always", why)
        allowed_by = self.egress_allow_index(host, port)
        literal = _is_ip_literal(host)
        if allowed_by is None and not literal:  # a name off the list is refused before any lookup (no DNS leak)
            return Verdict("deny", "egress.allow", f"{host}:{port} is not in [egress] allow")
        addresses = facts.get("addresses")
        if facts.get("resolve_error") or not isinstance(addresses, list) or not addresses:
            return Verdict("deny", "egress.resolve", str(facts.get("resolve_error") or "the name has no address"))
        try:
            parsed = [ipaddress.ip_address(a) for a in addresses]
        except (TypeError, ValueError):
            return Verdict("deny", "egress.resolve", "an answer that is not an address")
        cidrs = self.allow_cidrs()
        for addr in parsed:  # one refused address refuses the whole answer
            cls, why = classify(addr, cidrs)
            if cls != "ok":
                return Verdict("deny", f"egress.{cls}", why)
        if allowed_by is None:
            return Verdict("deny", "egress.allow", f"{host}:{port} is not in [egress] allow")
        return Verdict("allow", f"egress.allow[{allowed_by}]")

    def egress_allow_index(self, host: str, port: int) -> int | None:
        """The first `[egress] allow` entry that matches host:port (the door resolves only such names)."""
        for i, pattern in enumerate(self.get("egress", "allow")):
            want_host, _, want_port = pattern.rpartition(":")
            if fnmatch.fnmatchcase(host, want_host.lower()) and want_port in ("*", str(port)):
                return i
        return None


    def _decide_secret(self, kind: Any, facts: dict[str, Any]) -> Verdict:
        """A binding made, a placeholder swapped for its value, or a placeholder found where it does not belong.
        The binding's definition travels in the facts (bindings may come from a notebook, not only the policy)."""
        name, hosts, header = facts.get("name"), facts.get("binding_hosts"), facts.get("binding_header")
        if not (isinstance(name, str) and isinstance(hosts, list) and isinstance(header, str)):
            return Verdict("deny", "secrets.binding", "a secret crossing that names no binding")
        if kind == "bind":
            return Verdict("allow", "secrets.bind")
        host = facts.get("host")
        from .doors.secrets import host_matches
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


    def _decide_patch(self, kind: Any, facts: dict[str, Any]) -> Verdict:
        """One file of the box's workspace patch. The always-rules (doors/patch_rules.py) come first, then the
        limits, then the policy's deny and allow globs. What depends on the rest of the patch (a path seen twice,
        a collision, the total so far) is stated by the door in the facts."""
        from .doors import patch_rules as r
        if kind == "summary":
            return Verdict("allow", "patch.summary")
        if kind != "file":
            return Verdict("deny", "patch.kind", f"unknown patch kind {kind!r}")
        path, op, ftype = facts.get("path"), facts.get("op"), facts.get("type")
        if op not in r.OPS:
            return Verdict("deny", "patch.op", f"unknown operation {str(op)[:40]!r}")
        why = r.path_problem(path) or ("a name that is not valid UTF-8" if facts.get("not_utf8") else None)
        if why:
            return Verdict("deny", "patch.path", why)
        if r.is_git(path):
            return Verdict("deny", "patch.git", "a .git path (any spelling) is never written")
        if op == "rename":
            why = r.path_problem(facts.get("from"))
            if why or r.is_git(facts["from"]):
                return Verdict("deny", "patch.from", f"the rename source: {why or 'a .git path'}")
        if not (ftype == "file" or op == "delete" and ftype == "symlink"):
            return Verdict("deny", "patch.type", f"a {str(ftype)[:20]} is never applied (only regular files)")
        for key, rule, what in (("duplicate_of", "patch.duplicate", "the same path twice"),
                                ("collides_with", "patch.collision", "collides (case or Unicode form) with")):
            if facts.get(key):
                return Verdict("deny", rule, f"{what} {str(facts[key])[:200]!r}" if key == "collides_with" else what)
        folded = r.fold(path)
        for i, pattern in enumerate(r.DEFAULT_DENY):
            if r.glob_match(pattern.casefold(), folded):
                return Verdict("deny", f"patch.deny_default[{i}]", f"{path} matches {pattern}")
        for i, pattern in enumerate(self.get("patch", "deny")):
            if r.glob_match(pattern, path) or r.glob_match(pattern.casefold(), folded):
                return Verdict("deny", f"patch.deny[{i}]", f"{path} matches {pattern}")
        size, total, index = facts.get("size"), facts.get("total_before"), facts.get("index")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, total, index)):
            return Verdict("deny", "patch.facts", "a patch entry without its size, index and running total")
        if index >= self.get("patch", "max_files"):
            return Verdict("deny", "patch.max_files", f"more than {self.get('patch', 'max_files')} files")
        if op != "delete":
            if size > self.get("patch", "max_file_bytes"):
                return Verdict("deny", "patch.max_file_bytes", f"{size} bytes, over {self.get('patch', 'max_file_bytes')}")
            if total + size > self.get("patch", "max_total_bytes"):
                return Verdict("deny", "patch.max_total_bytes",
                               f"the patch would pass {self.get('patch', 'max_total_bytes')} bytes")
            if facts.get("binary") is not False and not self.get("patch", "binary"):
                return Verdict("deny", "patch.binary", "a binary file ([patch] binary = false)")
        for i, pattern in enumerate(self.get("patch", "allow")):
            if r.glob_match(pattern, path):
                return Verdict("allow", f"patch.allow[{i}]")
        return Verdict("deny", "patch.allow", f"{path} is not in [patch] allow")


def _is_ip_literal(host: str) -> bool:
    import ipaddress
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def policy_hash(source: str) -> str:
    return "sha256:" + hashlib.sha256(source.encode("utf-8")).hexdigest()


def _validate(data: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    secrets = data.pop("secrets", None)
    if secrets is not None:
        out["secrets"] = _validate_secrets(secrets, name)
    for section, body in data.items():
        if section in _LATER:
            raise PolicyError(f"{name}: [{section}] is not enforced by this version ({_LATER[section]} is not built "
                              "yet); remove it rather than rely on it")
        if section not in _SCHEMA:
            raise PolicyError(f"{name}: unknown section [{section}] (known: {', '.join(sorted(_SCHEMA))})")
        if not isinstance(body, dict):
            raise PolicyError(f"{name}: [{section}] must be a table")
        keys = _SCHEMA[section]
        for key, value in body.items():
            if key not in keys:
                raise PolicyError(f"{name}: unknown key {section}.{key} (known: {', '.join(sorted(keys))})")
            want = keys[key]
            if isinstance(value, bool) and want is not bool and bool not in (want if isinstance(want, tuple) else ()):
                raise PolicyError(f"{name}: {section}.{key} must be {_tname(want)}, not a boolean")
            if not isinstance(value, want):
                raise PolicyError(f"{name}: {section}.{key} must be {_tname(want)}, not {type(value).__name__}")
            if want is list:
                if len(value) > MAX_LIST or not all(isinstance(v, str) and v and "\x00" not in v for v in value):
                    raise PolicyError(f"{name}: {section}.{key} must be a list of at most {MAX_LIST} non-empty strings")
        out[section] = dict(body)
    backend = out.get("box", {}).get("backend", "auto")
    if backend not in BACKENDS:
        raise PolicyError(f"{name}: box.backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    isolation = out.get("box", {}).get("isolation", "namespace")
    if isolation not in ISOLATION:
        raise PolicyError(f"{name}: box.isolation must be one of {', '.join(ISOLATION)} (the weakest isolation the box "
                          f"may start with), not {isolation!r}")
    for key, low in (("memory_mib", 64), ("cpus", 1), ("cpu_time_s", 1), ("max_processes", 4),
                     ("workspace_mib", 1)):
        v = out.get("box", {}).get(key)
        if v is not None and v < low:
            raise PolicyError(f"{name}: box.{key} must be at least {low}")
    egress = out.get("egress", {})
    for pattern in egress.get("allow", []):
        host, sep, port = pattern.rpartition(":")
        if not sep or not host or not (port == "*" or port.isdigit() and 0 < int(port) < 65536):
            raise PolicyError(f"{name}: egress.allow entry {pattern!r} must be HOST:PORT (HOST may use * and ?, "
                              "PORT a number or *)")
    import ipaddress
    for key in ("allow_cidrs", "nameservers"):
        for value in egress.get(key, []):
            try:
                (ipaddress.ip_network(value, strict=False) if key == "allow_cidrs" else ipaddress.ip_address(value))
            except ValueError:
                raise PolicyError(f"{name}: egress.{key} entry {value!r} is not an "
                                  f"{'address range' if key == 'allow_cidrs' else 'IP address'}") from None
    patch = out.get("patch", {})
    if patch.get("apply", "review") not in PATCH_APPLY:
        raise PolicyError(f"{name}: patch.apply must be one of {', '.join(PATCH_APPLY)}, not {patch['apply']!r}")
    for key in ("max_file_bytes", "max_total_bytes", "max_files"):
        v = patch.get(key)
        if v is not None and not 0 < v <= 1 << 40:
            raise PolicyError(f"{name}: patch.{key} must be positive (and at most 2**40)")
    for key in ("timeout_s", "max_output_bytes"):
        v = out.get("exec", {}).get(key)
        if v is not None and not v > 0:
            raise PolicyError(f"{name}: exec.{key} must be positive")
    return out


def _validate_secrets(secrets: Any, name: str) -> dict[str, dict[str, Any]]:
    """[secrets.NAME] tables: each a binding (hosts, header, format, source, misuse); values are never here."""
    if not isinstance(secrets, dict):
        raise PolicyError(f"{name}: [secrets] must hold [secrets.NAME] tables")
    out = {}
    for secret, body in secrets.items():
        where = f"{name}: secrets.{secret}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", secret):
            raise PolicyError(f"{where}: the name must be an environment variable name")
        if not isinstance(body, dict):
            raise PolicyError(f"{where} must be a table")
        for key, value in body.items():
            if key not in SECRET_KEYS:
                raise PolicyError(f"{where}: unknown key {key} (known: {', '.join(sorted(SECRET_KEYS))})")
            if not isinstance(value, SECRET_KEYS[key]):
                raise PolicyError(f"{where}.{key} must be {_tname(SECRET_KEYS[key])}")
        for key in ("hosts", "header", "source"):
            if key not in body:
                raise PolicyError(f"{where}: {key} is required")
        if not body["hosts"] or not all(isinstance(h, str) and h and "/" not in h for h in body["hosts"]):
            raise PolicyError(f"{where}.hosts must be a non-empty list of host names")
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


def _tname(t: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    if isinstance(t, tuple):
        return "a number" if set(t) == {int, float} else " or ".join(names[x] for x in t)
    return names[t]
