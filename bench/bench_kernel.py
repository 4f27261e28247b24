"""`execute('1+1')` round trips through the Tracekit Box kernel against a plain ipykernel, both driven by
jupyter_client in the same run (median of n). Target: under 1.5x the plain kernel's median plus 3 ms.

Start to first result, both kernels started in the same notebook folder: an empty one (target <= 1.3x), and one
holding 50 MB (a 40 MB data file and 200 small ones; target <= 1.5x), which the Tracekit Box kernel digests and copies
into its box as it starts (docs/jupyter.md, "The notebook's folder").

`%box_pull` of a 10 MB file the box wrote (target <= 0.5 s, median of up to 10): the file read back from the box, its
`[patch]` decision signed with its content disclosed, and the file written into the notebook's folder.

The Tracekit Box kernel's figure includes the exec door (a signed decision before the cell, a signed result after,
ack-on-fsync) and both hops of the bridge (frontend -> host kernel -> box -> ipykernel in the box, and back).
"""

from __future__ import annotations

import compileall
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import tkbox_nb
from tkbox_nb.jupyter.kernel.install import SPEC_DIR
from tkbox_nb.signing.signer import MachineSigner


FIRST_STARTS = 7
FOLDER_MB = 50
PULL_BYTES = 10_000_000


def _fill(folder: Path) -> None:
    """FOLDER_MB of a notebook's folder: a 40 MB data file, 200 files of 50 KB, a notebook."""
    folder.mkdir()
    with open(folder / "data.bin", "wb") as f:
        for _ in range(FOLDER_MB - 10):
            f.write(os.urandom(1 << 20))
    (folder / "parts").mkdir()
    for i in range(200):
        (folder / "parts" / f"part-{i:03d}.csv").write_bytes(os.urandom(50 << 10))
    (folder / "analysis.ipynb").write_text("{}")


def _firsts(folder: Path, starts: int, first: dict[str, float] | None = None) -> dict[str, float]:
    """The median start to first result of each kernel started in `folder`, alternating so both see one machine."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        firsts: dict[str, list[float]] = {name: [first[name]] if first else [] for name in ("python3", "tkbox")}
        for _ in range(starts):
            for name in firsts:
                firsts[name].append(_round_trips(name, 0)[0])
    finally:
        os.chdir(cwd)
    return {name: statistics.median(t) for name, t in firsts.items()}


def _round_trips(kernel_name: str, n: int) -> tuple[float, list[float]]:
    from jupyter_client.manager import start_new_kernel
    t = time.perf_counter()
    km, kc = start_new_kernel(kernel_name=kernel_name, startup_timeout=120)
    kc.execute_interactive("1+1", timeout=120, output_hook=lambda msg: None)
    first = time.perf_counter() - t
    times = []
    for _ in range(n):
        t = time.perf_counter()
        kc.execute_interactive("1+1", timeout=60, output_hook=lambda msg: None)
        times.append(time.perf_counter() - t)
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    return first, times


def _pulls(folder: Path, n: int) -> float:
    """The median time of `%box_pull` of a PULL_BYTES file a box cell wrote, each of n files once, through
    jupyter_client as a frontend sends it; each pulled file checked on the host."""
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="tkbox", startup_timeout=120, cwd=str(folder))
    try:
        reply = kc.execute_interactive(f"import os\nfor i in range({n}):\n    open(f'pulled-{{i}}.bin', 'wb')"
                                       f".write(os.urandom({PULL_BYTES}))", timeout=120, output_hook=lambda m: None)
        assert reply["content"]["status"] == "ok", reply["content"]
        times = []
        for i in range(n):
            t = time.perf_counter()
            reply = kc.execute_interactive(f"%box_pull pulled-{i}.bin", timeout=120, output_hook=lambda m: None)
            times.append(time.perf_counter() - t)
            assert reply["content"]["status"] == "ok", reply["content"]
            assert (folder / f"pulled-{i}.bin").stat().st_size == PULL_BYTES, f"pulled-{i}.bin was not pulled"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    return statistics.median(times)


def main(n: int | None = None) -> None:
    n = n or 200
    # tkbox-nb's modules compiled, as an installed package has them (pip compiles on install) and as ipykernel's
    # are: a checkout under PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module at every kernel start
    # (about 0.15 s more on the 2-core machine), in the host process and in the box (whose guest code is read from
    # tkbox_nb/guest)
    compileall.compile_dir(str(Path(tkbox_nb.__file__).parent), quiet=1)
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    (home / "kernels").mkdir()
    (home / "kernels" / "tkbox").symlink_to(SPEC_DIR)
    old = {k: os.environ.get(k) for k in ("TKBOX_HOME", "JUPYTER_PATH", "TKBOX_BUNDLE_DIR")}
    os.environ.update(TKBOX_HOME=str(home), JUPYTER_PATH=str(home), TKBOX_BUNDLE_DIR=str(home / "bundles"))
    MachineSigner(home).ensure()  # the machine signer is long-lived: its start is not a kernel's
    cwd = os.getcwd()
    (home / "notebook").mkdir()
    os.chdir(home / "notebook")  # both kernels start in an empty notebook folder (a tkbox kernel copies its folder in)
    try:
        _round_trips("python3", 5)  # warm the file cache for both
        _round_trips("tkbox", 5)
        k_first, k_times = _round_trips("python3", n)
        b_first, b_times = _round_trips("tkbox", n)
        firsts = _firsts(home / "notebook", FIRST_STARTS - 1, {"python3": k_first, "tkbox": b_first})
        k_first, b_first = firsts["python3"], firsts["tkbox"]
        (home / "pull").mkdir()
        pulls = max(3, min(n, 10))
        pull = _pulls(home / "pull", pulls)
        _fill(home / "big")
        big = _firsts(home / "big", FIRST_STARTS)
        km, bm = statistics.median(k_times) * 1e3, statistics.median(b_times) * 1e3
        target = 1.5 * km + 3
        print(f"execute('1+1') round trip through jupyter_client, median of {n}")
        print(f"  plain ipykernel            : {km:6.2f} ms")
        print(f"  Tracekit Box kernel        : {bm:6.2f} ms   ratio {bm / km:.2f}x; target < 1.5x + 3 ms "
              f"= {target:.2f} ms: {'met' if bm < target else 'NOT met'}")
        print(f"start to first result (kernel start, and for tkbox the box and its ipykernel), median of "
              f"{FIRST_STARTS} starts")
        print(f"  plain ipykernel            : {k_first:6.3f} s")
        print(f"  Tracekit Box kernel        : {b_first:6.3f} s   ratio {b_first / k_first:.2f}x; target <= 1.3x: "
              f"{'met' if b_first <= 1.3 * k_first else 'NOT met'}")
        k_big, b_big = big["python3"], big["tkbox"]
        print(f"start to first result in a notebook folder of {FOLDER_MB} MB (the box's workspace), median of "
              f"{FIRST_STARTS} starts")
        print(f"  plain ipykernel            : {k_big:6.3f} s")
        print(f"  Tracekit Box kernel        : {b_big:6.3f} s   ratio {b_big / k_big:.2f}x; target <= 1.5x: "
              f"{'met' if b_big <= 1.5 * k_big else 'NOT met'}")
        print(f"%box_pull of a {PULL_BYTES // 1_000_000} MB file the box wrote, decided, signed and written into the "
              f"notebook's folder, median of {pulls}")
        print(f"  Tracekit Box kernel        : {pull:6.3f} s   target <= 0.5 s: {'met' if pull <= 0.5 else 'NOT met'}")
    finally:
        os.chdir(cwd)
        MachineSigner(home).stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)
