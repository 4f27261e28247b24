"""Batch reruns on Dask (`tkbox rerun --many`): the same ten recorded runs rerun and audited on a LocalCluster of one
worker process, then of two, in the same run. Target: two workers at least 1.6x as fast as one.

Each figure is the batch's wall time from submitting the ten tasks to the last result, with the cluster already up
and each worker's imports warm: a rerun is a box start, a kernel start, the cells, the run's bundle, verifying the
original and auditing the two. The signer is shared by both workers (one machine signer, as on one host).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from tkbox_nb.audit.batch import run_batch
from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
from tkbox_nb.signing.signer import MachineSigner

RUNS = 10


def _record(home: Path, out: Path, i: int) -> Path:
    nb = NotebookBox(bundle_dir=home / "recording", home=home)
    HostMagics(nb, lambda prompt: "").run("box_policy", "", "[exec]\ncells = true\n")
    for code in (f"n = {i}", "print('n squared', n * n)", "sum(range(n * 1000))"):
        nb.ensure_box().execute(code)
    nb.stop("done").replace(out)
    return out


def _warm() -> None:
    import tkbox_nb.box.box  # noqa: F401
    import tkbox_nb.audit.replay  # noqa: F401
    import tkbox_nb.bundle.verify  # noqa: F401


def _batch(bundles: list[Path], out_dir: Path, workers: int) -> tuple[float, list]:
    from distributed import Client, LocalCluster
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                           memory_limit=0, silence_logs=logging.CRITICAL)
    client = Client(cluster, set_as_default=False)
    try:
        client.wait_for_workers(workers, timeout=120)
        client.run(_warm)
        t = time.perf_counter()
        results = run_batch([str(b) for b in bundles], out_dir, client=client)
        return time.perf_counter() - t, results
    finally:
        client.close()
        cluster.close()


def main(n: int | None = None) -> None:
    runs = n or RUNS
    home = Path(tempfile.mkdtemp(prefix="tkb-batch-", dir="/tmp"))
    old = os.environ.get("TKBOX_HOME")
    os.environ["TKBOX_HOME"] = str(home)  # the worker processes inherit it: they sign into the same signer
    MachineSigner(home).ensure()
    try:
        t = time.perf_counter()
        bundles = [_record(home, home / f"run{i:02d}.tkb", i) for i in range(runs)]
        print(f"batch: {runs} runs recorded in {time.perf_counter() - t:.1f} s; load before: "
              f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
        figures = {}
        for workers in (1, 2):
            elapsed, results = _batch(bundles, home / f"reruns-{workers}", workers)
            ok = sum(r.status == "equivalent" for r in results)
            figures[workers] = elapsed
            print(f"  {workers} worker(s): {runs} reruns and audits in {elapsed:6.1f} s "
                  f"({elapsed / runs:.2f} s each); {ok}/{runs} equivalent"
                  + ("" if ok == runs else f"; NOT all equivalent: {[r.reason for r in results if r.reason][:2]}"))
        ratio = figures[1] / figures[2]
        print(f"  speed-up with two workers: {ratio:.2f}x; target >= 1.6x: {'met' if ratio >= 1.6 else 'NOT met'} "
              f"(load after: {os.getloadavg()[0]:.1f})")
    finally:
        MachineSigner(home).stop()
        if old is None:
            os.environ.pop("TKBOX_HOME", None)
        else:
            os.environ["TKBOX_HOME"] = old
        shutil.rmtree(home, ignore_errors=True)
