"""What recording a bubblewrap box's environment (bundle/environment.py) costs a box start.

Three figures, each against its baseline in the same run: the manifest computed cold (an empty cache: every RECORD
read) and warm (the cache read after stat-ing the site and dist-info directories), both in milliseconds, the warm
one against its target of 20 ms; and a box's start to its first command with the manifest against the same start
with a backend that records none, as a ratio.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tkbox_nb import Box
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.environment import box_environment, manifest
from tkbox_nb.signing.signer import MachineSigner


class _NoEnvironment(BwrapBackend):
    """The baseline: a bubblewrap box whose start records no environment."""

    def environment(self, cache_dir: Path) -> bytes:
        return manifest(None, self.name, self.image_digest(), "the benchmark's baseline")


def _ms(f, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _start(home: Path, backend: BwrapBackend) -> float:
    t = time.perf_counter()
    box = Box(backend="bwrap", home=home, bundle_path=home / "bench-env.tkb")
    box.backend = backend
    with box:
        box.run(["true"])
        return time.perf_counter() - t


def main(n: int | None = None) -> None:
    n = n or 5
    home = Path(tempfile.mkdtemp(prefix="tkbe-", dir="/tmp"))
    try:
        MachineSigner(home).ensure()
        backend = BwrapBackend()
        cold = []
        for _ in range(min(n, 3)):
            shutil.rmtree(home / "environments", ignore_errors=True)
            cold += _ms(lambda: box_environment(backend, home), 1)
        warm = _ms(lambda: box_environment(backend, home), n * 20)
        size = len(box_environment(backend, home))
        print(f"environment manifest ({size} bytes): cold {statistics.median(cold):.1f} ms, warm "
              f"{statistics.median(warm):.2f} ms median, {max(warm):.2f} ms max (target: warm <= 20 ms)")
        with_env, without = [], []
        _start(home, backend)  # the first start pays for imports and the signer's first run
        for _ in range(n):  # interleaved, so that load on the host falls on both alike
            with_env.append(_start(home, backend))
            without.append(_start(home, _NoEnvironment()))
        a, b = statistics.median(with_env), statistics.median(without)
        print(f"box start to first command: with the manifest {a * 1000:.0f} ms, without {b * 1000:.0f} ms "
              f"(median of {n}): ratio {a / b:.3f}")
    finally:
        MachineSigner(home).stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
