"""Box start to first command result, and `execute("1+1")` round trips, against a plain local ipykernel.

The baseline is an ipykernel started and driven by jupyter_client in the same run (start to first reply; the
same cell's round trip). Targets: a bubblewrap box ready in under 1.5x a plain ipykernel's start; cell overhead
(box median minus kernel median) under 3 ms. With `--backend qemu`: a micro-VM box against a bubblewrap box in the
same run (start to first command, start to first cell, `execute("1+1")`), warm (restored from the template's saved
state, backends/warm_start.py) and, for reference, cold; target: first result within 4 s with a cached image (and
its saved state), and no rebuild of an image whose inputs did not change.

Each cell figure is printed beside its floor: the same cell's time inside the box as its ipykernel reckons it (from
the `status: busy` to the `status: idle` it publishes, both dated by the kernel's own clock), so that what is
transport and bridge (the cell's time above that floor) shows apart from the guest's own compute. A VM's floor
moves with how fast the emulated guest runs on a loaded host: the same pure Python loop is timed on the host and
in the guest, in the same run, and their ratio printed with it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tkbox_nb import Box, Policy
from tkbox_nb.signing.signer import MachineSigner

from .bench_kernel import _round_trips


def _kernel(n: int) -> tuple[float, list[float]]:
    """The baseline: a plain ipykernel through jupyter_client (start to first reply, then n round trips)."""
    return _round_trips("python3", n)


IMAGE = None  # the qemu boxes' image: the default one, or the packages $TKBOX_BENCH_PACKAGES names (comma-separated)


def _make_box(home: Path, backend: str, warm: bool, name: str) -> Box:
    """A box on `backend`; a qemu one warm-started or, for the reference, booted cold."""
    box = Box(backend="bwrap" if backend == "qemu" else backend, home=home, bundle_path=home / f"{name}.tkb")
    if backend == "qemu":
        from tkbox_nb.backends.qemu import QemuBackend
        box.backend = QemuBackend(image=IMAGE, warm=warm)
    return box


LOOP = "import time\nt = time.perf_counter()\nfor _ in range(300): sum(range(1000))\nprint(time.perf_counter() - t)"


def _kernel_time(dates: dict) -> float | None:
    """A cell's time in its kernel: from its busy to its idle status, as the kernel in the box dated them."""
    try:
        busy, idle = (datetime.datetime.fromisoformat(dates[k]) for k in ("busy", "idle"))
    except (KeyError, TypeError, ValueError):
        return None
    return (idle - busy).total_seconds()


def _box(home: Path, n: int, backend: str = "bwrap", warm: bool = True, loop: list | None = None
         ) -> tuple[float, float, list[float], list[float]]:
    """(start to first command, start to first cell, cell round trips, each cell's time inside its kernel) of one
    box; with `loop`, the pure Python loop's time in the box is appended to it."""
    t = time.perf_counter()
    with _make_box(home, backend, warm, "bench-box") as box:
        box.run(["true"])
        start = time.perf_counter() - t
        box.execute("1+1")
        first_cell = time.perf_counter() - t
        dates: dict = {}

        def listen(msg):
            if msg is not None and msg.msg_type == "status":
                dates[msg.content.get("execution_state")] = msg.header.get("date")
        box.kernel().listeners.append(listen)
        times, inside = [], []
        for _ in range(n):
            dates.clear()
            t = time.perf_counter()
            box.execute("1+1")
            times.append(time.perf_counter() - t)
            inside.append(_kernel_time(dates))
        if loop is not None:
            loop.append(float(box.run(["python3", "-c", LOOP]).stdout))
    return start, first_cell, times, inside


def _floor(times: list[float], inside: list[float | None]) -> tuple[float, float]:
    """(median time in the kernel, median of each cell's time above its own kernel time), in ms: the second per
    cell, so that a slow cell's kernel time is taken from that cell, not from the median one."""
    pairs = [(t, i) for t, i in zip(times, inside) if i is not None]
    if not pairs:
        return float("nan"), float("nan")
    return statistics.median(i for _, i in pairs) * 1e3, statistics.median(t - i for t, i in pairs) * 1e3


def _host_loop() -> float:
    return float(subprocess.run([sys.executable, "-c", LOOP], capture_output=True, check=True).stdout)


def _first_cell(home: Path, warm: bool) -> float:
    """Start to the first cell's result, with no command before it: what a notebook on a qemu box waits."""
    t = time.perf_counter()
    with _make_box(home, "qemu", warm, "bench-cell") as box:
        box.execute("1+1")
        return time.perf_counter() - t


def _signed_pair(signer: MachineSigner, n: int) -> list[float]:
    """The floor under any signed cell: one decide + complete pair through Tracekit's own client, alone."""
    c = signer.client()
    times = []
    with c.run(agent="bench-floor") as run:
        for i in range(n):
            t = time.perf_counter()
            run.decide(f"c-{i}", "box.exec", '{"door":"exec","kind":"cell","verdict":"allow","policy":"sha256:x"}')
            run.complete(f"c-{i}", "ok", result={"status": "ok", "execution_count": i})
            times.append(time.perf_counter() - t)
    c.close()
    return times


