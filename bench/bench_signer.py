"""Crossings per second through the signer, 1 and 16 in flight, and verify records per second; each beside its peer
(Tracekit alone, on the same signer in the same run) and its floor.

- 1 in flight: one crossing at a time (decide + complete), as a door that waits for each; the peer is Tracekit's
  client doing the same with the same argument size.
- 16 in flight: `RunRecorder.decide_many` / `complete_many`, as the patch door does, so the signer's writer can put
  several records under one fsync (tkbox_nb/signing/lanes.py); the peer is 16 threads, each with a Tracekit client
  of its own, on one run.
- Floors, measured here: fsync (a small append and fdatasync in the signer's store directory) and Ed25519 signing
  per record, two records a crossing: 1 / (2 (fsync + sign)) one at a time, 1 / (2 (fsync / 16 + sign)) when one
  fsync covers 16 records. Also the signer process's own CPU time per crossing, read from /proc, and the rate it
  allows: the floor that no batching removes.
Rounds alternate so every figure sees the same store size and machine load; then one run of n crossings, 16 in
flight, is bundled and verified.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import MachineSigner
from tkbox_nb.bundle.verify import verify_bundle

IN_FLIGHT = 16
RESULT = {"status": "ok", "exit_code": 0, "stdout": "sha256:" + "0" * 64, "stdout_size": 4}
BOX = {"backend": "none", "isolation": "none", "image_digest": "none"}


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) the process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _floors(store: Path) -> tuple[float, float]:
    """(fsync seconds, Ed25519 sign seconds) per record, medians measured now."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = store / "bench-fsync.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        syncs = []
        for _ in range(200):
            t = time.perf_counter()
            os.write(fd, b"x" * 600 + b"\n")
            os.fdatasync(fd)
            syncs.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    key, record = Ed25519PrivateKey.generate(), b"r" * 600
    signs = []
    for _ in range(2000):
        t = time.perf_counter()
        key.sign(record)
        signs.append(time.perf_counter() - t)
    return statistics.median(syncs), statistics.median(signs)


def _tracekit(signer: MachineSigner, n: int, args: str, in_flight: int) -> float:
    """Tracekit's own client alone: `in_flight` threads, each with a client (one stream) of its own, on one run."""
    from tracekit.sdk.client import RunHandle
    clients = [signer.client() for _ in range(in_flight)]
    for c in clients:  # connected one after another: a burst of connects overflows the signer's listen backlog
        c.status({})
    run = clients[0].run(agent="bench-baseline")
    handles = [RunHandle(c, run.registered) for c in clients]
    todo = iter(range(n))
    lock = threading.Lock()

    def work(h):
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            h.decide(f"c-{i}", "box.exec", args.replace("SEQ", str(i)))
            h.complete(f"c-{i}", "ok", result=RESULT)

    t = time.perf_counter()
    threads = [threading.Thread(target=work, args=(h,)) for h in handles]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    run.close()
    for c in clients:
        c.close()
    return elapsed


def _tkbox(signer: MachineSigner, n: int, in_flight: int) -> tuple[float, RunRecorder]:
    rec = RunRecorder(signer, Policy.default(), BOX).open()
    t = time.perf_counter()
    if in_flight == 1:
        for i in range(n):
            c = rec.decide("exec", "command", {"argv": ["echo", str(i)]})
            rec.complete(c, "ok", {"exit_code": 0}, {"stdout": f"{i}\n".encode()})
    else:
        cs = rec.decide_many([("exec", "command", {"argv": ["echo", str(i)]}, None) for i in range(n)])
        rec.complete_many([(c, "ok", {"exit_code": 0}, {"stdout": f"{i}\n".encode()}) for i, c in enumerate(cs)])
    elapsed = time.perf_counter() - t
    assert not rec.broken, rec.broken
    return elapsed, rec


