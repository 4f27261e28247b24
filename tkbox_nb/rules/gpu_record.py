"""The GPUs a run's box.start signed, read back: for `%box_status`, `tkbox show`, the run view and the audit.

The host writes the field (`gpus` in box.start: JSON text, one object per GPU, backends/gpu_facts.py's `plan`) from
its own nvidia-smi, never from the box; but a bundle read back is hostile input, so `parse` takes only that shape,
bounded, and anything else reads as unreadable (None), never an error. What it returns is printed by callers that
escape it (core/visible.py, html.escape).

The audit compares what decides a result on a GPU: how many GPUs, each one's name, memory and compute capability,
and the driver and CUDA driver versions (`compared`); which physical GPU (its UUID) is named as context only, since a
rerun on another GPU of the same model is the same experiment (`uuid_change`).
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
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the JSON decoder recurses
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


COMPARED = ("name", "memory_mib", "compute_capability", "driver_version", "cuda_driver_version")
LABELS = {"name": "GPU name", "memory_mib": "GPU memory (MiB)", "compute_capability": "compute capability",
          "driver_version": "driver version", "cuda_driver_version": "CUDA driver version"}


def compared(value: Any) -> tuple[str, str]:
    """(compared value, shown value) for the audit: the GPUs in order, each by what decides its results (COMPARED,
    never its UUID), as canonical JSON; "none" for a box without GPUs, "unreadable" for a field of another shape."""
    if value is None:
        return "none", "none"
    gpus = parse(value)
    if gpus is None:
        return "unreadable", "GPUs unreadable"
    kept = json.dumps([{k: g[k] for k in COMPARED} for g in gpus], sort_keys=True, separators=(",", ":"))
    return kept, f"{_plural(len(gpus))} ({', '.join(sorted({g['name'] for g in gpus}))}), {_drivers(gpus)}"


def _read(value: str) -> list[dict[str, Any]] | None:
    if value == "none":
        return []
    try:
        got = json.loads(value) if len(value) <= MAX_TEXT else None
    except (ValueError, RecursionError):
        return None
    ok = isinstance(got, list) and all(isinstance(g, dict) and set(g) == set(COMPARED) for g in got)
    return got if ok else None


def changes(a: str, b: str) -> list[str]:
    """What differs between two runs' compared GPUs (`compared`'s values), one line per kind of fact: the count,
    then each of COMPARED whose values differ (a run without GPUs against one with: the count says so)."""
    ga, gb = _read(a), _read(b)
    if ga is None or gb is None:
        return [f"GPUs: {'unreadable' if ga is None else len(ga)} in A, {'unreadable' if gb is None else len(gb)} in B"]
    out = [f"GPUs: {len(ga)} in A, {len(gb)} in B"] if len(ga) != len(gb) else []
    for key in COMPARED:
        va, vb = (", ".join(sorted({str(g[key]) for g in gs})) or "none" for gs in (ga, gb))
        if va != vb:
            out.append(f"{LABELS[key]}: {va} in A, {vb} in B")
    return out


def uuid_change(a: Any, b: Any) -> str | None:
    """The audit's context line when the runs' GPUs are other physical GPUs (by UUID), else None."""
    ua, ub = ([g["uuid"] for g in parse(v) or []] if v is not None else [] for v in (a, b))
    if ua == ub:
        return None
    return f"GPU UUIDs: {', '.join(ua) or 'none'} in A, {', '.join(ub) or 'none'} in B"
