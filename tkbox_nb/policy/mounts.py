"""[mounts.NAME]: host data a box reads and can never change, each a `source` on the host shown at `target`.

Experiments read gigabytes of data they must not change; copying it into the workspace (a tmpfs in RAM, copied at
every start) cannot hold it. A mount is always read-only, and its content digest is signed at the box's start
(bundle/mount_digest.py), so an audit knows two runs read the same data. This module checks what the policy alone can
say (pure: no file is looked at); what the host says about `source` (it exists, holds no FIFO or device, lies outside
$TKBOX_HOME) is checked when a box starts (backends/mounts.py), before anything is signed.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from tkbox_nb.core.errors import PolicyError

KEYS = ("source", "target")
NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
MAX_MOUNTS = 64
MAX_PATH = 1024
# what the box itself uses (backends/bwrap.py, the guest, the VM images): a target may be none of these, under none,
# and hold none (a mount over /opt would hide /opt/tkbox, the agent)
RESERVED = ("/workspace", "/proc", "/dev", "/sys", "/tmp", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32",
            "/lib64", "/libx32", "/opt/tkbox", "/run/tkbox", "/root", "/home", "/var/tmp")


def _overlaps(a: str, b: str) -> bool:
    """Whether one of two normal absolute paths is the other or lies under it."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def path_problem(path: Any, what: str) -> str:
    """Why `path` is not a normal absolute path (no `.`, `..`, `//`, trailing `/`, control character), or ""."""
    if not isinstance(path, str) or not path:
        return f"{what} must be a non-empty string"
    if len(path) > MAX_PATH or any(ord(c) < 32 or c == "\x7f" for c in path):
        return f"{what} must be at most {MAX_PATH} characters with no control character"
    if not path.startswith("/") or posixpath.normpath(path) != path or path.startswith("//"):
        return f"{what} must be an absolute path in normal form (no '.', '..', '//' or trailing '/'), not {path!r}"
    return ""


def validate(mounts: Any, name: str) -> dict[str, dict[str, Any]]:
    """[mounts.NAME] tables, each {source, target}; targets none of the box's own paths and no two overlapping."""
    if not isinstance(mounts, dict):
        raise PolicyError(f"{name}: [mounts] must hold [mounts.NAME] tables")
    if len(mounts) > MAX_MOUNTS:
        raise PolicyError(f"{name}: at most {MAX_MOUNTS} mounts")
    out: dict[str, dict[str, Any]] = {}
    for mount, body in mounts.items():
        where = f"{name}: mounts.{mount}"
        if not re.fullmatch(NAME, mount):
            raise PolicyError(f"{where}: a mount's name must be letters, digits, '_', '.' or '-' (at most 64, not "
                              "starting with '.' or '-')")
        if not isinstance(body, dict):
            raise PolicyError(f"{where} must be a table with source and target")
        for key in body:
            if key not in KEYS:
                hint = " (a mount is always read-only)" if key in ("readonly", "read_only", "rw", "mode") else ""
                raise PolicyError(f"{where}: unknown key {key} (known: {', '.join(KEYS)}){hint}")
        for key in KEYS:
            if key not in body:
                raise PolicyError(f"{where}: {key} is missing")
            problem = path_problem(body[key], f"{key}")
            if problem:
                raise PolicyError(f"{where}: {problem}")
        target = body["target"]
        if target == "/":
            raise PolicyError(f"{where}: target / would hide the whole box")
        hit = next((r for r in RESERVED if _overlaps(target, r)), None)
        if hit is not None:
            raise PolicyError(f"{where}: target {target} is over {hit}, which the box itself uses")
        other = next((m for m, b in out.items() if _overlaps(target, b["target"])), None)
        if other is not None:
            raise PolicyError(f"{where}: target {target} overlaps mounts.{other}'s target {out[other]['target']} "
                              "(two mounts on one target, or one inside another)")
        out[mount] = {"source": body["source"], "target": target}
    return out
