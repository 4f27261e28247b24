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
            "max_processes": int, "workspace_mib": int, "jailer": bool},
    "exec": {"cells": bool, "comms": bool, "commands": list, "deny_commands": list, "timeout_s": (int, float),
             "max_output_bytes": int},
    "egress": {"allow": list, "allow_cidrs": list, "nameservers": list, "connect_timeout_s": (int, float),
               "upstream_ca_file": str},
    "patch": {"apply": str, "allow": list, "deny": list, "max_file_bytes": int, "max_total_bytes": int,
              "max_files": int, "binary": bool},
    "signer": {"url": str, "token_file": str, "ca": str, "trust": str, "store_dsn_file": str},
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "box": {"backend": "auto", "isolation": "namespace", "memory_mib": 2048, "cpus": 1, "cpu_time_s": 3600, "max_processes": 256,
            "workspace_mib": 1024, "jailer": False},
    "exec": {"cells": True, "comms": True, "commands": ["*"], "deny_commands": [], "timeout_s": 600,
             "max_output_bytes": 16 << 20},
    "egress": {"allow": [], "allow_cidrs": [], "nameservers": [], "connect_timeout_s": 10, "upstream_ca_file": ""},
    "patch": {"apply": "review", "allow": ["**"], "deny": [], "max_file_bytes": 10 << 20,
              "max_total_bytes": 100 << 20, "max_files": 10_000, "binary": True},
    "signer": {"url": "", "token_file": "", "ca": "", "trust": "", "store_dsn_file": ""},  # "": the machine signer
}
PATCH_APPLY = ("never", "review", "auto")
SECRET_KEYS: dict[str, type] = {"hosts": list, "header": str, "format": str, "source": str, "misuse": str}
_LATER: dict[str, str] = {}  # sections a later door will enforce (none now)
MODEL_MODES = ("live", "record", "replay")
MODEL_PROVIDERS = ("openai", "anthropic")
# [models] keys: mode, allow, budgets (each per run, except the *_per_call and max_request_bytes ones), timeout
MODEL_KEYS: dict[str, type | tuple[type, ...]] = {
    "mode": str, "allow": list, "max_calls": int, "max_input_tokens": int, "max_output_tokens": int,
    "max_output_tokens_per_call": int, "max_request_bytes": int, "timeout_s": (int, float)}
MODEL_DEFAULTS: dict[str, Any] = {"mode": "live", "allow": [], "max_calls": 0, "max_input_tokens": 0,
                                  "max_output_tokens": 0, "max_output_tokens_per_call": 0,
                                  "max_request_bytes": 4 << 20, "timeout_s": 120}
