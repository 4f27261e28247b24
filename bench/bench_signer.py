"""Crossings per second through the signer, and verify records per second, each against Tracekit alone.

Baselines run against the same signer in the same process: Tracekit's client doing decide + complete with the same
argument size, and Tracekit's verifier on the same bundle. The ratio is what tkbox-nb adds (target: under 10%).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import time
from pathlib import Path

from tkbox_nb.policy import Policy
from tkbox_nb.recorder import RunRecorder
from tkbox_nb.signer import MachineSigner
from tkbox_nb.verify import verify_bundle


def _tracekit_crossings(signer: MachineSigner, n: int, args_template: str) -> float:
    c = signer.client()
    t = time.perf_counter()
    with c.run(agent="bench-baseline") as run:
        for i in range(n):
            run.decide(f"c-{i}", "box.exec", args_template.replace("SEQ", str(i)))
            run.complete(f"c-{i}", "ok", result={"status": "ok", "exit_code": 0, "stdout": "sha256:" + "0" * 64,
                                                 "stdout_size": 4})
    elapsed = time.perf_counter() - t
    c.close()
    return elapsed


def _tkbox_crossings(signer: MachineSigner, n: int) -> tuple[float, RunRecorder, str]:
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none",
                                                 "image_digest": "none"}).open()
    t = time.perf_counter()
    for i in range(n):
        c = rec.decide("exec", "command", {"argv": ["echo", str(i)]})
        rec.complete(c, "ok", {"exit_code": 0}, {"stdout": f"{i}\n".encode()})
    elapsed = time.perf_counter() - t
    sample = json.dumps(c.args, sort_keys=True, separators=(",", ":")).replace(f'"{n - 1}"', '"SEQ"')
    return elapsed, rec, sample


def main(n: int | None = None) -> None:
    n = n or 10_000
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    signer = MachineSigner(home).ensure()
    try:
        warm, rec0, sample = _tkbox_crossings(signer, 50)
        rec0.close()
        # alternate rounds so both see the same store size and machine load; the last tkbox run is bundled
        rounds, base, mine = 5, 0.0, 0.0
        for r in range(rounds):
            base += _tracekit_crossings(signer, n // rounds, sample)
            elapsed, rec, _ = _tkbox_crossings(signer, n // rounds if r < rounds - 1 else n)
            mine += elapsed * (1 if r < rounds - 1 else 1 / rounds)
            if r < rounds - 1:
                rec.close()
        rec.close("bench done")
        n_bundle, n = n, n // rounds * rounds
        print(f"signer crossings (decide + complete, ack-on-fsync), n={n}")
        print(f"  tracekit client alone : {n / base:8.0f} crossings/s")
        print(f"  tkbox RunRecorder     : {n / mine:8.0f} crossings/s")
        print(f"  tkbox overhead        : {100 * (mine / base - 1):+6.1f}%")
        bundle = home / "bench.tkb"
        t = time.perf_counter()
        rec.write_bundle(bundle)
        print(f"  bundle written in {time.perf_counter() - t:.2f}s ({bundle.stat().st_size / 1e6:.1f} MB)")
        from tracekit.verify.v2 import verify as tracekit_verify
        records = 2 * n_bundle + 4
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
