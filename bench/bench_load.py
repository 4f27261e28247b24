"""Load: many cells in one box, many boxes at once, a very long run viewed and verified. Nothing may be lost: the
count of signed records equals the count of crossings every time, and every bundle verifies.

`python -m bench load [--n SCALE]`: SCALE 1 is the issue's sizes (1,000 cells; 8 boxes; a 100,000-crossing run);
smaller values scale the counts down (e.g. --n 10 for a tenth) for a quick check. The 100 concurrent egress
connections need a network namespace for their server (root): without one that line says it was skipped.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

from tkbox_nb import Box, open_run
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import MachineSigner
from tkbox_nb.bundle.verify import verify_bundle


def _count(bundle: Path, door: str, kind: str) -> tuple[int, int]:
    """(decisions, results) of `door`/`kind` in a bundle."""
    cs = [c for c in open_run(bundle).crossings() if c.door == door and (c.args or {}).get("kind") == kind]
    return len(cs), sum(1 for c in cs if c.result is not None)


def _cells(home: Path, n: int) -> str:
    bundle = home / "cells.tkb"
    t = time.perf_counter()
    with Box(backend="bwrap", home=home, bundle_path=bundle) as box:
        box.execute("i = 0")
        for _ in range(n):
            box.execute("i += 1")
        last = box.execute("i").outputs[-1]["data"]["text/plain"]
    elapsed = time.perf_counter() - t
    decisions, results = _count(bundle, "exec", "cell")
    ok = decisions == results == n + 2 and last == str(n) and verify_bundle(bundle, home / 'trust.json').valid
    return (f"{n} cells in one box: {elapsed:.1f} s ({elapsed / n * 1000:.1f} ms per cell); signed {decisions} cell "
            f"decisions and {results} results for {n + 2} cells; "
            f"{'nothing lost, verifies' if ok else 'LOST OR INVALID'}")


def _boxes(home: Path, boxes: int, commands: int) -> str:
    results: dict[int, tuple[bool, str]] = {}

    def one(k: int) -> None:
        bundle = home / f"box-{k}.tkb"
        try:
            with Box(backend="bwrap", home=home, bundle_path=bundle) as box:
                for i in range(commands):
                    assert box.run(["echo", str(i)]).stdout == f"{i}\n".encode()
            d, r = _count(bundle, "exec", "command")
            results[k] = (d == r == commands and verify_bundle(bundle, home / 'trust.json').valid, f"{d}/{r}")
        except Exception as e:  # counted as a failure below, with its reason
            results[k] = (False, f"{type(e).__name__}: {e}"[:200])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(boxes)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    good = sum(ok for ok, _ in results.values())
    bad = [why for ok, why in results.values() if not ok]
    return (f"{boxes} boxes at once, {commands} commands each: {elapsed:.1f} s; {good}/{boxes} bundles with every "
            f"crossing signed and verifying" + (f"; failures: {bad[:3]}" if bad else ""))


def _egress(home: Path, connections: int) -> str:
    """`connections` HTTP requests at once from one box through the egress door: each one signed decision and one
    signed end, none lost, the bundle verifying."""
    from bench.bench_egress import CONCURRENT
    from tests.testnet import NamespaceNet, available
    ok, why = available()
    if not ok:
        return f"{connections} concurrent egress connections: skipped ({why})"
    bundle = home / "egress.tkb"
    with NamespaceNet(index=8) as net:
        policy = Policy.from_toml(f'[egress]\nallow = ["{net.web}:8080"]\nallow_cidrs = ["198.18.0.0/15"]\n')
        code = CONCURRENT.replace("range(100)", f"range({connections})")
        t = time.perf_counter()
        with Box(backend="bwrap", policy=policy, home=home, bundle_path=bundle) as box:
            r = box.run(["python3", "-c", code, f"http://{net.web}:8080/"])
        elapsed = time.perf_counter() - t
    good, errors = (int(x) for x in r.stdout.split()[:2])
    cs = [c for c in open_run(bundle).crossings() if c.door == "egress"]
    ended = sum(1 for c in cs if c.result is not None)
    ok = good == connections and len(cs) == ended == connections and verify_bundle(bundle, home / "trust.json").valid
    return (f"{connections} concurrent egress connections from one box: {elapsed:.1f} s; {good} ok, {errors} errors; "
            f"signed {len(cs)} connections and {ended} ends; {'nothing lost, verifies' if ok else 'LOST OR INVALID'}")


def _long_run(home: Path, n: int) -> str:
    signer = MachineSigner(home).ensure()
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    t = time.perf_counter()
    for i in range(n):
        c = rec.decide("exec", "command", {"argv": ["echo", str(i)]})
        rec.complete(c, "ok", {"exit_code": 0}, {"stdout": f"{i}\n".encode()})
    record = time.perf_counter() - t
    rec.close("bench done")
    from tkbox_nb.core.errors import BundleError
    try:
        bundle = rec.write_bundle(home / "long.tkb")
    except BundleError as e:  # past what one Tracekit bundle can hold: said, never an unreadable file
        return (f"a {n}-crossing run: recorded in {record:.0f} s ({record / n * 1000:.2f} ms per crossing); no bundle: "
                f"{e}")
    t = time.perf_counter()
    run = open_run(bundle)
    df = run.to_dataframe()
    view = time.perf_counter() - t
    from tkbox_nb.jupyter.run_view import static_html
    t = time.perf_counter()
    static_html(run)
    html = time.perf_counter() - t
    t = time.perf_counter()
    report = verify_bundle(bundle, home / "trust.json")
    verify = time.perf_counter() - t
    rows = int((df["door"] == "exec").sum())
    ok = rows == n and report.valid
    return (f"a {n}-crossing run: recorded in {record:.0f} s ({record / n * 1000:.2f} ms per crossing), bundle "
            f"{bundle.stat().st_size / 1e6:.1f} MB; open + DataFrame {view:.1f} s, static view {html:.1f} s, verify "
            f"{verify:.1f} s; {rows} exec rows for {n} crossings, "
            f"{'nothing lost, verifies' if ok else 'LOST OR INVALID'}")


def main(n: int | None = None) -> None:
    scale = n or 1
    home = Path(tempfile.mkdtemp(prefix="tkb-load-", dir="/tmp"))
    MachineSigner(home).ensure().write_trust(home / "trust.json")  # every bundle here verifies against this signer
    try:
        print("load:")
        print("  " + _cells(home, 1000 // scale))
        print("  " + _boxes(home, 8, 100 // scale))
        print("  " + _egress(home, 100 // scale))
        print("  " + _long_run(home, 100_000 // scale))
    finally:
        MachineSigner(home).stop()
        shutil.rmtree(home, ignore_errors=True)
