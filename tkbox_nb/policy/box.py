"""[box]: which backend runs the box, the weakest isolation it may have, and its limits; and the box's own events.

Two limits bound what a box can make its run record (signing/refusal_caps.py, signing/recorder.py): `max_refusals`, the
refused crossings each door signs one by one in a run before it only counts them (the count signed at most once a
second), and `max_run_mib`, the estimated size of the run's bundle at which the run is ended fail-closed, its bundle
written, kept under the 512 MiB a bundle may hold (bundle.check_limits).

A box's start and stop are always allowed: they are recorded so the run says what ran; a policy refuses a box by
these settings before it starts (backends.registry compares `isolation`).
"""

from __future__ import annotations

import re
from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import Verdict

BACKENDS = ("auto", "bwrap", "qemu", "firecracker")
ISOLATION = ("namespace", "vm")  # a minimum: "vm" refuses to start a namespace box rather than fall back to one
SCHEMA: dict[str, type | tuple[type, ...]] = {
    "backend": str, "isolation": str, "memory_mib": int, "cpus": int, "cpu_time_s": int, "max_processes": int,
    "workspace_mib": int, "jailer": bool, "max_refusals": int, "max_run_mib": int, "gpus": (str, int, list),
    "gpu_caps": bool}
DEFAULTS: dict[str, Any] = {
    "backend": "auto", "isolation": "namespace", "memory_mib": 2048, "cpus": 1, "cpu_time_s": 3600,
    "max_processes": 256, "workspace_mib": 1024, "jailer": False, "max_refusals": 1000, "max_run_mib": 384,
    "gpus": None, "gpu_caps": False}  # gpus: none unless named (backends/gpus.py)
MAX_REFUSALS = 100_000  # signed one by one per door: more and the refusals alone could pass the run size limit
MAX_RUN_MIB = 448  # the bundle limit (512 MiB) less a margin for what the estimate cannot see ahead (the stop, zip)


def validate(out: dict[str, dict[str, Any]], name: str) -> None:
    """What [box] must hold beyond its keys' types (core.py checked those)."""
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
    _validate_gpus(out.get("box", {}).get("gpus"), name)
    for key, high in (("max_refusals", MAX_REFUSALS), ("max_run_mib", MAX_RUN_MIB)):
        v = out.get("box", {}).get(key)
        if v is not None and not (0 if key == "max_refusals" else 1) <= v <= high:
            raise PolicyError(f"{name}: box.{key} must be from {0 if key == 'max_refusals' else 1} to {high}, "
                              f"not {v}")


def _validate_gpus(v: Any, name: str) -> None:
    """`gpus`: "all", a count of at least 1, or a list of GPU indexes and UUIDs (as strings); absent, none. Whether
    the host has them is decided when a box starts (backends/gpus.py). A MIG instance is refused by name: giving one
    would need its parent GPU's node and the nvidia-caps nodes of its instances, which is not built."""
    if v is None or v == "all" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64):
        return
    mig = next((x for x in v if isinstance(x, str) and x.startswith("MIG-")), None) if isinstance(v, list) else None
    if mig is not None:  # a MIG instance (MIG-<uuid>, or MIG-GPU-<uuid>/<gi>/<ci>): not a whole GPU (backends.md)
        raise PolicyError(f"{name}: box.gpus names the MIG instance {mig[:60]!r}: MIG is not supported, a box gets "
                          "whole GPUs only (name one by index or GPU- UUID)")
    if isinstance(v, list) and 1 <= len(v) <= 64 and all(
            isinstance(x, str) and (x.isdigit() and len(x) <= 3 or re.fullmatch(r"GPU-[0-9a-f-]{36}", x)) for x in v):
        return
    raise PolicyError(f"{name}: box.gpus must be \"all\", a count from 1 to 64, or a list of GPU indexes and UUIDs "
                      f"as strings (\"0\", \"GPU-...\"), not {str(v)[:60]!r}; leave it out for no GPU")


def decide(kind: Any, facts: dict[str, Any]) -> Verdict:
    """A box event: its start or its stop."""
    if kind in ("start", "stop"):
        return Verdict("allow", f"box.{kind}")
    return Verdict("deny", "box.unknown", f"unknown box event {kind!r}")
