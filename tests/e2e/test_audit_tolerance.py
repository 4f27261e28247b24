"""Audits a researcher can trust, with real bwrap runs of a small ML-style notebook: float noise below the tolerance
is equivalent and above it different, a DataFrame with one changed value is found, the same plot re-rendered with
other PNG metadata is equal by pixels and a changed plot is not, a JSON score within the tolerance is equal, and a
cell marked `# NBVAL_IGNORE_OUTPUT` (printing the time) is not compared, while exact stays the default.

The knob, as in test_audit_outputs.py: a command writes the JSON in the environment variable K into /tmp/K; the
bundle records the variable's name only, so every crossing's arguments stay equal while what the cells read changes.
"""

from __future__ import annotations
# the exec door's items in order: the knob's command (#1), then the cells (#2..#8)

import json
from pathlib import Path

import pytest
from conftest import run_cli

from tkbox_nb import Box
from tkbox_nb.audit.compare import audit
from tkbox_nb.backends.bwrap import BwrapBackend

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

POLICY = "[exec]\ncells = true\n"
KNOB = 'printf %s "$K" > /tmp/K'
CELLS = [
    "import json\nK = json.load(open('/tmp/K'))",
    "print('loss', 0.1 + 0.2 + K['noise'], 'steps', 3)",
    "import pandas as pd\npd.DataFrame({'score': [0.5 + K['noise'], K['value']], 'n': [1, 2]})",
    "import io, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
    "from IPython.display import Image, display\nfig, ax = plt.subplots(figsize=(2, 2), dpi=40)\n"
    "ax.plot([0, 1], [0, K['slope']])\nbuf = io.BytesIO()\n"
    "fig.savefig(buf, format='png', metadata={'Software': K['meta']})\n"
    "display(Image(data=buf.getvalue(), format='png'))",
    "# NBVAL_IGNORE_OUTPUT\nimport time\nprint(time.time_ns())",
    "from IPython.display import display\n"
    "display({'application/json': {'score': 0.25 + K['noise'], 'n': 4}}, raw=True)",
    "from IPython.display import Image, display\n"
    "display(Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + K['junk'].encode(), format='png'))",
]
BASE = {"noise": 0.0, "value": 1.5, "slope": 1, "meta": "a", "junk": "x"}


def record(out: Path, change: dict) -> Path:
    with Box(policy=POLICY, backend="bwrap", bundle_path=out) as box:
        assert box.run(["sh", "-c", KNOB], env={"K": json.dumps({**BASE, **change})}).exit_code == 0
        for cell in CELLS:
            assert box.execute(cell).status == "ok", cell
    return out


@pytest.fixture(scope="module")
def runs(signer, tmp_path_factory):
    d = tmp_path_factory.mktemp("tolerance")
    return {name: record(d / f"{name}.tkb", change) for name, change in (
        ("original", {}), ("small", {"noise": 1e-12}), ("large", {"noise": 1e-3}), ("frame", {"value": 2.5}),
        ("replot", {"meta": "b"}), ("plot", {"slope": 2}), ("junk", {"junk": "y"}))}


def kinds(report) -> list[str]:
    return [d.what for d in report.differences]


def test_float_noise_below_the_tolerance_is_equivalent_and_exact_stays_the_default(runs):
    exact = audit(runs["original"], runs["small"])
    assert exact.status == "different" and kinds(exact) == ["cell outputs #3", "cell outputs #7"]
    loose = audit(runs["original"], runs["small"], rtol=1e-9)
    assert loose.equivalent, loose.table()
    assert "numbers within rtol 1e-09, atol 0" in loose.table()
    assert "exact (no tolerance)" in exact.table()


def test_float_noise_above_the_tolerance_is_different(runs):
    report = audit(runs["original"], runs["large"], rtol=1e-9)
    assert kinds(report) == ["cell outputs #3", "cell outputs #4", "cell outputs #7"]
    assert audit(runs["original"], runs["large"], rtol=1e-2).equivalent


def test_a_dataframe_with_one_changed_value_is_different_within_any_small_tolerance(runs):
    report = audit(runs["original"], runs["frame"], rtol=1e-6, atol=1e-9)
    assert kinds(report) == ["cell outputs #4"]


def test_the_same_plot_re_rendered_is_equal_by_pixels_and_a_changed_plot_is_not(runs):
    assert kinds(audit(runs["original"], runs["replot"])) == ["cell outputs #5"]  # by digest: different
    assert audit(runs["original"], runs["replot"], image_tolerance=0).equivalent
    changed = audit(runs["original"], runs["plot"], image_tolerance=8)
    assert kinds(changed) == ["cell outputs #5"]
    assert any("pixels differ (largest channel difference" in n for n in changed.differences[0].detail)


