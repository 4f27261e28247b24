"""Installing packages through the package door (doors/packages.py) against pip straight from the index, and what
recording the environment costs a warm box start. Needs root (a network namespace for the index, testnet).

The same 20 small wheels, built here (pure Python, fixed times: the same bytes each run), are served as a PEP 503
index from a network namespace (198.18.38.0/24), its pages stating PyPI's `Cache-Control: max-age=600`. In the same
run, alternating round by round so the machine's load falls on each alike, pip installs all 20 in one command:
- straight from the index, on the host (`--target` a fresh directory, no pip cache);
- from a bubblewrap box, through the door with its host cache emptied first (every page and file from the index,
  each file hashed, decided and signed);
- from the same box again with the door's cache warm (pages and files from the host cache: the index is not asked;
  each page and file still decided and signed);
- on the host from a local directory of the same wheels, no index at all (`--no-index --find-links`): what pip
  itself costs, the floor under any of the others;
- in the same box from a directory of the same wheels in its /tmp, no index and no door: what pip in a box costs,
  the floor under the door's warm install (the door's own share is the difference).
Targets: through the door <= 1.5x the direct install; from the warm cache <= 0.7x. Those first figures are at zero
distance: the index is on this machine, so there are no round trips for the warm cache to save. The same three
(direct, door cold, door warm) are then measured in the same rounds with the index at a modelled distance: its server
waits --index-delay-ms (default 20) before each answer (NamespaceNet.set_delay_ms), one wait per request standing for
one round trip to a distant index such as PyPI or a mirror. It is a model, not a network: this machine has no netem,
and handshakes, DNS and bandwidth are not delayed. Then the environment manifest of a warm box start
(bundle/environment.box_environment, its cache warm), against its target of 20 ms.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.environment import box_environment
from tkbox_nb.rules.door_table import PACKAGES
from tkbox_nb.signing.signer import MachineSigner
from tests.testnet import NamespaceNet, available
from tests.wheels import wheel

NET_INDEX = 38  # 198.18.38.0/24: no test module uses it
WHEELS = 20
ROUNDS = 3
INDEX_DELAY_MS = 20  # a modelled round trip to a distant index, per request
PIP = ["-m", "pip", "install", "--no-cache-dir", "--no-color", "--disable-pip-version-check", "--no-input",
       "--no-deps"]


def publish(net: NamespaceNet) -> list[str]:
    """The 20 projects, each a page linking its wheel with its sha256, stating PyPI's Cache-Control for its pages
    (max-age=600); their names."""
    net.add_file("simple/.cache-control", b"max-age=600")
    names = []
    for i in range(WHEELS):
        name = f"benchpkg{i:02d}"
        data = wheel(name, "1.0", f"VALUE = {i}\nTABLE = {list(range(200 + i))!r}\n", generator="tkbox-bench")
        filename = f"{name}-1.0-py3-none-any.whl"
        net.add_file(f"files/{filename}", data)
        net.add_file(f"simple/{name}/index.html", (
            f'<!DOCTYPE html><html><body><a href="../../files/{filename}#sha256={hashlib.sha256(data).hexdigest()}">'
            f"{filename}</a></body></html>").encode())
        names.append(name)
    return names


def _direct(url: str, names: list[str], target: Path) -> float:
    env = dict(os.environ, PIP_CONFIG_FILE="/dev/null", NO_PROXY="*")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *PIP, "--index-url", url, "--trusted-host", url.split("/")[2].split(":")[0],
                        "--target", str(target), *names], capture_output=True, env=env, timeout=600)
    took = time.perf_counter() - t
    assert r.returncode == 0, r.stderr.decode()[-800:]
    return took


def _floor(files: Path, names: list[str], target: Path) -> float:
    """pip installing the same wheels from a local directory, no index at all: what pip itself costs."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *PIP, "--no-index", "--find-links", str(files), "--target", str(target),
                        *names], capture_output=True, env=dict(os.environ, PIP_CONFIG_FILE="/dev/null"), timeout=600)
    took = time.perf_counter() - t
    assert r.returncode == 0, r.stderr.decode()[-800:]
    return took


def _boxed(box: Box, names: list[str], target: str) -> float:
    t = time.perf_counter()
    r = box.run(["python3", *PIP, "--target", target, *names], timeout=600)
    took = time.perf_counter() - t
    assert r.exit_code == 0, r.stderr.decode()[-800:]
    return took


def _box_floor(box: Box, names: list[str], target: str) -> float:
    """pip in the box installing from a directory in its own /tmp (put there by `pip download` through the door)."""
    t = time.perf_counter()
    r = box.run(["python3", *PIP, "--no-index", "--find-links", "/tmp/bench-wheels", "--target", target, *names],
                timeout=600)
    took = time.perf_counter() - t
    assert r.exit_code == 0, r.stderr.decode()[-800:]
    return took


