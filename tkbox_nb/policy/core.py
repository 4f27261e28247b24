"""The box policy: what a user writes (TOML), validated strictly, and the pure function that decides a crossing.

The policy is identified by the SHA-256 of its exact source bytes, and the same `decide` runs in the door (to state
the box's verdict to the signer) and in `tkbox verify` (to re-derive every disclosed decision from the disclosed
policy source). So `decide` must be a pure function of (policy, facts): no clock, no environment, no I/O.

Sections not yet enforced by a door are refused, not ignored: a policy that says more than the box can enforce is an
error, never a silent loosening.

This module is the one place a policy is loaded and validated as a whole; each door's section (its keys, defaults,
own checks and decide function) is a module beside it, and `Policy.decide` hands a crossing to its door's module.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import box, egress, host, models, mounts, packages, patch, refusals, secrets, signer, workspace
from tkbox_nb.policy import exec as exec_
from tkbox_nb.policy.base import MAX_LIST, Verdict, tname
from tkbox_nb.rules.door_table import BOX, EGRESS, EXEC, HOST, MODEL, PACKAGES, PATCH, SECRETS, TABLE, Door

MAX_POLICY_BYTES = 256 * 1024

# each door's decide function (rules/door_table.py lists the doors): a door of the table without one fails at import
Decider = Callable[["Policy", Any, dict[str, Any]], Verdict]
DECIDERS: dict[str, Decider] = {
    BOX: lambda policy, kind, facts: box.decide(kind, facts),
    EXEC: exec_.decide,
    EGRESS: egress.decide,
    SECRETS: lambda policy, kind, facts: secrets.decide(kind, facts),
    MODEL: models.decide,
    PATCH: patch.decide,
    HOST: lambda policy, kind, facts: host.decide(kind, facts),  # a host-side magic: the user's own act
    PACKAGES: packages.decide,
}

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

# the sections of plain keys: section -> {key: type}, and their defaults ([secrets] and [models] have tables)
_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "box": box.SCHEMA, "exec": exec_.SCHEMA, "egress": egress.SCHEMA, "patch": patch.SCHEMA, "signer": signer.SCHEMA,
    "workspace": workspace.SCHEMA, "packages": packages.SCHEMA}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "box": box.DEFAULTS, "exec": exec_.DEFAULTS, "egress": egress.DEFAULTS, "patch": patch.DEFAULTS,
    "signer": signer.DEFAULTS, "workspace": workspace.DEFAULTS, "packages": packages.DEFAULTS}
_LATER: dict[str, str] = {}  # sections a later door will enforce (none now)
SECTIONS = (*_SCHEMA, "models", "mounts", "secrets")


def check_deciders(deciders: dict[str, Decider], table: tuple[Door, ...] = TABLE) -> None:
    """Every door of `table` has a decide function here and reads a section a policy may have; a door decided here
    is in the table. RuntimeError naming each that is not, in one line: a door without a decider would refuse every
    crossing of it as `door.unknown`, quietly."""
    wrong = [f"{d.name} (no decide function)" for d in table if d.name not in deciders] + \
        [f"{d.name} (reads [{d.section}], which no policy has)" for d in table
         if d.section is not None and d.section not in SECTIONS] + \
        [f"{n} (decided but not in the door table)" for n in deciders if n not in {d.name for d in table}]
    if wrong:
        raise RuntimeError(f"policy/core.py DECIDERS and rules/door_table.py disagree: {', '.join(wrong)}")


check_deciders(DECIDERS)


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
        from tkbox_nb.core.atomic_file import read_capped
        p = Path(path)
        try:
            raw = read_capped(p, MAX_POLICY_BYTES)  # a regular file, at most MAX+1 bytes read (a FIFO never hangs)
        except OSError as e:
            raise PolicyError(f"{p}: cannot read the policy: {e.strerror or e}") from None
        except ValueError as e:
            raise PolicyError(f"{p}: the policy is {e}" if "larger" in str(e) else
                              f"{p}: cannot read the policy: {e}") from None
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
        if kind == refusals.KIND:  # the count a door signs of the refusals it did not sign one by one
            return refusals.decide(door, facts)
        decider = DECIDERS.get(door) if isinstance(door, str) else None
        if decider is not None:
            return decider(self, kind, facts)
        return Verdict("deny", "door.unknown", f"no door {door!r} in this version")

    # -- what the doors ask of a policy besides a decision -------------------------------------------------------
    def allow_cidrs(self) -> tuple:
        return egress.allow_cidrs(self)

    def egress_allow_index(self, host: str, port: int) -> int | None:
        """The first `[egress] allow` entry that matches host:port (policy/egress.py)."""
        return egress.allow_index(self, host, port)

    def model(self, key: str) -> Any:
        """A [models] setting (its default when the policy has no [models] or does not say)."""
        return models.setting(self, key)

    def host_reads(self, models_replayed: bool = False) -> str | None:
        """The first section of this policy that would read the host's secrets or keys, or send a token to a signer
        (a [secrets.NAME] not prompted for, a [models.PROVIDER] key unless model calls are served from recordings,
        which read no key, [signer]); None when it names none. A policy taken from a bundle must name none: its
        author chose where they would go."""
        for name, spec in self.data.get("secrets", {}).items():
            if spec.get("source") != "prompt":
                return f"[secrets.{name}] (source {str(spec.get('source'))[:60]!r})"
        for name, provider in self.data.get("models", {}).get("providers", {}).items():
            if "key" in provider and not models_replayed:
                return f"[models.{name}] key"
        if self.data.get("signer", {}).get("url"):
            return "[signer]"
        if self.data.get("workspace", {}).get("path") not in (None, "", "none"):
            return "[workspace] path"
        return None


def policy_hash(source: str) -> str:
    return "sha256:" + hashlib.sha256(source.encode("utf-8")).hexdigest()


def _validate(data: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The parsed TOML, checked strictly: every section and key known, every value of its type; then each section's
    own checks, in a fixed order (so the first error a policy has is always the one named)."""
    out: dict[str, dict[str, Any]] = {}
    secrets_table = data.pop("secrets", None)
    if secrets_table is not None:
        out["secrets"] = secrets.validate(secrets_table, name)
    models_table = data.pop("models", None)
    if models_table is not None:
        out["models"] = models.validate(models_table, name, out.get("secrets", {}))
    mounts_table = data.pop("mounts", None)
    if mounts_table is not None:
        out["mounts"] = mounts.validate(mounts_table, name)
    for section, body in data.items():
        if section in _LATER:
            raise PolicyError(f"{name}: [{section}] is not enforced by this version ({_LATER[section]} is not built "
                              "yet); remove it rather than rely on it")
        if section not in _SCHEMA:
            known = ', '.join(sorted(SECTIONS))
            raise PolicyError(f"{name}: unknown section [{section}] (known: {known})")
        if not isinstance(body, dict):
            raise PolicyError(f"{name}: [{section}] must be a table")
        keys = _SCHEMA[section]
        for key, value in body.items():
            if key not in keys:
                raise PolicyError(f"{name}: unknown key {section}.{key} (known: {', '.join(sorted(keys))})")
            want = keys[key]
            if isinstance(value, bool) and want is not bool and bool not in (want if isinstance(want, tuple) else ()):
                raise PolicyError(f"{name}: {section}.{key} must be {tname(want)}, not a boolean")
            if not isinstance(value, want):
                raise PolicyError(f"{name}: {section}.{key} must be {tname(want)}, not {type(value).__name__}")
            if want is list:
                if len(value) > MAX_LIST or not all(isinstance(v, str) and v and "\x00" not in v for v in value):
                    raise PolicyError(f"{name}: {section}.{key} must be a list of at most {MAX_LIST} non-empty strings")
        out[section] = dict(body)
    box.validate(out, name)
    egress.validate(out, name)
    patch.validate(out, name)
    exec_.validate(out, name)
    workspace.validate(out, name)
    packages.validate(out, name)
    if "signer" in out:
        signer.validate(out["signer"], name)
    return out
