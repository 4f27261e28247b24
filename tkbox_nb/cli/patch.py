"""`tkbox apply BUNDLE`: the review step of the patch door. Lists each file of a verified bundle's patch with its
signed decision, and writes the allowed ones into a workspace (tkbox_nb/doors/workspace_writer.py): only files the run
allowed, only where the host file is still what the box started from, never through a symlink. What it prints of
the bundle (paths, ops, rules, reasons) is shown with control and format characters escaped (core/visible.py); --json
escapes them as JSON does."""

from __future__ import annotations

import json
from pathlib import Path

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.core.visible import visible
from tkbox_nb.doors.workspace_writer import ApplyError, FileChange, apply_changes
from tkbox_nb.rules.door_table import PATCH


def planned_changes(run) -> list[tuple[dict, FileChange | None]]:
    """The run's patch, the last decision per path: (its disclosed arguments, the change if it was allowed)."""
    last: dict[str, tuple[dict, FileChange | None]] = {}
    for c in run.crossings():
        a = c.args or {}
        if c.door != PATCH or a.get("kind") != "file" or not isinstance(a.get("path"), str):
            continue
        change = None
        if c.decision == "allow" and a.get("verdict") == "allow":
            content = run.content(a["content"]) if a.get("op") != "delete" else None
            if a.get("op") != "delete" and content is None:
                raise TkboxError(f"the bundle lacks the content of {a['path']!r}")
            old_mode = a.get("old_mode")  # stated since the `rules` fact (2)
            change = FileChange(a["path"], a["op"], content, int(a.get("mode", 0o644)), a.get("base"),
                                a.get("from"), a.get("from_base"), old_mode if isinstance(old_mode, int) else None)
        last.pop(a["path"], None)
        last[a["path"]] = (a, change)
    return list(last.values())


def _cmd_apply(a) -> int:
    from tkbox_nb.cli.replay import _verified
    run = _verified(a.bundle, a.trust)
    plan = planned_changes(run)
    workspace = Path(a.workspace)
    if not a.list and not workspace.is_dir():
        raise TkboxError(f"workspace {workspace} is not a directory")
    changes = [c for _, c in plan if c is not None]
    outcomes = {}
    if not a.list and changes:
        try:
            outcomes = {id(c): o for c, o in zip(changes, apply_changes(str(workspace), changes))}
        except ApplyError as e:
            raise TkboxError(str(e)) from None
    rows = []
    for args, change in plan:
        o = outcomes.get(id(change)) if change else None
        state = ("refused" if change is None else "listed" if a.list else "applied" if o and o.applied else
                 "not applied")
        why = args.get("verdict_reason", "") if change is None else (o.reason if o and not o.applied else "")
        rows.append({"path": args["path"], "op": args.get("op"), "rule": args.get("rule"), "state": state,
                     "reason": why})
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:  # a path, op, rule or reason from the bundle is shown escaped: it draws no row of its own
            reason = ": " + visible(r["reason"]) if r["reason"] else ""
            print(f"{r['state']:<12} {visible(r['op']):<7} {visible(r['path'])}  ({visible(r['rule'])}{reason})")
        done = sum(r["state"] == "applied" for r in rows)
        print(f"{len(rows)} file(s) in the patch: {sum(r['state'] != 'refused' for r in rows)} allowed"
              + ("" if a.list else f", {done} applied to {visible(workspace)}"))
    return 0 if a.list or all(r["state"] in ("applied", "refused") for r in rows) else 1


def add_commands(sub) -> None:
    p = sub.add_parser("apply", help="review a bundle's patch and write its allowed files into a workspace")
    p.add_argument("bundle")
    p.add_argument("-w", "--workspace", default=".", help="the workspace to write into (default: .)")
    p.add_argument("--list", action="store_true", help="only list the files and their decisions")
    p.add_argument("--trust", help="trust config (default: this machine's pinned trust)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_apply)
