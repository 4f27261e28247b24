"""Batch reruns and audits on Dask (`tkbox rerun --many`): each bundle rerun in a fresh box on whichever worker takes
it, then audited against its original.

Why this shape:
- Each task is one bundle. The client reads the bundle (and the trust config and policy, if given) and sends their
  bytes with the task, and the task returns the new bundle's bytes: workers on other hosts need no shared filesystem,
  and nothing a worker wrote outlives its task. The task runs in a scratch directory of its own, removed at its end
  (a killed worker's is removed by the next task on that host).
- Dask holds every task until its result is in: a worker that dies (its box and kernel die with it: bwrap runs with
  --die-with-parent) has its task run again on another worker. Each bundle is one future under one key, so its result
  is taken once; the client alone writes the rerun to a path that depends only on the bundle (`rerun_path`), through
  a temporary file and a rename, so a rerun that did get done twice would overwrite, never add a second file.
- Workers are processes, not threads: each rerun starts a box, a kernel and a signed run of its own.
- A task never raises for a bad bundle: it returns a `failed` row with the reason (does not verify, cannot be read,
  the box refused...). A task whose workers kept dying (Dask's allowed-failures) is a `failed` row too.

Exit status (`exit_code`): 0 every bundle equivalent, 1 some different and none failed, 2 any failed (or bad input).
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tkbox_nb.core.atomic_file import write_atomic
from tkbox_nb.core.errors import TkboxError

MAX_BUNDLE_BYTES = 256 << 20  # a bundle travels inside its task: bounded, and each entry is already <= 64 MiB
MAX_TRUST_BYTES = 1 << 20
MAX_DIFFERENCES = 20  # kept per result (the count is exact): the result stays small
MAX_TEXT = 300
SCRATCH_PREFIX = "tkbox-batch-"  # then the worker's pid: a dead worker's directory is swept by the next task
STATUSES = ("equivalent", "different", "failed")


@dataclass
class BatchResult:
    """One bundle's outcome: plain values only (it crosses from the worker to the client)."""

    bundle: str
    status: str  # equivalent | different | failed
    reason: str = ""
    differences: int = 0
    new_bundle: str | None = None
    duration: float = 0.0
    worker: str = ""
    details: list[dict] = field(default_factory=list)  # the first MAX_DIFFERENCES differences: what, a, b

    def as_dict(self) -> dict:
        return asdict(self)