MAX_REQUEST_BYTES = 16 << 20  # the door's own ceiling on one request body, whatever the policy says
PROVIDER_KEYS: dict[str, type] = {"base_url": str, "key": str, "secret": str}
PROVIDER_URLS = {"openai": "https://api.openai.com", "anthropic": "https://api.anthropic.com"}


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
        if door == "model":
            return self._decide_model(kind, facts)
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
        """The first `[egress] allow` entry that matches host:port (the door resolves only such names). An IP literal
        entry, in any spelling (`[2001:db8::1]:443`), matches the address it spells (hostnames.host_pattern_matches)."""
        from .doors.hostnames import host_pattern_matches
        for i, pattern in enumerate(self.get("egress", "allow")):
            want_host, _, want_port = pattern.rpartition(":")
            if want_port in ("*", str(port)) and host_pattern_matches(host, want_host):
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


    def model(self, key: str) -> Any:
        """A [models] setting (its default when the policy has no [models] or does not say)."""
        return self.data.get("models", {}).get(key, MODEL_DEFAULTS[key])

    def _decide_model(self, kind: Any, facts: dict[str, Any]) -> Verdict:
        """One model call. The facts carry the request as the door parsed it and the run's totals before this call
        (calls decided, tokens reported, output tokens reserved by calls still in flight), so budgets stay pure."""
        if kind != "call":
            return Verdict("deny", "models.kind", f"unknown model kind {kind!r}")
        models = self.data.get("models")
        if models is None:
            return Verdict("deny", "models.none", "the policy allows no model calls (it has no [models] section)")
        if facts.get("request_error"):
            return Verdict("deny", "models.request", str(facts["request_error"])[:300])
        provider, model = facts.get("provider"), facts.get("model")
        if not (isinstance(provider, str) and isinstance(model, str)):
            return Verdict("deny", "models.request", "a model call that names no provider and model")
        mode, want = facts.get("mode"), self.model("mode")
        if want == "replay" and mode != "replay":
            return Verdict("deny", "models.mode", "[models] mode = \"replay\": calls are served from a bundle's "
                                                  "recordings only, never sent upstream")
        if mode not in MODEL_MODES:
            return Verdict("deny", "models.mode", f"unknown mode {mode!r}")
        name = f"{provider}:{model}"
        rule = next((f"models.allow[{i}]" for i, pattern in enumerate(self.model("allow"))
                     if fnmatch.fnmatchcase(name, pattern)), None)
        if rule is None:
            return Verdict("deny", "models.allow", f"{name} is not in [models] allow")
        if mode == "replay" and facts.get("recorded") is not True:
            return Verdict("deny", "models.replay", f"replay: this {name} request was not recorded in the bundle "
                                                    "being replayed (or no bundle was given), and replay never "
                                                    "calls upstream")
        if mode != "replay" and provider not in models.get("providers", {}):
            return Verdict("deny", "models.provider", f"[models.{provider}] is not configured")
        ints = {k: facts.get(k) for k in ("run_calls", "run_input_tokens", "run_output_tokens", "request_size")}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints.values()):
            return Verdict("deny", "models.request", "a model call without the run's totals")
        asked = facts.get("max_output")
        if asked is not None and not (isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0):
            return Verdict("deny", "models.request", "max output tokens that are not a count")
        if ints["request_size"] > self.model("max_request_bytes"):
            return Verdict("deny", "models.max_request_bytes",
                           f"the request is {ints['request_size']} bytes, over {self.model('max_request_bytes')}")
        limit = self.model("max_calls")
        if limit and ints["run_calls"] >= limit:
            return Verdict("deny", "models.max_calls", f"the run has made its {limit} model call(s)")
        per_call = self.model("max_output_tokens_per_call")
        if per_call and (asked is None or asked > per_call):
            return Verdict("deny", "models.max_output_tokens_per_call",
                           f"the request must ask for at most {per_call} output tokens (max_tokens), "
                           f"it asks for {'no limit' if asked is None else asked}")
        limit = self.model("max_input_tokens")
        if limit and ints["run_input_tokens"] >= limit:
            return Verdict("deny", "models.max_input_tokens",
                           f"the run has used {ints['run_input_tokens']} of its {limit} input tokens")
        limit = self.model("max_output_tokens")
        if limit and ints["run_output_tokens"] + (asked or 0) > limit:
            return Verdict("deny", "models.max_output_tokens",
                           f"the run has used or reserved {ints['run_output_tokens']} of its {limit} output tokens; "
                           f"this call asks for {asked if asked is not None else 'more'}")
        if limit and asked is None:
            return Verdict("deny", "models.max_output_tokens",
                           "with a run output budget the request must say how many output tokens it may use "
                           "(max_tokens)")
        return Verdict("allow", rule)
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
    models = data.pop("models", None)
    if models is not None:
        out["models"] = _validate_models(models, name, out.get("secrets", {}))
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
    if "signer" in out:
        _validate_signer(out["signer"], name)
    return out


def _validate_signer(signer: dict[str, Any], name: str) -> None:
    """[signer]: a central Tracekit signer over HTTPS (tkbox_nb/central_signer.py); absent, the machine signer."""
    from urllib.parse import urlsplit
    url = signer.get("url", "")
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        raise PolicyError(f"{name}: signer.url {url!r} is not a URL") from None
    if u.scheme != "https" or not u.hostname or u.username or u.password or u.path not in ("", "/") or u.query \
            or u.fragment or port == 0:
        raise PolicyError(f"{name}: signer.url must be https://HOST[:PORT] (no path, user, query or fragment)")
    for key in ("token_file", "ca", "store_dsn_file"):
        if not signer.get(key):
            raise PolicyError(f"{name}: signer.{key} is required with signer.url")
    for key in ("token_file", "ca", "store_dsn_file", "trust"):
        value = signer.get(key)
        if value and ("\x00" in value or not value.startswith("/")):
            raise PolicyError(f"{name}: signer.{key} must be an absolute path (the file's path on the box's host)")


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
        from .doors.hostnames import HostError, literal_address
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


