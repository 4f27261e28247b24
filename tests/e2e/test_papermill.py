"""papermill on the Tracekit Box kernel (docs/jupyter.md, "The notebook's folder"): a parameterised run of a notebook
beside its data, as a scientist schedules one. papermill is the frontend here: it injects its parameters as a cell
after the one tagged `parameters`, starts the kernel in the notebook's folder (`cwd=`, the CLI's `--cwd`) and writes
the executed notebook; the kernel's box reads the folder as its workspace and its bundle goes beside the notebook."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend

from . import test_kernel

kernel_env = test_kernel.kernel_env

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])


def _notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "tkbox", "display_name": "Python 3 (Tracekit Box)", "language": "python"}
    params = nbformat.v4.new_code_cell("column = 'a'\nscale = 1")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params,
                nbformat.v4.new_code_cell("import os, pandas as pd\n"
                                          "total = pd.read_csv('data.csv')[column].sum() * scale\n"
                                          "print('cwd', os.getcwd(), 'total', total)"),
                nbformat.v4.new_code_cell("with open('result.txt', 'w') as f:\n    f.write(str(total))\nint(total)")]
    return nb


def test_papermill_runs_a_notebook_with_parameters_in_a_box_that_reads_its_folder(kernel_env, tmp_path, monkeypatch):
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "data.csv").write_text("a,b\n1,10\n2,20\n")
    nbformat.write(_notebook(), folder / "analysis.ipynb")
    monkeypatch.delenv("TKBOX_BUNDLE_DIR")  # the kernel's bundles go beside the notebook
    # papermill tells the kernel nothing of the notebook but its folder: its environment names it, as JupyterLab's does
    monkeypatch.setenv("JPY_SESSION_NAME", str(folder / "analysis.ipynb"))
    out = folder / "analysis-out.ipynb"
    # as a scientist schedules it, from elsewhere: `--cwd` starts the kernel in the notebook's folder (without it,
    # papermill starts it where papermill runs); `-p` values are typed as papermill types them (3 is an int)
    ran = subprocess.run([sys.executable, "-m", "papermill", str(folder / "analysis.ipynb"), str(out), "-k", "tkbox",
                          "-p", "column", "b", "-p", "scale", "3", "--cwd", str(folder), "--no-progress-bar"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-3000:]
    done = nbformat.read(out, as_version=4)  # as papermill wrote it
    assert [c["metadata"].get("tags") for c in done["cells"]][:2] == [["parameters"], ["injected-parameters"]]
    text = "".join(o.get("text", "") for c in done["cells"] for o in c.get("outputs", [])
                   if o["output_type"] == "stream")
    assert "cwd /workspace total 90" in text, text  # the injected values were seen in the box; data.csv read there
    result = [o for o in done["cells"][-1]["outputs"] if o["output_type"] == "execute_result"]
    assert result and result[0]["data"]["text/plain"] == "90", done["cells"][-1]
    assert [c["execution_count"] for c in done["cells"]] == [1, 2, 3, 4]
    assert not (folder / "result.txt").exists()  # a box's write reaches the folder only through %box_pull / apply
    found = list((folder / ".tkbox" / "runs").glob("*.tkb"))
    assert len(found) == 1 and found[0].name.startswith("analysis-"), found
    run = open_run(found[0])
    assert run.verify().valid and run.notebook == str(folder / "analysis.ipynb")
    cells = [c for c in run.crossings() if c.door == "exec" and (c.args or {}).get("kind") == "cell"]
    codes = [run.content(c.args["code"]).decode() for c in cells]
    assert len(cells) == 4 and codes[1] == '# Parameters\ncolumn = "b"\nscale = 3\n', codes
