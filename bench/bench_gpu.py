"""A GPU in a bubblewrap box against the same GPU on the host: a matmul loop's time, and a box's start with
`gpus = 1` against one without, same run. Targets (issue 39): the loop at most 1.05x the host's (a box adds no
layer between a process and the driver's ioctls), and a box's start with `gpus = 1` at most 1.2x one without (the
nvidia-smi queries and the binds); `verdict` states both as ratios, each met or not.

Skipped, saying why, without an NVIDIA GPU and driver, or without torch importable by the box's interpreter.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tkbox_nb import Box, Policy
from tkbox_nb.backends import gpus

LOOP_TARGET = 1.05   # box loop / host loop
START_TARGET = 1.2   # box start with gpus = 1 / without
LOOP = ("import time, torch\na = torch.randn(4096, 4096, device='cuda')\n(a @ a).sum().item()\n"
        "t = time.perf_counter()\nfor _ in range({n}):\n    b = a @ a\ntorch.cuda.synchronize()\n"
        "print(time.perf_counter() - t)\n")


def _policy(gpu: bool) -> Policy:
    return Policy.from_toml(f"[box]\nbackend = \"bwrap\"\nmemory_mib = 16384\n{'gpus = 1' if gpu else ''}\n")


def _start(home: Path, gpu: bool, i: int) -> float:
    t = time.perf_counter()
    with Box(policy=_policy(gpu), backend="bwrap", home=home, bundle_path=home / f"s{gpu}{i}.tkb") as b:
        b.run(["true"])
        return time.perf_counter() - t


def verdict(host_s: float, box_s: float, start_without_s: float, start_with_s: float, n: int) -> list[str]:
    """The two figures as ratios against the issue's targets, each saying whether it was met."""
    loop, start = box_s / host_s, start_with_s / start_without_s
    return [f"gpu: {n} x 4096^2 matmul: host {host_s:.3f} s, box {box_s:.3f} s (ratio {loop:.3f}, target <= "
            f"{LOOP_TARGET}: {'met' if loop <= LOOP_TARGET else 'NOT met'})",
            f"gpu: box start to first command: without gpus {start_without_s:.2f} s, gpus = 1 {start_with_s:.2f} s "
            f"(ratio {start:.2f}, target <= {START_TARGET}: {'met' if start <= START_TARGET else 'NOT met'})"]


def main(n: int | None = None) -> None:
    n = n or 200
    if not gpus.has_driver():
        print("gpu: skipped: no NVIDIA GPU or driver here (no /dev/nvidiactl or no nvidia-smi)")
        return
    if importlib.util.find_spec("torch") is None:
        print(f"gpu: skipped: torch is not importable by the box's interpreter ({sys.executable})")
        return
    script = LOOP.format(n=n)
    host = [float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
            for _ in range(3)]
    with tempfile.TemporaryDirectory(prefix="tkbox-bench-gpu-") as tmp:
        home = Path(tmp)
        with Box(policy=_policy(True), backend="bwrap", home=home, bundle_path=home / "loop.tkb") as b:
            runs = [b.run(["python3", "-c", script], timeout=600) for _ in range(3)]
        if any(r.exit_code for r in runs):
            print(f"gpu: the box's loop failed: {runs[0].stderr[-400:]!r}")
            return
        boxed = [float(r.stdout) for r in runs]
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(3):  # interleaved, so a change in the machine's load falls on both alike
            for g in (False, True):
                times[g].append(_start(home, g, i))
        starts = {g: statistics.median(t) for g, t in times.items()}
    for line in verdict(statistics.median(host), statistics.median(boxed), starts[False], starts[True], n):
        print(line)