def rerun_path(bundle: str | Path, out_dir: str | Path) -> Path:
    """Where the rerun of `bundle` goes: the same path whenever the same bundle is rerun into the same directory."""
    src = Path(bundle).resolve()
    tag = hashlib.sha256(str(src).encode()).hexdigest()[:10]
    stem = src.name[:-4] if src.name.endswith(".tkb") else src.name
    return Path(out_dir) / f"{stem}.{tag}.rerun.tkb"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def rerun_one(name: str, data: bytes, policy: tuple[str, str] | None = None, trust: bytes | None = None,
              backend: str = "auto", verify: bool = True,
              tolerance: dict | None = None) -> tuple[dict, bytes | None]:
    """The task: verify the bundle `data` (named `name` in messages), rerun it in a fresh box, audit the rerun
    against it (within `tolerance`: audit's rtol, atol, image_tolerance). Returns (a BatchResult as a dict, the new
    bundle's bytes or None). Never raises for a bad bundle."""
    from tkbox_nb.policy import Policy
    from tkbox_nb.audit.compare import audit
    from tkbox_nb.core.errors import BundleError
    from tkbox_nb.audit.replay import rerun
    from tkbox_nb.bundle.read_back import open_run
    started = time.monotonic()
    result = BatchResult(name, "failed", worker=f"{socket.gethostname()}:{os.getpid()}")
    new = None
    from tkbox_nb.core import scratch as scratch_dirs
    scratch = scratch_dirs.fresh(SCRATCH_PREFIX)
    try:
        original = scratch / "original.tkb"
        original.write_bytes(data)
        trust_path = None
        if trust is not None:
            trust_path = scratch / "trust.json"
            trust_path.write_bytes(trust)
        try:  # read once: what is verified, rerun and audited are these very bytes (I7)
            run = open_run(original)
        except BundleError as e:
            raise TkboxError(f"does not verify (UNREADABLE: {e})") from None
        if verify:
            report = run.verify(trust_path)
            if not report.valid:
                raise TkboxError(f"does not verify ({report.summary()})")
        pol = Policy.from_toml(policy[0], policy[1]) if policy else None
        out = rerun(run, scratch / "rerun.tkb", policy=pol, backend=backend).path
        report = audit(run, out, **(tolerance or {}))
        result.differences = len(report.differences)
        result.details = [{"what": d.what, "a": _clip(d.a), "b": _clip(d.b)}
                          for d in report.differences[:MAX_DIFFERENCES]]
        if report.status == "incomparable":  # nothing to compare is not a pass
            result.reason = "nothing to compare: no cell, command or other crossing in either run"
        elif report.equivalent:
            result.status = "equivalent"
        else:
            first = report.differences[0]
            result.status, result.reason = "different", f"{first.what}: {_clip(first.a)!r} != {_clip(first.b)!r}"
        new = out.read_bytes()
    except TkboxError as e:
        result.reason = _clip(" ".join(str(e).split()))
    except Exception as e:  # a bug or an environment fault: still a row with its reason, never a lost result
        result.reason = _clip(f"{type(e).__name__}: {' '.join(str(e).split())}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        result.duration = round(time.monotonic() - started, 3)
    return result.as_dict(), new


def sweep_scratch(root: str | Path | None = None) -> list[Path]:
    """Remove the scratch directories of tasks whose worker process died (a task that ends removes its own)."""
    from tkbox_nb.core import scratch
    return scratch.sweep(SCRATCH_PREFIX, root)


def _read_capped(path: Path, cap: int, what: str) -> bytes:
    from tkbox_nb.core.atomic_file import read_capped
    try:
        return read_capped(path, cap)
    except OSError as e:
        raise TkboxError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except ValueError as e:  # not a regular file (a FIFO would hang the client), or over the cap
        raise TkboxError(f"{what} {path}: {e}" if "larger" not in str(e) else
                         f"{what} {path} is larger than {cap >> 20} MiB") from None


def scheduler_address(address: str) -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` or `tls://HOST:PORT` scheduler address, or a one-line TkboxError. Pure."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "tls"):
        raise TkboxError(f"scheduler address {address[:100]!r}: give tcp://HOST:PORT (or tls://HOST:PORT)")
    host, _, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise TkboxError(f"scheduler address {address[:100]!r}: give tcp://HOST:PORT (or tls://HOST:PORT)")
    return host, int(port)


def _connect(scheduler: str | None, workers: int | None, n_tasks: int):
    """(client, cluster or None): a client of the given scheduler, or of a LocalCluster of worker processes."""
    import logging

    from distributed import Client, LocalCluster
    if scheduler:
        if workers is not None:
            raise TkboxError("--workers sets the size of a local cluster; with --scheduler the cluster has its own")
        host, port = scheduler_address(scheduler)
        try:  # a plain connect first: a Client that fails half-made spends 20 s closing itself on the way out
            socket.create_connection((host, port), timeout=10).close()
        except OSError as e:
            raise TkboxError(f"cannot reach the Dask scheduler at {scheduler}: {e.strerror or e}") from None
        try:
            return Client(scheduler, timeout="10s", set_as_default=False), None
        except (OSError, TimeoutError, ValueError, TypeError) as e:
            raise TkboxError(f"cannot reach the Dask scheduler at {scheduler}: "
                             f"{' '.join(str(e).split())[:200] or type(e).__name__}") from None
    n = workers if workers is not None else max(1, min(os.cpu_count() or 1, n_tasks))
    if n < 1 or n > 256:
        raise TkboxError(f"--workers {n}: give between 1 and 256")
    cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                           memory_limit=0, silence_logs=logging.CRITICAL)
    try:
        return Client(cluster, set_as_default=False), cluster
    except BaseException:
        cluster.close()
        raise


def run_batch(bundles: list[str], out_dir: str | Path, scheduler: str | None = None, workers: int | None = None,
              policy: str | Path | None = None, trust: str | Path | None = None, backend: str = "auto",
              verify: bool = True, progress: Callable[[BatchResult, int, int], None] | None = None,
              client=None, tolerance: dict | None = None) -> list[BatchResult]:
    """Rerun and audit each bundle on Dask; returns one result per distinct bundle, in the order given.
    `client`: an existing distributed Client to use (the tests and the benchmark pass one); `tolerance`: audit's
    keywords rtol, atol, image_tolerance (checked here, once)."""
    from distributed import as_completed
    if tolerance:
        from tkbox_nb.audit.tolerance import Tolerance
        Tolerance(tolerance.get("rtol") or 0.0, tolerance.get("atol") or 0.0, tolerance.get("image_tolerance"))
    out_dir = Path(out_dir)
    seen: dict[Path, str] = {}
    for b in bundles:
        seen.setdefault(Path(b).resolve(), b)
    if not seen:
        raise TkboxError("no bundle given")
    pol = None
    if policy is not None:
        from tkbox_nb.policy import Policy
        p = Policy.load(policy)  # checked here, once: a bad policy is one line, not a row per bundle
        pol = (p.source, p.name)
    trust_bytes = _read_capped(Path(trust), MAX_TRUST_BYTES, "trust config") if trust is not None else None
    results: dict[str, BatchResult] = {}
    payloads: dict[str, bytes] = {}
    for src, name in seen.items():  # a bundle the client cannot read is a row at once, no task
        try:
            payloads[name] = _read_capped(src, MAX_BUNDLE_BYTES, "bundle")
        except TkboxError as e:
            results[name] = BatchResult(name, "failed", str(e))
    total = len(seen)
    done = 0
    for r in list(results.values()):
        done += 1
        if progress:
            progress(r, done, total)
    if payloads:
        own = client is None
        cluster = None
        if own:
            client, cluster = _connect(scheduler, workers, len(payloads))
        try:
            nonce = secrets.token_hex(4)
            futures = {}
            for name, data in payloads.items():
                key = f"tkbox-rerun-{nonce}-{hashlib.sha256(str(Path(name).resolve()).encode()).hexdigest()[:16]}"
                f = client.submit(rerun_one, name, data, pol, trust_bytes, backend, verify, tolerance, key=key,
                                  pure=False)
                futures[f] = name
            payloads.clear()
            for f in as_completed(list(futures), loop=client.loop):
                name = futures.pop(f)
                if name in results:  # never twice (one future per bundle: this is a guard, not a path)
                    continue
                results[name] = r = _collect(f, name, out_dir)
                done += 1
                if progress:
                    progress(r, done, total)
        finally:
            if own:
                client.close()
                if cluster is not None:
                    cluster.close()
    return [results[name] for name in seen.values()]


