"""`tkbox audit` with tolerances on two runs of a many-cell notebook, against the exact audit of the same pair.

The pair (made like tests/conftest.py's record_run: real signed runs, no box behind them, so it is quick): N cells
(default 500), each printing a float, showing a DataFrame (text/plain and text/html) and a matplotlib PNG; in run B
each float is off in its last digits (relative 1e-13) and each PNG is the same plot saved with other metadata. The
exact audit finds every cell different; the audit with --rtol 1e-9 --image-tolerance 0 calls the pair equivalent,
decoding every PNG pair. Figures (median of 3): both audits' times and their ratio. Targets (issue 40): the tolerant
audit at most 2x the exact one, and at most 5 s.

Second figures: numbers_equal on a hostile 100 MiB output (26M numbers on one line), differing in the last one, and
every number off within the tolerance (the worst case): the tokenizer's bound, time linear in the part that differs.
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from pathlib import Path

from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import MachineSigner

BOX = {"backend": "none", "isolation": "none", "image_digest": "none"}


def _png(meta: str) -> str:
    import base64

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(2, 2), dpi=40)
    ax.plot([0, 1, 2], [0, 1, 4])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": meta})
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _outputs(i: int, noise: float, png: str) -> bytes:
    x = (i + 0.1) / 3 * (1 + noise)
    import pandas as pd
    df = pd.DataFrame({"loss": [x, x / 2], "n": [i, i + 1]})
    return json.dumps([
        {"output_type": "stream", "name": "stdout", "text": f"epoch {i} loss {x!r}\n"},
        {"output_type": "execute_result", "execution_count": i, "metadata": {},
         "data": {"text/plain": repr(df), "text/html": df.to_html()}},
        {"output_type": "display_data", "metadata": {}, "data": {"image/png": png, "text/plain": "<Figure>"}},
    ]).encode()


def _record(signer: MachineSigner, out: Path, n: int, noise: float, meta: str) -> Path:
    png = _png(meta)
    rec = RunRecorder(signer, Policy.default(), dict(BOX)).open()
    for i in range(1, n + 1):
        c = rec.decide("exec", "cell", {}, {"code": f"train({i})\n".encode()})
        rec.complete(c, "ok", {"execution_count": i}, {"outputs": _outputs(i, noise, png)})
    rec.close("bench done")
    return rec.write_bundle(out)


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(n: int | None = None) -> None:
    from tkbox_nb.audit.compare import audit
    from tkbox_nb.audit.tolerance import numbers_equal
    from tkbox_nb.bundle.read_back import open_run
    n = n or 500
    home = Path(tempfile.mkdtemp(prefix="tkb-bench-", dir="/tmp"))
    signer = MachineSigner(home).ensure()
    try:
        a = open_run(_record(signer, home / "a.tkb", n, 0.0, "a"))
        b = open_run(_record(signer, home / "b.tkb", n, 1e-13, "b"))
        exact_report = audit(a, b)
        loose_report = audit(a, b, rtol=1e-9, image_tolerance=0)
        assert len(exact_report.differences) == n and loose_report.equivalent, loose_report.table()[:2000]
        exact = statistics.median(_time(lambda: audit(a, b)) for _ in range(3))
        loose = statistics.median(_time(lambda: audit(a, b, rtol=1e-9, image_tolerance=0)) for _ in range(3))
        print(f"audit of two {n}-cell runs (a float, a DataFrame and a PNG per cell): exact {exact:.2f} s "
              f"({n} differences), with --rtol 1e-9 --image-tolerance 0 {loose:.2f} s (equivalent): "
              f"{loose / exact:.2f}x (target <= 2x, <= 5 s)")
    finally:
        signer.stop()
    size = 100 * (1 << 20)
    line = "1.5 " * (size // 4)
    t = time.perf_counter()
    assert not numbers_equal(line, line[:-2] + "6 ", 1e-9, 0)
    last = time.perf_counter() - t
    noisy = "1.5000000001 " * (size // 4)
    t = time.perf_counter()
    numbers_equal(line, noisy, 1e-6, 0)
    print(f"numbers_equal on a hostile 100 MiB output (26M numbers on one line): the last one differing {last:.1f} s; "
          f"every one within the tolerance but not the same (the worst case) {time.perf_counter() - t:.1f} s")
