"""[exec]: whether cells and widgets' messages run, which commands, and their time and output limits."""

from __future__ import annotations

import fnmatch
from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import Settings, Verdict, seconds_problem

SCHEMA: dict[str, type | tuple[type, ...]] = {
    "cells": bool, "comms": bool, "commands": list, "deny_commands": list, "timeout_s": (int, float),
    "max_output_bytes": int}
DEFAULTS: dict[str, Any] = {
    "cells": True, "comms": True, "commands": ["*"], "deny_commands": [], "timeout_s": 600,
    "max_output_bytes": 16 << 20}


def validate(out: dict[str, dict[str, Any]], name: str) -> None:
    """What [exec] must hold beyond its keys' types (core.py checked those)."""
    for key in ("timeout_s", "max_output_bytes"):
        v = out.get("exec", {}).get(key)
        if v is not None and not v > 0:
            raise PolicyError(f"{name}: exec.{key} must be positive")
    v = out.get("exec", {}).get("timeout_s")
    if v is not None and seconds_problem(v, 30 * 86400):
        raise PolicyError(f"{name}: exec.timeout_s {seconds_problem(v, 30 * 86400)}")


def decide(policy: Settings, kind: Any, facts: dict[str, Any]) -> Verdict:
    """A cell, a cell's late output, a widget's comm message, or a command (by its program's name: deny_commands
    first, then commands)."""
    if kind == "cell":
        if policy.get("exec", "cells"):
            return Verdict("allow", "exec.cells")
        return Verdict("deny", "exec.cells", "the policy runs no cells ([exec] cells = false)")
    if kind == "late_output":  # what a cell's thread sent after the cell's end was signed, shown once signed
        if policy.get("exec", "cells"):
            return Verdict("allow", "exec.cells")
        return Verdict("deny", "exec.cells", "the policy runs no cells ([exec] cells = false)")
    if kind == "comm":  # a widget's message from the frontend into the box
        if policy.get("exec", "cells") and policy.get("exec", "comms"):
            return Verdict("allow", "exec.comms")
        return Verdict("deny", "exec.comms", "the policy takes no comm messages ([exec] comms = false)")
    if kind == "command":
        argv = facts.get("argv")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            return Verdict("deny", "exec.argv", "a command needs a non-empty argv of strings")
        program = argv[0].rsplit("/", 1)[-1]
        for i, pattern in enumerate(policy.get("exec", "deny_commands")):
            if fnmatch.fnmatchcase(program, pattern):
                return Verdict("deny", f"exec.deny_commands[{i}]", f"{program!r} matches {pattern!r}")
        for i, pattern in enumerate(policy.get("exec", "commands")):
            if fnmatch.fnmatchcase(program, pattern):
                return Verdict("allow", f"exec.commands[{i}]")
        return Verdict("deny", "exec.commands", f"{program!r} is not in [exec] commands")
    return Verdict("deny", "exec.kind", f"unknown exec kind {kind!r}")
