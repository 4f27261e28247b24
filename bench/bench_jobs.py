"""A signed job's fixed cost (issue 41): `tkbox run --backend bwrap -- true` against bare bwrap in the same run, a
`Box()` from creation to its first command's result and to its bundle, the same job with 1,000 and with 100,000
earlier runs in the machine signer's store, and jobs/s with `--parallel N` jobs at once.

Figures are medians of whole processes (the CLI) or of in-process calls (`Box`), measured in one run and alternated
between the two stores so a change of load falls on both; the load average is printed before and after. Targets:
`tkbox run -- true` and Box enter + run + exit <= 0.25 s, first result <= 0.1 s, the two stores within 1.1x.

The stores are made quickly: the signer stopped, Tracekit's signer service is opened in this process on the same
data directory (ack-on-write) and runs are registered and closed through its own request handler, then finalised by
its sweep: every record is a real signed record of the same log (bench only; docs/bundle-format.md#export-cost).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tkbox_nb.signing.signer import MachineSigner

SMALL, BIG = (int(x) for x in os.environ.get("TKBOX_BENCH_PRIOR", "1000,100000").split(","))
JOBS = 7
TKBOX = str(Path(sys.executable).with_name("tkbox"))
BARE = ["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"]


def make_store(home: Path, runs: int) -> float:
    """`runs` runs of 3 records each (registered, closing, final) in the signer of `home`; returns the seconds."""
    from tracekit.signer.service import CallerIdentity, open_service, signer_config

    signer = MachineSigner(home).ensure()
    signer.stop()
    cfg = signer_config(str(signer.config_path))
    cfg["data_dir"], cfg["durability"] = str(signer.data_dir), "ack-on-write"
    t = time.perf_counter()
    svc = open_service(cfg)
    me = CallerIdentity("uid", str(os.getuid()), True)
    try:
        for i in range(runs):
            r = svc.call(me, "register_run", {"agent": {"name": "bulk", "version": "0"},
                                              "request_id": uuid.uuid4().hex})
            svc.call(me, "close_run", {"run_id": r["run_id"], "run_token": r["run_token"],
                                       "request_id": uuid.uuid4().hex})
            if i % 90 == 89:  # under the open-runs quota: finalise the closing runs (their grace is long past)
                svc.sweep(now=time.monotonic() + 3600)
        svc.sweep(now=time.monotonic() + 3600)
    finally:
        svc.close()
    MachineSigner(home).ensure()
    return time.perf_counter() - t


def _timed(argv: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"bench jobs: {argv[0]} failed: {r.stderr.decode(errors='replace').strip()[-300:]}")
    return elapsed


def _env(home: Path) -> dict:
    return {**os.environ, "TKBOX_HOME": str(home)}


def _box_figures(home: Path, n: int) -> tuple[list[float], list[float]]:
    """(start to first result, start to bundle written) of `n` in-process boxes."""
    from tkbox_nb.box.box import Box
    first, whole = [], []
    os.environ["TKBOX_HOME"] = str(home)
    for i in range(n + 1):
        t = time.perf_counter()
        with Box(backend="bwrap", bundle_path=home / f"box{i}.tkb") as b:
            assert b.run(["true"]).exit_code == 0
            t1 = time.perf_counter()
        if i:  # the first warms imports
            first.append(t1 - t)
            whole.append(time.perf_counter() - t)
    return first, whole


def _export_figures(home: Path, n: int) -> list[float]:
    """Seconds to export one closed run whose checkpoint has come: the part of a job that read the signer's history."""
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    signer = MachineSigner(home)
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    c = rec.decide("exec", "command", {"argv": ["true"]})
    rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"", "stderr": b""})
    rec.close("bench")
    signer.export(rec.run_id, home / "first.zip")  # waits for run.final and its note
    out = []
    for i in range(n):
        t = time.perf_counter()
        signer.export(rec.run_id, home / f"again{i}.zip")
        out.append(time.perf_counter() - t)
    return out


def _parallel(home: Path, jobs: int, rounds: int) -> float:
    t = time.perf_counter()
    for _ in range(rounds):
        procs = [subprocess.Popen([TKBOX, "run", "--backend", "bwrap", "--", "true"], env=_env(home),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(jobs)]
        if any(p.wait(timeout=300) != 0 for p in procs):
            raise SystemExit("bench jobs: a parallel job failed")
    return jobs * rounds / (time.perf_counter() - t)


def main(n: int | None = None, parallel: int | None = None) -> None:
    jobs = n or JOBS
    base = Path(tempfile.mkdtemp(prefix="tkb-jobs-", dir="/tmp"))
    old = os.environ.get("TKBOX_HOME")
    homes = {SMALL: base / "small", BIG: base / "big"}
    try:
        print(f"jobs: load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; making the stores ...", flush=True)
        for runs, home in homes.items():
            print(f"  {runs:,} prior runs written in {make_store(home, runs):.1f} s", flush=True)
        for home in homes.values():  # warm: signer up, page cache, the export index brought up to date
            _timed([TKBOX, "run", "--backend", "bwrap", "--", "true"], _env(home))
        cli = {SMALL: [], BIG: []}
        bare = []
        for _ in range(jobs):
            for runs, home in homes.items():
                time.sleep(random.random())  # untimed: each job meets its signer's 1 s tick at a random phase
                cli[runs].append(_timed([TKBOX, "run", "--backend", "bwrap", "--", "true"], _env(home)))
            bare.append(_timed(BARE, os.environ.copy()))
        med = {k: statistics.median(v) for k, v in cli.items()}
        b = statistics.median(bare)
        print(f"  tkbox run -- true: {med[SMALL] * 1000:6.0f} ms median of {jobs} ({SMALL:,} prior runs), "
              f"{med[BIG] * 1000:6.0f} ms ({BIG:,}); bare bwrap true {b * 1000:5.1f} ms; "
              f"target <= 250 ms: {'met' if med[SMALL] <= 0.25 else 'NOT met'}")
        ratio = med[BIG] / med[SMALL]
        exports = {runs: statistics.median(_export_figures(home, jobs)) for runs, home in homes.items()}
        eratio = exports[BIG] / exports[SMALL]
        print(f"  {BIG:,} vs {SMALL:,} prior runs: whole job {ratio:.2f}x (the signer's tick, 0 to 1 s, is in both); "
              f"the export alone {exports[SMALL] * 1000:.0f} vs {exports[BIG] * 1000:.0f} ms, {eratio:.2f}x; "
              f"target within 1.1x: {'met' if max(ratio, eratio) <= 1.1 else 'NOT met'}")
        first, whole = _box_figures(homes[SMALL], jobs)
        print(f"  Box(): first command's result {statistics.median(first) * 1000:.0f} ms (target <= 100), "
              f"enter + run + exit {statistics.median(whole) * 1000:.0f} ms (target <= 250), medians of {jobs}")
        if parallel:
            rate = _parallel(homes[SMALL], parallel, max(1, jobs // parallel))
            print(f"  --parallel {parallel}: {rate:.2f} jobs/s (one at a time: {1 / med[SMALL]:.2f} jobs/s)")
        print(f"  load after: {os.getloadavg()[0]:.1f}")
    finally:
        for home in homes.values():
            MachineSigner(home).stop()
        if old is None:
            os.environ.pop("TKBOX_HOME", None)
        else:
            os.environ["TKBOX_HOME"] = old
        shutil.rmtree(base, ignore_errors=True)
