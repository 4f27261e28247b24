"""A GPU in a bubblewrap box against the same GPU on the host: a matmul loop's time, and a box's start with
`gpus = 1` against one without. Target: the loop within 5% of the host's (a box adds no layer between a process and
the driver's ioctls), and `gpus = 1` adding under 0.5 s to a start (the nvidia-smi queries and the binds).

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
        starts = {g: statistics.median(_start(home, g, i) for i in range(3)) for g in (False, True)}
    h, bx = statistics.median(host), statistics.median(boxed)
    print(f"gpu: {n} x 4096^2 matmul: host {h:.3f} s, box {bx:.3f} s (ratio {bx / h:.3f}, target <= 1.05)")
    print(f"gpu: box start to first command: without gpus {starts[False]:.2f} s, gpus = 1 {starts[True]:.2f} s "
          f"(+{starts[True] - starts[False]:.2f} s, target < 0.5 s)")