def _validate_models(models: Any, name: str, secrets: dict[str, Any]) -> dict[str, Any]:
    """[models] (mode, allow, budgets) and one [models.PROVIDER] table per provider a call may go to."""
    if not isinstance(models, dict):
        raise PolicyError(f"{name}: [models] must be a table")
    out: dict[str, Any] = {"providers": {}}
    for key, value in models.items():
        where = f"{name}: models.{key}"
        if key in MODEL_PROVIDERS:
            out["providers"][key] = _validate_provider(value, where, secrets)
            continue
        if key not in MODEL_KEYS:
            raise PolicyError(f"{where}: unknown key (known: {', '.join(sorted(MODEL_KEYS))}, and the provider "
                              f"tables {', '.join(MODEL_PROVIDERS)})")
        want = MODEL_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, want):
            raise PolicyError(f"{where} must be {_tname(want)}")
        if key == "mode" and value not in MODEL_MODES:
            raise PolicyError(f"{where} must be one of {', '.join(MODEL_MODES)}, not {value!r}")
        if key == "allow":
            for pattern in value:
                provider, sep, model = pattern.partition(":") if isinstance(pattern, str) else ("", "", "")
                if not sep or not model or provider not in MODEL_PROVIDERS or len(pattern) > 200:
                    raise PolicyError(f"{where} entry {pattern!r} must be PROVIDER:MODEL (PROVIDER one of "
                                      f"{', '.join(MODEL_PROVIDERS)}; MODEL may use * and ?)")
            if len(value) > MAX_LIST:
                raise PolicyError(f"{where} has more than {MAX_LIST} entries")
        if key.startswith("max_") and value < 0:
            raise PolicyError(f"{where} must be 0 (no limit) or more")
        if key == "max_request_bytes" and not 0 < value <= MAX_REQUEST_BYTES:
            raise PolicyError(f"{where} must be between 1 and {MAX_REQUEST_BYTES}")
        if key == "timeout_s" and not value > 0:
            raise PolicyError(f"{where} must be positive")
        out[key] = value
    if out.get("mode") != "replay":
        for provider in out["providers"].values():
            if "key" not in provider and "secret" not in provider:
                raise PolicyError(f"{name}: models.{provider['name']} needs key = \"env:VAR\" (or file:PATH) or "
                                  "secret = \"NAME\" of a [secrets.NAME] binding")
    return out


def _validate_provider(body: Any, where: str, secrets: dict[str, Any]) -> dict[str, Any]:
    from urllib.parse import urlsplit
    if not isinstance(body, dict):
        raise PolicyError(f"{where} must be a table")
    for key, value in body.items():
        if key not in PROVIDER_KEYS:
            raise PolicyError(f"{where}: unknown key {key} (known: {', '.join(sorted(PROVIDER_KEYS))})")
        if not isinstance(value, str) or not value or "\x00" in value:
            raise PolicyError(f"{where}.{key} must be a non-empty string")
    provider = where.rsplit(".", 1)[1]
    url = body.get("base_url", PROVIDER_URLS[provider]).rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port
    except ValueError:
        raise PolicyError(f"{where}.base_url {url!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment \
            or "@" in parts.netloc:
        raise PolicyError(f"{where}.base_url must be http(s)://HOST[:PORT][/PATH], without user, query or fragment")
    if "key" in body and "secret" in body:
        raise PolicyError(f"{where}: give key or secret, not both")
    if "key" in body and not re.fullmatch(r"(env:[A-Za-z_][A-Za-z0-9_]*|file:.+)", body["key"]):
        raise PolicyError(f"{where}.key must be env:VAR or file:PATH (where the host reads the key; never the key)")
    if "secret" in body and body["secret"] not in secrets:
        raise PolicyError(f"{where}.secret names {body['secret']!r}, which is not a [secrets.NAME] binding here")
    return {"name": provider, **body, "base_url": url}


def _tname(t: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    if isinstance(t, tuple):
        return "a number" if set(t) == {int, float} else " or ".join(names[x] for x in t)
    return names[t]
