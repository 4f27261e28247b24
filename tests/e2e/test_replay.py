"""Replay, rerun and audit with real boxes: a run back as a notebook, executed again, and two runs compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import run_cli, tamper_content

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])
ROOT = Path(__file__).resolve().parents[2]

CELLS = ["x = 21", "print('double', x * 2)", "from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))",
         "import datetime\nprint('at', datetime.datetime.now().isoformat())", "x + 1"]


def notebook_run(out: Path, cells=CELLS, policy_body="[exec]\ncells = true\n") -> Path:
    """A run made the way the kernel makes one: a host-side %%box_policy, then cells in the notebook's box."""
    nb = NotebookBox(bundle_dir=out.parent / f"{out.stem}-bundles")
    magics = HostMagics(nb, lambda prompt: "")
    magics.run("box_policy", "", policy_body)
    for code in cells:
        nb.ensure_box().execute(code)
    path = nb.stop("done")
    path.replace(out)
    return out


@pytest.fixture(scope="module")
def original(signer, tmp_path_factory):
    return notebook_run(tmp_path_factory.mktemp("orig") / "orig.tkb")


def test_replay_gives_the_cells_their_outputs_and_where_they_came_from(original, tmp_path):
    r = run_cli("replay", str(original), "-o", str(tmp_path / "run.ipynb"))
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(tmp_path / "run.ipynb", as_version=4)
    assert nb.metadata.kernelspec.name == "tkbox"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source.startswith("%%box_policy") and "tkbox-host" in code[0].metadata.tags
    assert [c.source for c in code[1:]] == CELLS
    assert code[2].outputs[0]["text"] == "double 42\n"
    assert code[3].outputs[0]["data"]["text/html"] == "<b>hi</b>"
    assert code[5].outputs[0]["data"]["text/plain"] == "22" and code[5].execution_count == 5
    run = open_run(original)
    meta = code[2].metadata.tkbox
    assert meta.run_id == run.run_id and meta.decision == "allow"
    assert meta.code_digest == next(c for c in run.crossings() if c.seq == meta.decision_seq).args["code"]
    assert open_run(original).to_notebook().cells[2].source == CELLS[0]


def test_replay_refuses_a_bundle_that_does_not_verify(original, tmp_path):
    bad = tamper_content(original, tmp_path / "bad.tkb")
    r = run_cli("replay", str(bad), "-o", str(tmp_path / "bad.ipynb"))
    assert r.returncode == 2 and "does not verify" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bad.ipynb").exists()


def test_rerun_writes_a_new_signed_run_naming_the_original_and_audits_equivalent(original, tmp_path):
    r = run_cli("rerun", str(original), "-o", str(tmp_path / "again.tkb"))
    assert r.returncode == 0, r.stderr
    again = open_run(tmp_path / "again.tkb")
    assert verify_bundle(tmp_path / "again.tkb").valid
    # named in its box manifest, never as Tracekit's replay_of (a `tracekit why` replay arm, which a rerun is not)
    assert again.box.get("rerun_of") == open_run(original).run_id and "replay_of" not in again.box
    assert f"naming the original ({open_run(original).run_id}) in its box manifest (rerun_of)" in r.stdout
    assert again.run_id != open_run(original).run_id
    audit = run_cli("audit", str(original), str(tmp_path / "again.tkb"), "--json")
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["equivalent"], report  # the timestamp was sanitized


def test_audit_names_each_difference_and_writes_a_self_contained_report(original, tmp_path):
    other = notebook_run(tmp_path / "other.tkb", cells=CELLS[:1] + ["print('double', x * 3)"] + CELLS[2:])
    r = run_cli("audit", str(original), str(other), "--html", str(tmp_path / "audit.html"))
    assert r.returncode == 1 and r.stdout.startswith("DIFFERENT")
    assert "cell code #2" in r.stdout and "cell outputs #2" in r.stdout
    page = (tmp_path / "audit.html").read_text()
    assert "<script" not in page and "x * 3" in page and "http" not in page.split("<h1>")[1]


def test_nbval_reexecutes_a_replayed_notebook_in_a_box(signer, tmp_path):
    run = notebook_run(tmp_path / "det.tkb", cells=["y = 6", "print('y is', y)", "y * 7"])
    nb_path = tmp_path / "det.ipynb"
    assert run_cli("replay", str(run), "-o", str(nb_path)).returncode == 0
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval", "--nbval-kernel-name", "tkbox",
                        "-p", "no:cacheprovider", str(nb_path)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "JUPYTER_PATH": str(ROOT),
                                          "TKBOX_BUNDLE_DIR": str(tmp_path / "nbval-bundles")})
    assert r.returncode == 0, r.stdout[-3000:]
    assert "passed" in r.stdout
    # nbval kills its kernel (SIGKILL): the next box recovers that run and writes its bundle where it was meant to go
    from tkbox_nb import Box
    with Box(backend="bwrap", bundle_path=tmp_path / "next.tkb"):
        pass
    [rebundle] = (tmp_path / "nbval-bundles").glob("*.tkb")
    assert verify_bundle(rebundle).valid and open_run(rebundle).box["end_reason"].startswith("recovered")