def _collect(future, name: str, out_dir: Path) -> BatchResult:
    """A finished future as a result: its row, and its new bundle written to its one path."""
    try:
        row, new = future.result()
    except Exception as e:  # KilledWorker (its workers kept dying), a result that could not be moved, ...
        return BatchResult(name, "failed", _clip(f"the task did not finish: {type(e).__name__}: "
                                                 f"{' '.join(str(e).split())}"))
    r = BatchResult(**row)
    if new is not None:
        path = rerun_path(name, out_dir)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, new)
            r.new_bundle = str(path)
        except OSError as e:
            r.status, r.reason = "failed", f"cannot write {path}: {e.strerror or e}"
    return r


def exit_code(results: list[BatchResult]) -> int:
    statuses = {r.status for r in results}
    return 2 if "failed" in statuses else 1 if "different" in statuses else 0


def progress_line(r: BatchResult, done: int, total: int) -> str:
    tail = f": {r.reason}" if r.reason else ""
    return f"[{done}/{total}] {r.status:<10} {r.bundle} ({r.duration:.1f} s){tail}"


def table(results: list[BatchResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    width = max([len("bundle")] + [len(r.bundle) for r in results])
    lines = [f"{'bundle':<{width}}  {'status':<10}  {'diffs':>5}  {'time':>7}  rerun / reason",
             f"{'-' * width}  {'-' * 10}  {'-' * 5}  {'-' * 7}  {'-' * 14}"]
    for r in results:
        what = r.new_bundle or ""
        if r.reason:
            what = f"{what}  {r.reason}" if what else r.reason
        lines.append(f"{r.bundle:<{width}}  {r.status:<10}  {r.differences:>5}  {r.duration:>6.1f}s  {what}")
    lines.append(f"{len(results)} bundle(s): {counts['equivalent']} equivalent, {counts['different']} different, "
                 f"{counts['failed']} failed")
    return "\n".join(lines)


def as_json(results: list[BatchResult]) -> str:
    return json.dumps({"results": [r.as_dict() for r in results], "exit_code": exit_code(results)}, indent=1)


def html_report(results: list[BatchResult]) -> str:
    """One self-contained page (no script, no external resource): every value escaped."""
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    rows = []
    for r in results:
        diffs = "".join(f"<tr><td>{html.escape(d['what'])}</td><td><pre>{html.escape(d['a'])}</pre></td>"
                        f"<td><pre>{html.escape(d['b'])}</pre></td></tr>" for d in r.details)
        detail = (f"<details><summary>{r.differences} difference(s)</summary><table><tr><th>what</th><th>original</th>"
                  f"<th>rerun</th></tr>{diffs}</table></details>") if r.details else ""
        rows.append(f"<tr class='{html.escape(r.status)}'><td>{html.escape(r.bundle)}</td>"
                    f"<td>{html.escape(r.status)}</td><td>{r.differences}</td><td>{r.duration:.1f} s</td>"
                    f"<td>{html.escape(r.new_bundle or '')}</td><td>{html.escape(r.reason)}{detail}</td></tr>")
    verdict = ", ".join(f"{counts[s]} {s}" for s in STATUSES)
    return (f"<!doctype html><meta charset='utf-8'><title>tkbox batch rerun</title>"
            f"<style>body{{font-family:sans-serif}}"
            f"td,th{{border:1px solid #ccc;padding:4px;vertical-align:top}}table{{border-collapse:collapse}}"
            f".different td:nth-child(2){{color:#a60}}.failed td:nth-child(2){{color:#b00}}"
            f".equivalent td:nth-child(2){{color:#070}}</style><h1>tkbox batch rerun: {html.escape(verdict)}</h1>"
            f"<table><tr><th>bundle</th><th>status</th><th>differences</th><th>time</th><th>rerun</th>"
            f"<th>reason</th></tr>{''.join(rows)}</table>")
