"""How a bubblewrap box is held to `memory_mib`: a memory cgroup of its own where one can be made, else RLIMIT_AS.

RLIMIT_AS caps address space, not memory: ML libraries map far more than they touch (torch's shared objects alone
pass 2 GiB of mappings; CUDA reserves address space for all of the GPU's and the host's memory), so an address-space
cap of `memory_mib` stops them at import while holding nothing a cgroup would not. A memory cgroup counts the pages
the box's processes really use (their tmpfs pages in /tmp and /dev/shm included) and the kernel's OOM killer ends a
process of the box that would pass it; nothing outside the box is touched. The box's cgroup is made as a child of
this process's own memory cgroup (so it also stays inside whatever holds the host process), named
`tkbox-<host pid>-<box id>` so one left by a killed host process is swept by the next (scratch.sweep).

Where no memory cgroup can be made (no writable v1 `memory` hierarchy, no cgroup v2 subtree delegated with the
memory controller), RLIMIT_AS = `memory_mib` stays the limit, as before, and box.start says so (`memory_limit`).
Where the cgroup holds, no RLIMIT_AS is set: a backstop of any size would be a guess at what a library maps.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from pathlib import Path

from tkbox_nb.core import scratch

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "tkbox-"  # then the host pid and the box id (scratch.sweep)
CGROUP, RLIMIT = "memory-cgroup", "rlimit-as"  # the mechanism named in the signed box.start (`memory_limit`)


def own_cgroup(proc_cgroup: str, root: Path = CGROUP_ROOT) -> tuple[str, Path] | None:
    """Where this process's memory cgroup lives, from /proc/self/cgroup's text: ("v1", dir) for a v1 `memory`
    hierarchy, ("v2", dir) for the unified one; None when neither is named. Pure apart from the paths it builds."""
    v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/") or ".." in parts[2].split("/"):
            continue
        rel = parts[2].lstrip("/")
        if "memory" in parts[1].split(","):
            return "v1", root / "memory" / rel
        if parts[0] == "0" and parts[1] == "":
            v2 = ("v2", (root / "unified" if (root / "unified").is_dir() else root) / rel)
    return v2


def parent() -> tuple[str, Path] | None:
    """The cgroup a box's memory cgroup is made in, or None where none can be: v1 needs the directory writable; v2
    needs the memory controller already enabled for children (a delegated subtree: a cgroup with processes in it
    cannot enable it itself)."""
    try:
        found = own_cgroup(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    if found is None:
        return None
    version, d = found
    try:
        if version == "v1":
            return found if (d / "memory.limit_in_bytes").exists() and os.access(d, os.W_OK) else None
        return found if "memory" in (d / "cgroup.subtree_control").read_text().split() and os.access(d, os.W_OK) \
            else None
    except OSError:
        return None


def mechanism() -> str:
    """What holds `memory_mib` on this host: CGROUP or RLIMIT."""
    return CGROUP if parent() is not None else RLIMIT


def limits(memory_mib: int, held: bool) -> dict[str, int]:
    """The cgroup files a box's cgroup is given (v1 and v2 names), and its RLIMIT_AS: none where the cgroup holds.
    Swap is not a way past the limit: v1's memory+swap limit equals the memory limit, v2's swap.max is 0."""
    b = memory_mib << 20
    return {"memory.limit_in_bytes": b, "memory.memsw.limit_in_bytes": b, "memory.max": b, "memory.swap.max": 0,
            "rlimit_as": resource.RLIM_INFINITY if held else b}


def create(box_id: str, memory_mib: int) -> Path | None:
    """The box's memory cgroup with its limit set, or None where this host has none to give (then RLIMIT_AS)."""
    found = parent()
    if found is None:
        return None
    version, d = found
    scratch.sweep(PREFIX, d, cgroups=True)  # those of host processes that were killed
    cg = d / f"{PREFIX}{os.getpid()}-{box_id}"
    cg.mkdir()
    try:
        values = limits(memory_mib, True)
        names = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes") if version == "v1" else \
            ("memory.max", "memory.swap.max")
        for name in names:  # v1: the memory limit first (memsw may never be below it)
            if name == names[1] and not (cg / name).exists():
                continue  # swap accounting off: there is no swap limit to set (nor one to pass)
            (cg / name).write_text(f"{values[name]}\n")
    except BaseException:
        remove(cg)
        raise
    return cg


def oom_kills(cg: Path | None) -> int:
    """How many processes of the box the kernel killed for its memory limit (v1 memory.oom_control, v2
    memory.events); 0 when unknown."""
    if cg is None:
        return 0
    for name in ("memory.oom_control", "memory.events"):
        with contextlib.suppress(OSError, ValueError):
            for line in (cg / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


def remove(cg: Path | None) -> None:
    """Kill what is left in a box's cgroup (its memory cgroup, or its pids cgroup) and remove it (also after a kill
    of bwrap, whose children may live)."""
    if cg is None:
        return
    for _ in range(100):
        try:
            pids = [int(x) for x in (cg / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            break
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    for _ in range(50):  # the last process may take a moment to leave after its SIGKILL
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
