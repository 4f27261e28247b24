"""Dataset mounts ([mounts.NAME]): a box's start with a large mount, the mount's cold digest, and reading it in the box.

A dataset of many files (TKBOX_BENCH_MOUNT_MIB, default 200 MiB, in TKBOX_BENCH_MOUNT_FILES files, default 2,000,
in directories of 100) is made in a temporary directory; each figure is a ratio against a baseline measured in the
same run (medians of `--n` rounds, default 5):
- warm start: a bubblewrap box with the dataset mounted, start to its first command's result, against the same box
  without the mount; the mount's digest cached (a box before warmed it), so only metadata is walked. Target <= 1.1x.
- cold digest: mount_digest's digest with an empty cache (files hashed on threads), against `sha256sum` over the
  same files (one process), both from the page cache (the files were just read). Target: at least 0.8x its speed.
- reading: every file of the dataset read once in the box (at the mount's target) against the same reads on the
  host, both timed by the reading process itself, in turn (3x `--n` rounds each: each is short, and a loaded host's
  noise is larger than the difference), the fastest of each compared (load only adds time; the medians are printed
  too). Target: at least 0.9x the host's speed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READ = """
import os, sys, time
t = time.perf_counter()
n = 0
for d, _, fs in os.walk(sys.argv[1]):
    for f in fs:
        with open(os.path.join(d, f), "rb") as fh:
            while chunk := fh.read(1 << 20):
                n += len(chunk)
print(time.perf_counter() - t, n)
"""


def _dataset(root: Path, mib: int, files: int) -> None:
    size = (mib << 20) // files
    block = os.urandom(1 << 20)
    for i in range(files):
        d = root / f"d{i // 100:04d}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:06d}.bin").write_bytes(i.to_bytes(8, "big") + block[: size - 8] if size <= len(block) + 8
                                          else i.to_bytes(8, "big") + os.urandom(size - 8))


def _start(home: Path, policy: str) -> float:
    from tkbox_nb import Box
    t = time.perf_counter()
    with Box(policy=policy, home=home, bundle_path=home / "bench-mounts.tkb") as box:
        box.run(["true"])
        return time.perf_counter() - t


def main(n: int | None = None) -> None:
    from tkbox_nb.bundle.mount_digest import digest, scan
    from tkbox_nb.signing.signer import MachineSigner
    rounds = n or 5
    mib = int(os.environ.get("TKBOX_BENCH_MOUNT_MIB", "200"))
    files = int(os.environ.get("TKBOX_BENCH_MOUNT_FILES", "2000"))
    with tempfile.TemporaryDirectory(prefix="tkbench-mounts-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        ds = work / "ds"
        ds.mkdir()
        _dataset(ds, mib, files)
        paths = sorted(str(p) for p in ds.rglob("*.bin"))
        subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)  # both from the page cache
        shas, colds = [], []
        for i in range(rounds):
            t = time.perf_counter()
            subprocess.run(["xargs", "-0", "sha256sum"], input="\0".join(paths).encode(), stdout=subprocess.DEVNULL,
                           check=True)
            shas.append(time.perf_counter() - t)
            t = time.perf_counter()
            digest(scan(str(ds)), work / f"cold-{i}")  # an empty cache each time
            colds.append(time.perf_counter() - t)
        sha, cold = statistics.median(shas), statistics.median(colds)
        print(f"mounts: a dataset of {mib} MiB in {files} files")
        print(f"  cold digest {cold * 1000:.0f} ms, sha256sum {sha * 1000:.0f} ms: {sha / cold:.2f}x sha256sum's speed "
              f"(target >= 0.8x: {'met' if sha / cold >= 0.8 else 'NOT met'})")
        home = work / "home"
        plain = '[box]\nbackend = "bwrap"\n[exec]\ncommands = ["*"]\n'
        mounted = plain + f'[mounts.data]\nsource = "{ds}"\ntarget = "/data"\n'
        t = time.perf_counter()
        _start(home, mounted)  # the cold start: fills the digest cache
        first = time.perf_counter() - t
        withs, withouts = [], []
        for _ in range(rounds):
            withouts.append(_start(home, plain))
            withs.append(_start(home, mounted))
        w, wo = statistics.median(withs), statistics.median(withouts)
        print(f"  warm box start with the mount {w * 1000:.0f} ms, without {wo * 1000:.0f} ms: {w / wo:.2f}x "
              f"(target <= 1.1x: {'met' if w / wo <= 1.1 else 'NOT met'}; the first, cold: {first * 1000:.0f} ms)")
        from tkbox_nb import Box
        hosts, boxes = [], []
        with Box(policy=mounted, home=home, bundle_path=home / "bench-read.tkb") as box:
            for i in range(3 * rounds):  # each read is short and the host shared: more rounds, in turn
                for where in ("host", "box") if i % 2 else ("box", "host"):
                    if where == "host":
                        r = subprocess.run([sys.executable, "-c", READ, str(ds)], capture_output=True, text=True,
                                           check=True)
                        hosts.append(float(r.stdout.split()[0]))
                    else:
                        boxes.append(float(box.run(["python3", "-c", READ, "/data"]).stdout.split()[0]))
        host, inbox = min(hosts), min(boxes)  # the fastest of each: a loaded host only ever adds time to a read
        print(f"  reading every file: in the box {inbox * 1000:.0f} ms, on the host {host * 1000:.0f} ms (fastest of "
              f"{len(hosts)}; medians {statistics.median(boxes) * 1000:.0f} and {statistics.median(hosts) * 1000:.0f}):"
              f" {host / inbox:.2f}x the host's speed (target >= 0.9x: {'met' if host / inbox >= 0.9 else 'NOT met'})")
        MachineSigner(home).stop()
        shutil.rmtree(work / "home", ignore_errors=True)