def test_an_nbval_ignore_output_cell_has_its_code_compared_only_and_is_named(runs):
    report = audit(runs["original"], runs["replot"], image_tolerance=0)
    assert report.marks["nbval-ignore-output"] == (1, 1)
    assert "nbval marks honoured (cells in A/B, outputs not compared): nbval-ignore-output 1/1" in report.table()


def test_the_cli_takes_the_tolerances_and_refuses_bad_ones_and_undecodable_images_in_one_line(runs, tmp_path):
    ok = run_cli("audit", str(runs["original"]), str(runs["small"]), "--rtol", "1e-9")
    assert ok.returncode == 0 and ok.stdout.startswith("EQUIVALENT"), ok.stdout + ok.stderr
    for bad in (["--rtol", "-1"], ["--atol", "nan"], ["--image-tolerance", "300"]):
        r = run_cli("audit", str(runs["original"]), str(runs["small"]), *bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a tolerance is a finite number" in r.stderr, \
            r.stderr
    junk = run_cli("audit", str(runs["original"]), str(runs["junk"]), "--image-tolerance", "0")
    assert junk.returncode == 2 and junk.stderr.count("\n") == 1 and "does not decode as an image" in junk.stderr, \
        junk.stderr
    (tmp_path / "not.tkb").write_text("not a bundle")
    r = run_cli("audit", str(tmp_path / "not.tkb"), str(runs["small"]), "--rtol", "1e-9")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_a_signed_verdict_of_a_real_pair_records_its_tolerance_and_reaudits_the_same(runs, tmp_path, signer):
    import subprocess

    from conftest import VENV_BIN
    v = tmp_path / "verdict.tkb"
    r = run_cli("audit", str(runs["original"]), str(runs["replot"]), "--image-tolerance", "0", "--rtol", "1e-9",
                "--sign", "-o", str(v))
    assert r.returncode == 0, r.stdout + r.stderr
    t = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(v), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True)
    assert t.returncode == 0, t.stdout + t.stderr
    ok = run_cli("verify", str(v), "--inputs", str(runs["original"]), str(runs["replot"]), "--reaudit")
    assert ok.returncode == 0 and "gives the same verdict" in ok.stdout, ok.stdout + ok.stderr
    assert "signed audit verdict: EQUIVALENT, 0 difference(s); tolerance: numbers within rtol 1e-09, atol 0; " \
           "images by decoded pixels" in run_cli("show", str(v)).stdout


def test_a_changed_workspace_or_policy_is_explained_first_when_the_code_is_the_same(signer, tmp_path):
    """The same cell reads a file of its starting workspace; the second run starts from another workspace under
    another policy: the report puts both first, each as one line, before the output's line diff."""
    made = []
    for name, text, policy in (("a", "one", POLICY), ("b", "two", "[box]\ncpu_time_s = 1800\n" + POLICY)):
        ws = tmp_path / f"ws-{name}"
        ws.mkdir()
        (ws / "data.txt").write_text(text)
        with Box(policy=policy, backend="bwrap", workspace=ws, bundle_path=tmp_path / f"{name}.tkb") as box:
            assert box.execute("print(open('/workspace/data.txt').read())").status == "ok"
        made.append(tmp_path / f"{name}.tkb")
    report = audit(*made)
    table = report.table().splitlines()
    first = table.index("  the code is the same; what else differed:")
    assert table[first + 1].startswith("    starting policy: ") and table[first + 2].startswith(
        "    starting workspace: tree2:sha256:"), table
    assert first < min(i for i, line in enumerate(table) if line.startswith("  cell outputs #1"))
    assert "-one" in report.table() and "+two" in report.table()
    html = report.html()
    assert "<h2>What else differed</h2>" in html and "starting workspace" in html


def test_the_report_shows_table_cells_pixels_and_line_diffs_not_raw_json(runs, tmp_path):
    frame = audit(runs["original"], runs["frame"]).table()
    assert "table cells that changed:\n      row 1, column score: A '1.5', B '2.5'" in frame
    assert "<td>" not in frame and "allow:" not in frame
    plot = audit(runs["original"], runs["plot"]).table()
    assert "pixels differ (largest channel difference" in plot
    replot = audit(runs["original"], runs["replot"]).table()
    assert "the same pixels, other bytes" in replot
    large = audit(runs["original"], runs["large"]).table()
    assert "-loss 0.30000000000000004 steps 3" in large and "+loss 0.30100000000000005 steps 3" in large
    junk = audit(runs["original"], runs["junk"]).table()  # exact: an image that does not decode is said, not fatal
    assert "does not decode as an image" in junk and "object at 0x" not in junk
    html = tmp_path / "r.html"
    assert run_cli("audit", str(runs["original"]), str(runs["frame"]), "--html", str(html)).returncode == 1
    assert "row 1, column score: A &#x27;1.5&#x27;, B &#x27;2.5&#x27;" in html.read_text()