def main(n: int | None = None) -> None:
    n = n or 5_000
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    signer = MachineSigner(home).ensure()
    try:
        warm = RunRecorder(signer, Policy.default(), BOX).open()
        c = warm.decide("exec", "command", {"argv": ["echo", "0"]})
        sample = json.dumps(c.args, sort_keys=True, separators=(",", ":")).replace('"0"]', '"SEQ"]')
        warm.close()
        fsync, sign = _floors(signer.data_dir / "store")
        rounds, per = 5, max(1, n // 5)
        took = {k: 0.0 for k in ("tk1", "tb1", "tkN", "tbN")}
        cpu = {k: 0.0 for k in took}
        pid = signer.pid()
        for _ in range(rounds):
            for key in took:
                c0 = _cpu(pid)
                if key.startswith("tk"):
                    took[key] += _tracekit(signer, per, sample, 1 if key == "tk1" else IN_FLIGHT)
                else:
                    elapsed, rec = _tkbox(signer, per, 1 if key == "tb1" else IN_FLIGHT)
                    took[key] += elapsed
                    rec.close()
                cpu[key] += _cpu(pid) - c0
        _, rec = _tkbox(signer, n, IN_FLIGHT)  # the run that is bundled and verified below
        rec.close("bench done")
        total = per * rounds
        rate = {k: total / v for k, v in took.items()}
        signer_cpu = {k: v / total for k, v in cpu.items()}
        floor1 = 1 / (2 * (fsync + sign))
        floorN = 1 / (2 * (fsync / IN_FLIGHT + sign))
        print(f"signer crossings (decide + complete, ack-on-fsync), {total} per figure; measured here: fsync "
              f"{fsync * 1e6:.0f} us, Ed25519 sign {sign * 1e6:.0f} us per record, two records a crossing")
        for label, k, peer, floor in (("1 in flight ", "1", "tk1", floor1), (f"{IN_FLIGHT} in flight", "N", "tkN",
                                                                                 floorN)):
            mine, base = rate["tb" + k], rate[peer]
            print(f"  {label}: tkbox {mine:6.0f}/s | tracekit alone {base:6.0f}/s ({100 * (base / mine - 1):+5.1f}% "
                  f"tkbox overhead) | fsync+sign floor {floor:6.0f}/s ({mine / floor:.0%} of it) | signer CPU "
                  f"{signer_cpu['tb' + k] * 1e3:.2f} ms a crossing, so at most {1 / signer_cpu['tb' + k]:6.0f}/s "
                  f"({mine * signer_cpu['tb' + k]:.0%} of it)")
        print(f"  {IN_FLIGHT} in flight / 1 in flight: tkbox {rate['tbN'] / rate['tb1']:.1f}x, tracekit alone "
              f"{rate['tkN'] / rate['tk1']:.1f}x")
        bundle = home / "bench.tkb"
        t = time.perf_counter()
        rec.write_bundle(bundle)
        print(f"  bundle of a {IN_FLIGHT}-in-flight run ({n} crossings) written in "
              f"{time.perf_counter() - t:.2f}s ({bundle.stat().st_size / 1e6:.1f} MB)")
        from tracekit.verify.v2 import verify as tracekit_verify
        records = 2 * n + 4
        with contextlib.redirect_stdout(io.StringIO()):
            t = time.perf_counter()
            rep, code = tracekit_verify(str(bundle), str(signer.trust_path))
            base_v = time.perf_counter() - t
        assert code == 0, rep.failures
        t = time.perf_counter()
        report = verify_bundle(bundle, signer.trust_path)
        mine_v = time.perf_counter() - t
        assert report.valid, report.summary()
        print(f"verify, {records} records")
        print(f"  tracekit verify alone : {records / base_v:8.0f} records/s")
        print(f"  tkbox verify (all)    : {records / mine_v:8.0f} records/s")
        print(f"  tkbox overhead        : {100 * (mine_v / base_v - 1):+6.1f}%")
    finally:
        signer.stop()
        shutil.rmtree(home, ignore_errors=True)
