"""One large download through the egress door against the same download without it, and 100 concurrent
connections through the door. Needs root (a network namespace for the server, testnet).

Both downloads read the same file from the same server in the same run: directly from the host, and from inside a
bubblewrap box through the forwarder, the door stream and the door (one signed decision, one signed end).
Target: at least 0.5 of the direct throughput; the 100 connections all succeed.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from tkbox_nb import Box, Policy
from tkbox_nb.signing.signer import MachineSigner
from tests.testnet import NamespaceNet, available

SIZE_MB = 200
ROUNDS = 9
DOWNLOAD = """
import sys, time, urllib.request
t = time.perf_counter()
r = urllib.request.urlopen(sys.argv[1], timeout=120)
n = 0
while chunk := r.read(1 << 20):
    n += len(chunk)
print(n, time.perf_counter() - t)
"""
CONCURRENT = """
import sys, threading, urllib.request
ok, errors = [], []
def one(i):
    try:
        body = urllib.request.urlopen(sys.argv[1], timeout=60).read()
        ok.append(len(body))
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(ok), len(errors), errors[:3])
"""


def main(n: int | None = None) -> None:
    ok, why = available()
    if not ok:
        print(f"egress: skipped ({why})")
        return
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    signer = MachineSigner(home).ensure()
    try:
        with NamespaceNet(index=9) as net:
            size = (n or SIZE_MB) << 20
            net.add_file("big.bin", b"\0" * size)
            url = f"http://{net.web}:8080/big.bin"
            policy = Policy.from_toml(f'[egress]\nallow = ["{net.web}:8080"]\nallow_cidrs = ["198.18.0.0/15"]\n')
            with Box(backend="bwrap", policy=policy, home=home, bundle_path=home / "egress.tkb") as box:
                direct_times, boxed_times = [], []
                for _ in range(ROUNDS):  # alternating, so a change in the machine's load falls on both alike
                    t = time.perf_counter()
                    with urllib.request.urlopen(url, timeout=120) as r:
                        got = 0
                        while chunk := r.read(1 << 20):
                            got += len(chunk)
                    direct_times.append(time.perf_counter() - t)
                    assert got == size
                    r = box.run(["python3", "-c", DOWNLOAD, url])
                    got, seconds = r.stdout.split()
                    assert int(got) == size, r.stderr.decode()[-500:]
                    boxed_times.append(float(seconds))
                direct, boxed = statistics.median(direct_times), statistics.median(boxed_times)
                pairs = sorted(d / b for d, b in zip(direct_times, boxed_times))
                t = time.perf_counter()
                r = box.run(["python3", "-c", CONCURRENT, f"http://{net.web}:8080/"])
                concurrent = time.perf_counter() - t
                ok_count, err_count = (x.decode() for x in r.stdout.split()[:2])
        print(f"egress: one {size >> 20} MiB download, same server, same run, median of {ROUNDS}")
        print(f"  direct from the host    : {size / direct / 1e6:8.1f} MB/s")
        print(f"  from a box, via the door: {size / boxed / 1e6:8.1f} MB/s   ratio {direct / boxed:.2f} "
              f"(target >= 0.5; round by round {pairs[0]:.2f} to {pairs[-1]:.2f})")
        print(f"egress: 100 concurrent connections from a box: {ok_count} ok, {err_count} errors, "
              f"{concurrent:.2f}s")
    finally:
        signer.stop()
        shutil.rmtree(home, ignore_errors=True)
