"""[patch]: whether and how the box's workspace patch is applied to the host's directory, which paths, how large;
and the decision on one file of it (doors/patch.py states each file's facts)."""

from __future__ import annotations

from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import Settings, Verdict

PATCH_APPLY = ("never", "review", "auto")
SCHEMA: dict[str, type | tuple[type, ...]] = {
    "apply": str, "allow": list, "deny": list, "max_file_bytes": int, "max_total_bytes": int, "max_files": int,
    "binary": bool}
DEFAULTS: dict[str, Any] = {"apply": "review", "allow": ["**"], "deny": [], "max_file_bytes": 10 << 20,
                            "max_total_bytes": 100 << 20, "max_files": 10_000, "binary": True}


def validate(out: dict[str, dict[str, Any]], name: str) -> None:
    """What [patch] must hold beyond its keys' types (core.py checked those)."""
    patch = out.get("patch", {})
    if patch.get("apply", "review") not in PATCH_APPLY:
        raise PolicyError(f"{name}: patch.apply must be one of {', '.join(PATCH_APPLY)}, not {patch['apply']!r}")
    for key in ("max_file_bytes", "max_total_bytes", "max_files"):
        v = patch.get(key)
        if v is not None and not 0 < v <= 1 << 40:
            raise PolicyError(f"{name}: patch.{key} must be positive (and at most 2**40)")


def decide(policy: Settings, kind: Any, facts: dict[str, Any]) -> Verdict:
    """One file of the box's workspace patch. The always-rules (rules/patch_rules.py) come first, then the
    limits, then the policy's deny and allow globs. What depends on the rest of the patch (a path seen twice,
    a collision, the total so far) is stated by the door in the facts."""
    from tkbox_nb.rules import patch_rules as r
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
    now = isinstance(facts.get("rules"), int) and facts["rules"] >= 2  # see patch_rules.RULES
    source = facts.get("from")
    if op == "rename":
        why = r.path_problem(source)
        if why or r.is_git(source):
            return Verdict("deny", "patch.from", f"the rename source: {why or 'a .git path'}")
        if now and r.fold(source) == r.fold(path):
            return Verdict("deny", "patch.from", "the rename source is its own target")
        if now and facts.get("from_base") is None:
            return Verdict("deny", "patch.from", "the rename source is not a regular file the box started with")
        if facts.get("from_taken"):
            taken = str(facts["from_taken"])[:200]
            return Verdict("deny", "patch.from", f"the rename source went to {taken!r} already")
    if not (ftype == "file" or op == "delete" and ftype == "symlink"):
        return Verdict("deny", "patch.type", f"a {str(ftype)[:20]} is never applied (only regular files)")
    for key, rule, what in (("duplicate_of", "patch.duplicate", "the same path twice"),
                            ("collides_with", "patch.collision", "collides (case or Unicode form) with")):
        if facts.get(key):
            return Verdict("deny", rule, f"{what} {str(facts[key])[:200]!r}" if key == "collides_with" else what)
    if now and op in ("add", "rename") and facts.get("base") is not None:
        return Verdict("deny", "patch.overwrite", f"an {op} onto {path}, a file the box started with")
    sides = [(path, "")] + ([(source, "the rename source ")] if now and op == "rename" else [])
    for name, side in sides:  # a rename deletes its source: it passes only where that delete would
        denied = _denied(policy, name, side)
        if denied:
            return denied
    size, total, index = facts.get("size"), facts.get("total_before"), facts.get("index")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, total, index)):
        return Verdict("deny", "patch.facts", "a patch entry without its size, index and running total")
    if index >= policy.get("patch", "max_files"):
        return Verdict("deny", "patch.max_files", f"more than {policy.get('patch', 'max_files')} files")
    if op != "delete":
        if size > policy.get("patch", "max_file_bytes"):
            return Verdict("deny", "patch.max_file_bytes",
                           f"{size} bytes, over {policy.get('patch', 'max_file_bytes')}")
        if total + size > policy.get("patch", "max_total_bytes"):
            return Verdict("deny", "patch.max_total_bytes",
                           f"the patch would pass {policy.get('patch', 'max_total_bytes')} bytes")
        if facts.get("binary") is not False and not policy.get("patch", "binary"):
            return Verdict("deny", "patch.binary", "a binary file ([patch] binary = false)")
    globs = policy.get("patch", "allow")
    allowed = [next((i for i, pattern in enumerate(globs) if r.glob_match(pattern, name)), None) for name, _ in sides]
    for (name, side), i in zip(sides, allowed):
        if i is None:
            return Verdict("deny", "patch.allow", f"{side}{name} is not in [patch] allow")
    return Verdict("allow", f"patch.allow[{allowed[0]}]")


def _denied(policy: Settings, path: str, side: str) -> Verdict | None:
    """The default and the policy's deny globs, for a file's path or (`side`) a rename's source."""
    from tkbox_nb.rules import patch_rules as r
    folded = r.fold(path)
    for i, pattern in enumerate(r.DEFAULT_DENY):
        if r.glob_match(pattern.casefold(), folded):
            return Verdict("deny", f"patch.deny_default[{i}]", f"{side}{path} matches {pattern}")
    for i, pattern in enumerate(policy.get("patch", "deny")):
        if r.glob_match(pattern, path) or r.glob_match(pattern.casefold(), folded):
            return Verdict("deny", f"patch.deny[{i}]", f"{side}{path} matches {pattern}")
    return None