def _ratios(label: str, took: list[float], direct: list[float], target: float) -> str:
    """One row: the median, its ratio to the median direct install, the target, and the ratios round by round."""
    x, d = statistics.median(took), statistics.median(direct)
    return (f"  {label:<34}: {x:6.2f} s   ratio {x / d:.2f} (target <= {target}; round by round "
            f"{', '.join(f'{a / b:.2f}' for a, b in zip(took, direct))})")


def main(n: int | None = None, index_delay_ms: int | None = None) -> None:
    ok, why = available()
    if not ok:
        print(f"packages: skipped ({why})")
        return
    rounds = n or ROUNDS
    delay = INDEX_DELAY_MS if index_delay_ms is None else index_delay_ms
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-pkg-", dir="/tmp"))
    signer = MachineSigner(home).ensure()
    work = Path(tempfile.mkdtemp(prefix="tkb-bench-pip-", dir="/tmp"))
    try:
        with NamespaceNet(index=NET_INDEX) as net:
            names = publish(net)
            local = work / "wheels"
            shutil.copytree(net.root / "www" / "files", local)
            url = f"http://{net.web}:8080/simple/"
            policy = Policy.from_toml(f'[packages]\nindex = ["{url}"]\nallow = ["benchpkg*"]\n'
                                      'allow_cidrs = ["198.18.0.0/15"]\n')  # the test network: special-purpose
            direct, cold, warm, floor, in_box = [], [], [], [], []
            far_direct, far_cold, far_warm = [], [], []
            with Box(backend="bwrap", policy=policy, home=home, bundle_path=home / "packages.tkb") as box:
                _boxed(box, names[:1], "/tmp/first")  # the first pip in a box pays for its imports' page cache
                r = box.run(["python3", "-m", "pip", "download", "--no-deps", "-q", "-d", "/tmp/bench-wheels", *names],
                            timeout=600)
                assert r.exit_code == 0, r.stderr.decode()[-800:]
                for i in range(rounds):
                    direct.append(_direct(url, names, work / f"direct-{i}"))
                    shutil.rmtree(home / "packages", ignore_errors=True)  # every page and file from the index again
                    cold.append(_boxed(box, names, f"/tmp/cold-{i}"))
                    warm.append(_boxed(box, names, f"/tmp/warm-{i}"))
                    floor.append(_floor(local, names, work / f"floor-{i}"))
                    in_box.append(_box_floor(box, names, f"/tmp/floor-{i}"))
                    net.set_delay_ms(delay)  # the same again with the index at a modelled distance
                    far_direct.append(_direct(url, names, work / f"far-direct-{i}"))
                    shutil.rmtree(home / "packages", ignore_errors=True)
                    far_cold.append(_boxed(box, names, f"/tmp/far-cold-{i}"))
                    far_warm.append(_boxed(box, names, f"/tmp/far-warm-{i}"))
                    net.set_delay_ms(0)
            files = sum(1 for c in open_run(home / "packages.tkb").crossings()
                        if c.door == PACKAGES and (c.args or {}).get("kind") == "file" and c.decision == "allow")
        d, w = statistics.median(direct), statistics.median(warm)
        print(f"packages: {WHEELS} wheels in one pip install, same index, same run, median of {rounds} "
              f"({files} files signed allowed)")
        print("  the index at zero distance (a network namespace on this machine, no round trips to save):")
        print(f"  pip straight from the index (host): {d:6.2f} s")
        print(_ratios("through the door, cache empty", cold, direct, 1.5))
        print(_ratios("through the door, cache warm", warm, direct, 0.7))
        print(f"  (pip from local files, no index:   {statistics.median(floor):6.2f} s, ratio "
              f"{statistics.median(floor) / d:.2f}: what pip itself costs, a floor for any door)")
        b = statistics.median(in_box)
        print(f"  (pip in the box from local files:  {b:6.2f} s, ratio {b / d:.2f}: no index, no door, a floor for the "
              f"warm cache; the door's own share {w - b:.2f} s)")
        print(f"  the index at a modelled distance of {delay} ms (its server waits {delay} ms before each answer, one "
              f"round trip per request; a model, not a network):")
        print(f"  pip straight from the index (host): {statistics.median(far_direct):6.2f} s")
        print(_ratios("through the door, cache empty", far_cold, far_direct, 1.5))
        print(_ratios("through the door, cache warm", far_warm, far_direct, 0.7))
        backend = BwrapBackend()
        box_environment(backend, home)  # the first start computes it; a warm start reads the cache
        times = []
        for _ in range(50):
            t = time.perf_counter()
            box_environment(backend, home)
            times.append((time.perf_counter() - t) * 1000)
        print(f"  environment manifest, warm start  : {statistics.median(times):6.2f} ms median, {max(times):.2f} ms "
              f"max of 50 (target <= 20 ms)")
    finally:
        signer.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