def _vm(n: int) -> None:
    """QEMU (under TCG where KVM cannot boot a stock kernel) against bubblewrap, in the same run, same cells."""
    from tkbox_nb.backends.image import build_image
    from tkbox_nb.backends.qemu import QemuBackend
    global IMAGE
    packages = os.environ.get("TKBOX_BENCH_PACKAGES")
    t = time.perf_counter()
    image, built = build_image(packages.split(",") if packages else None, say=lambda s: None)
    IMAGE = image
    check = time.perf_counter() - t
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    MachineSigner(home).ensure()
    try:
        from tkbox_nb.backends.warm_start import warm_state
        backend = QemuBackend(image=image)
        t = time.perf_counter()
        default = Policy.coerce(None)  # the default policy's machine
        state = warm_state(backend, default.get("box", "memory_mib"), default.get("box", "cpus"),
                           backend.ready_timeout_s)
        made = time.perf_counter() - t
        _box(home, 2, "bwrap")
        b_start, b_cell, b_times, b_in = _box(home, n, "bwrap")
        loops: list[float] = []
        q_start, _, q_times, q_in = _box(home, n, "qemu", loop=loops)
        host_loop = _host_loop()
        q_cell = _first_cell(home, warm=True)
        c_start, c_cell, _, _ = _box(home, 1, "qemu", warm=False)
        bm, qm = statistics.median(b_times) * 1e3, statistics.median(q_times) * 1e3
        (bf, b_above), (qf, q_above) = _floor(b_times, b_in), _floor(q_times, q_in)
        print(f"qemu ({backend.accel.upper()}) against bwrap, image {image.digest[:12]} "
              f"({image.size_bytes() / 2**20:.0f} MiB), n={n} cells; load average {os.getloadavg()[0]:.2f} on "
              f"{os.cpu_count()} CPUs")
        cache = 'built now' if built else 'rebuild skipped: inputs unchanged'
        print(f"  image cache check     : {check:6.3f} s   ({cache})")
        print(f"  warm-start state      : {made:6.3f} s   ({state.path.stat().st_size / 2**20:.0f} MiB; "
              f"{'made now' if made > 1 else 'found'})")
        print(f"  start to first command: bwrap {b_start:6.3f} s   qemu {q_start:6.3f} s   (target qemu < 4 s)  "
              f"cold boot {c_start:6.3f} s")
        print(f"  start to first cell   : bwrap {b_cell:6.3f} s   qemu {q_cell:6.3f} s   (target qemu < 4 s)  "
              f"cold boot {c_cell:6.3f} s")
        print(f"  execute('1+1') median : bwrap {bm:6.2f} ms  qemu {qm:6.2f} ms   "
              f"ratio {qm / bm:.1f}x (target <= 5x)")
        print(f"  ... its floor         : bwrap {bf:6.2f} ms  qemu {qf:6.2f} ms   "
              f"(the kernel's own busy to idle, timed in the box); "
              f"above it: bwrap {b_above:+.2f} ms, qemu {q_above:+.2f} ms (median per cell)")
        print(f"  guest speed           : a Python loop takes {host_loop * 1e3:.1f} ms on the host, "
              f"{loops[0] * 1e3:.1f} ms in the VM ({loops[0] / host_loop:.0f}x); the floors' ratio is {qf / bf:.0f}x")
    finally:
        MachineSigner(home).stop()
        shutil.rmtree(home, ignore_errors=True)


def main(n: int | None = None, backend: str = "bwrap") -> None:
    if backend == "qemu":
        return _vm(n or 20)
    n = n or 200
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    MachineSigner(home).ensure()  # the machine signer is long-lived: its start is not a box's
    try:
        _box(home, 5)  # warm the file cache for both
        _kernel(5)
        k_start, k_times = _kernel(n)
        b_start, b_cell, b_times, b_in = _box(home, n)
        floor = statistics.median(_signed_pair(MachineSigner(home), n)) * 1e3
        inside, above = _floor(b_times, b_in)
        km, bm = statistics.median(k_times) * 1e3, statistics.median(b_times) * 1e3
        print(f"box start to first result (bwrap) vs plain ipykernel start to first reply, n={n} cells")
        print(f"  plain ipykernel start : {k_start:6.3f} s")
        print(f"  tkbox bwrap box start : {b_start:6.3f} s   ratio {b_start / k_start:.2f}x (target < 1.5x)")
        print(f"  ... to first cell     : {b_cell:6.3f} s   ratio {b_cell / k_start:.2f}x (box + its ipykernel)")
        print("execute('1+1') round trip, median")
        print(f"  plain ipykernel       : {km:6.2f} ms")
        print(f"  tkbox box (signed)    : {bm:6.2f} ms   overhead {bm - km:+.2f} ms (target < 3 ms)")
        print(f"  of which signing      : {floor:6.2f} ms   (Tracekit's client alone, decide + complete, "
              f"ack-on-fsync); the bridge adds {bm - km - floor:+.2f} ms")
        print(f"  in the box's kernel   : {inside:6.2f} ms   (its own busy to idle; the box's cell above it: "
              f"{above:+.2f} ms, median per cell)")
    finally:
        MachineSigner(home).stop()
        shutil.rmtree(home, ignore_errors=True)
