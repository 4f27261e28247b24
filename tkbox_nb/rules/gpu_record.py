"""The GPUs a run's box.start signed, read back: for `%box_status`, `tkbox show`, the run view and the audit.

The host writes the field (`gpus` in box.start: JSON text, one object per GPU, backends/gpu_facts.py's `plan`) from
its own nvidia-smi, never from the box; but a bundle read back is hostile input, so `parse` takes only that shape,
bounded, and anything else reads as unreadable (None), never an error. What it returns is printed by callers that
escape it (core/visible.py, html.escape).
"""

from __future__ import annotations

import json
from typing import Any

MAX_TEXT = 65536
MAX_GPUS = 64
MAX_FIELD = 200
FIELDS = {"index": int, "name": str, "uuid": str, "driver_version": str, "cuda_driver_version": str,
          "memory_mib": int, "compute_capability": str, "device": str}


def parse(value: Any) -> list[dict[str, Any]] | None:
    """The signed `gpus` field as a list of GPUs with every field of FIELDS of its type; None for any other shape."""
    try:
        got = json.loads(value) if isinstance(value, str) and len(value) <= MAX_TEXT else None
    except ValueError:
        return None
    if not isinstance(got, list) or not 0 < len(got) <= MAX_GPUS:
        return None
    for g in got:
        if not isinstance(g, dict):
            return None
        for key, kind in FIELDS.items():
            v = g.get(key)
            if not isinstance(v, kind) or isinstance(v, bool) or (isinstance(v, str) and len(v) > MAX_FIELD):
                return None
    return got


def _plural(n: int) -> str:
    return f"{n} GPU{'s' * (n != 1)}"


def _drivers(gpus: list[dict[str, Any]]) -> str:
    pairs = sorted({(g["driver_version"], g["cuda_driver_version"]) for g in gpus})
    return "; ".join(f"driver {d}, CUDA {c}" for d, c in pairs)


def names(value: Any) -> str:
    """"N GPU(s): name UUID, ..." (the run view, `tkbox show`'s header), or "GPUs unreadable"."""
    gpus = parse(value)
    if gpus is None:
        return "GPUs unreadable"
    return f"{_plural(len(gpus))}: " + ", ".join(f"{g['name']} {g['uuid']}" for g in gpus)


def status_line(value: Any) -> str:
    """`%box_status`'s line: each GPU's index, name, UUID and memory, then the driver and CUDA driver versions."""
    gpus = parse(value)
    if gpus is None:
        return "GPUs unreadable"
    each = "; ".join(f"{g['index']} {g['name']} {g['uuid']} {g['memory_mib']} MiB, compute {g['compute_capability']}"
                     for g in gpus)
    return f"{_plural(len(gpus))}: {each}; {_drivers(gpus)}"
