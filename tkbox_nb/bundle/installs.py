"""What was installed during a run: the package door's signed crossings read back as the environment's rows.

The environment manifest (bundle/environment.py) is what the box started with; pip in the box can add to it through
the package door (doors/packages.py), which signs each file it decides with its project, version and sha256. Those
crossings are the record of what came in, so a run's environment is its manifest and these rows together:
`Run.installs` (one row per file decided, and per project refused before any file), the rows of kind `installed`
that `Run.environment` adds, `tkbox show --environment`, the run view's environment line and the audit, which
compares them package by package.

Everything here is read from a bundle (hostile): each value is text cut to a limit, never trusted to have a shape.
Pure: it reads the crossings it is given, of any object with `door`, `seq`, `decision`, `args` and `result` (and
`rule_ids`, the signer's rules, when it has them).
"""

from __future__ import annotations

from typing import Any

from tkbox_nb.rules.door_table import PACKAGES

COLUMNS = ["seq", "kind", "project", "version", "filename", "sha256", "got_sha256", "size", "source", "index",
           "decision", "rule", "verdict", "rule_ids"]
MAX_TEXT = 300


def _s(v: Any, limit: int = MAX_TEXT) -> str:
    return v[:limit] if isinstance(v, str) else "" if v is None else str(v)[:limit]


def rows(crossings: list) -> list[dict[str, Any]]:
    """One row per file the package door decided (kind `file`: served when `decision` is allow) and per project it
    refused before any file (kind `project`), in run order. `rule` and `verdict` are the box policy's (as the door
    stated them), `rule_ids` the signer's (comma-joined): a row whose `verdict` is allow and whose `decision` is not
    was refused by the signer's own rules, and `rule_ids` names which."""
    out = []
    for c in crossings:
        a = c.args or {}
        if c.door != PACKAGES or a.get("kind") not in ("file", "project"):
            continue
        if a.get("kind") == "project" and c.decision == "allow":  # a page served: what came of it is its files
            continue
        size = a.get("size")
        out.append({"seq": c.seq, "kind": a.get("kind"), "project": _s(a.get("project")),
                    "version": _s(a.get("version")), "filename": _s(a.get("filename")),
                    "sha256": _s(a.get("sha256"), 64), "got_sha256": _s(a.get("got_sha256"), 64),
                    "size": size if isinstance(size, int) and not isinstance(size, bool) else 0,
                    "source": _s(a.get("source")), "index": _s(a.get("index")), "decision": _s(c.decision, 40),
                    "rule": _s(a.get("rule")), "verdict": _s(a.get("verdict"), 40),
                    "rule_ids": _s(",".join(str(r) for r in getattr(c, "rule_ids", None) or []))})
    return out


def installed(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The files the door served (allowed), each once (a project installed twice, from a page and then the cache,
    is one file): what the box's environment gained."""
    seen, out = set(), []
    for r in rs:
        if r["kind"] == "file" and r["decision"] == "allow" and (r["filename"], r["sha256"]) not in seen:
            seen.add((r["filename"], r["sha256"]))
            out.append(r)
    return out


def environment_rows(rs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The rows `Run.environment` adds (environment.COLUMNS): kind `installed`, the project, its version, the file
    (as location) and its sha256 (as digest)."""
    return [{"kind": "installed", "name": r["project"], "version": r["version"], "location": r["filename"],
             "digest": f"sha256:{r['sha256']}"} for r in installed(rs)]


def summary(rs: list[dict[str, Any]]) -> str:
    """In a few words: how many files came in during the run and how many were refused ("" when none crossed)."""
    if not rs:
        return ""
    got = installed(rs)
    refused = sum(r["decision"] != "allow" for r in rs)
    names = ", ".join(f"{r['project']} {r['version']}" for r in got[:5]) + (", ..." if len(got) > 5 else "")
    return (f"{len(got)} file{'s' * (len(got) != 1)} installed during the run" + (f" ({names})" if got else "")
            + (f", {refused} refused" if refused else ""))
