"""[workspace]: what of the host's folder a box starts with (the notebook's folder for the kernel, `Box(workspace=)`,
`tkbox run --workspace`), and where a kernel's bundles go. Not a door: it has settings and checks, no decision.

The folder is copied in, never shared, so what is left out matters twice: a `.git` or a `.venv` makes the start slow
and the bundle's workspace digest depend on things the cells never read, and a folder of data gigabytes large is
better given as a dataset mount ([mounts.NAME]) than copied. `excluded` (core/tree_digest.py) is pure: the copy, the
digest the run states and a rerun's comparison all ask it, so they agree on what the box started from.
"""

from __future__ import annotations

from typing import Any

from tkbox_nb.core.errors import PolicyError

DEFAULT_EXCLUDE = [".git", ".venv", "venv", "__pycache__", ".ipynb_checkpoints", "node_modules", ".tkbox", "*.tkb"]
SCHEMA: dict[str, type | tuple[type, ...]] = {"path": str, "exclude": list, "max_mib": int, "runs_dir": str}
# path "": the kernel's working directory (the notebook's folder); "none": an empty workspace
DEFAULTS: dict[str, Any] = {"path": "", "exclude": DEFAULT_EXCLUDE, "max_mib": 256, "runs_dir": ".tkbox/runs"}


def validate(out: dict[str, dict[str, Any]], name: str) -> None:
    """What [workspace] must hold beyond its keys' types (core.py checked those)."""
    ws = out.get("workspace", {})
    v = ws.get("max_mib")
    if v is not None and not 0 < v <= 1 << 20:
        raise PolicyError(f"{name}: workspace.max_mib must be positive (and at most 2**20)")
    for key in ("path", "runs_dir"):
        if "\x00" in ws.get(key, ""):
            raise PolicyError(f"{name}: workspace.{key} contains a NUL character")
