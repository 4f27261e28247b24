"""The example notebooks are tests: each runs under nbval (every cell executes without error) in a copy of
notebooks/, with real boxes, the real signer and the Tracekit Box kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tkbox_nb.bundle.verify import verify_bundle

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["02-policy-and-secrets.ipynb", "03-model-calls.ipynb", "04-replay-and-audit.ipynb",
             "05-agent-in-a-box.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_example_notebook_runs_under_nbval(signer, tmp_path, name):
    work = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", work)
    env = {**os.environ, "JUPYTER_PATH": str(ROOT), "TKBOX_BUNDLE_DIR": str(tmp_path / "bundles"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TKBOX_DEMO_TOKEN": "demo-value-never-in-the-box"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval-lax", "-p", "no:cacheprovider", name],
                       capture_output=True, text=True, timeout=600, cwd=work, env=env)
    assert r.returncode == 0, r.stdout[-3000:]
    if name.startswith("03"):
        from tkbox_nb import open_run
        calls = [c for c in open_run(work / "model-replay.tkb").crossings() if c.door == "model"]
        assert [c.decision for c in calls] == ["allow", "allow", "deny"]
    if name.startswith("04"):
        assert verify_bundle(work / "rerun.tkb").valid
    if name.startswith("05"):
        project = work / "agent-project"
        assert "+ 1" not in (project / "calc.py").read_text() and (project / "tests" / "test_calc.py").exists()
        assert not (project / ".env").exists() and not (project / ".git").exists()
        assert not (project / ".github").exists() and not (project / "passwd-link").exists()
        assert verify_bundle(work / "agent.tkb").valid


def test_notebooks_are_made_from_tools_make_notebooks(tmp_path):
    """notebooks/02, 04 and 05 are written by tools/make_notebooks.py: the committed files are its output."""
    import nbformat
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    for name, cells in (("02-policy-and-secrets", make_notebooks.NB02), ("03-model-calls", make_notebooks.NB03),
                        ("04-replay-and-audit", make_notebooks.NB04),
                        ("05-agent-in-a-box", make_notebooks.NB05)):
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", 4)
        assert [c.source for c in nb.cells] == [c.source for c in cells], name
        assert nb.cells[0].cell_type == "markdown" and "Shows:" in nb.cells[0].source and "Needs:" in nb.cells[0].source
