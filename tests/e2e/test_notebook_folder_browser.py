"""The notebook's folder is the box's workspace, seen from a real browser: JupyterLab 4 and Notebook 7 on loopback,
Debian's headless Chromium driven by Playwright, the shipped `tkbox` kernelspec (docs/jupyter.md, "The notebook's
folder is the box's workspace", "A box that cannot start never takes the kernel down").

A scientist's first notebook, in each frontend: a folder holds the notebook and `data.csv`; a box cell reads the CSV
with pandas, another writes a result in the box, `%box_pull` brings it back, and the file is in the frontend's file
browser and on the host's disk. Then a server whose kernels' policy asks for `isolation = "vm"` where no guest image
is built: the page shows a live kernel (never "No Kernel", never a restart), the first cell says in one line why no
box runs and what to do, and the kernel is idle afterwards. Screenshots under out/test-artifacts/.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tkbox_nb.backends.bwrap import BwrapBackend

from .conftest import (NEEDS_A_BROWSER, box_notebook, jupyter_lab, notebook_url, open_box_notebook, output_text,
                       run_cell, screenshot, wait_for_output)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    NEEDS_A_BROWSER,
    pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
]

DATA = "sample,value\na,100\nb,200\nc,934\n"  # the values sum to 1234


def _cells(ui: str) -> list[str]:
    return [
        "import pandas as pd\ndf = pd.read_csv('data.csv')\nprint('total is', df.value.sum())",
        f"pd.DataFrame({{'total': [df.value.sum()]}}).to_csv('result-{ui}.csv', index=False)\nprint('written')",
        f"%box_pull result-{ui}.csv",
        "%box_status",
    ]


@pytest.fixture(scope="module")
def server(signer, tmp_path_factory):
    """A Jupyter server (JupyterLab 4 and Notebook 7) serving a root whose `project/` folder holds the notebooks and
    `data.csv` (the server's own files, its log and runtime folder, stay outside the notebooks' folder)."""
    root = tmp_path_factory.mktemp("nbfolder")
    project = root / "project"
    project.mkdir()
    (project / "data.csv").write_text(DATA)
    for ui in ("lab", "nb7"):
        box_notebook(project / f"analysis-{ui}.ipynb", _cells(ui))
    with jupyter_lab(root, {"JUPYTER_PATH": str(ROOT)}) as (base, token):
        yield base, token, root


@pytest.mark.parametrize("ui", ["lab", "nb7"])
def test_a_box_cell_reads_the_csv_beside_the_notebook_and_box_pull_brings_its_result_to_the_file_browser(
        browser, server, ui):
    base, token, root = server
    project = root / "project"
    result = f"result-{ui}.csv"
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    try:
        open_box_notebook(page, notebook_url(base, token, ui, f"project/analysis-{ui}.ipynb"))
        run_cell(page, 0)  # pandas in the box reads the data.csv of the notebook's folder
        wait_for_output(page, 0, "total is", timeout=120_000)
        assert "total is 1234" in output_text(page, 0)
        run_cell(page, 1)
        wait_for_output(page, 1, "written")
        assert not (project / result).exists()  # written in the box only, until pulled
        run_cell(page, 2)
        wait_for_output(page, 2, f"{result}: pulled")
        assert f"{result}: pulled (" in output_text(page, 2) and "signed" in output_text(page, 2)
        assert (project / result).read_text() == "total\n1234\n"
        # the frontend's own housekeeping (comm_info, closes of comms the box never had) is no deny, and the box
        # names the folder it started from and the notebook the frontend named (JPY_SESSION_NAME)
        run_cell(page, 3)
        wait_for_output(page, 3, "notebook")
        status = output_text(page, 3)
        assert f"folder   {project}" in status and f"analysis-{ui}.ipynb" in status, status
        assert "deny" not in status and f"/.tkbox/runs/analysis-{ui}-" in status, status
        if ui == "lab":  # JupyterLab's file browser, opened on the notebook's folder, lists the pulled file
            listing = page
        else:  # Notebook 7's tree page of the folder
            listing = browser.new_page(viewport={"width": 1400, "height": 900})
            listing.goto(f"{base}/tree/project?token={token}")
        listing.wait_for_function("t => [...document.querySelectorAll('.jp-DirListing-item')]"
                                  ".some(e => e.innerText.includes(t))", arg=result, timeout=90_000)
        screenshot(listing, f"notebook-folder-{ui}-listing")
        if listing is not page:
            listing.close()
        screenshot(page, f"notebook-folder-{ui}")
    except BaseException:
        screenshot(page, f"notebook-folder-{ui}-failed")
        raise
    finally:
        page.close()


@pytest.fixture(scope="module")
def vm_server(signer, tmp_path_factory):
    """A Jupyter server whose kernels get a policy asking for `isolation = "vm"`, with no guest image built."""
    root = tmp_path_factory.mktemp("vmpolicy")
    (root / "vm.toml").write_text('[box]\nisolation = "vm"\n')
    project = root / "project"
    project.mkdir()
    for ui in ("lab", "nb7"):
        box_notebook(project / f"vm-{ui}.ipynb", ["print('never' + ' printed')", "print('after', 1 + 1)"])
    with jupyter_lab(root, {"JUPYTER_PATH": str(ROOT), "TKBOX_POLICY": str(root / "vm.toml")}) as (base, token):
        yield base, token, root


def _kernels(base: str, token: str) -> dict[str, str]:
    """Each kernel of the server: its id -> its execution state, as the server's REST API says."""
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=30) as r:
        return {k["id"]: k["execution_state"] for k in json.load(r)}


@pytest.mark.parametrize("ui", ["lab", "nb7"])
def test_a_box_that_cannot_start_shows_why_on_the_first_cell_and_the_kernel_stays_alive(browser, vm_server, ui):
    """Before, such a policy killed the kernel before kernel_info: JupyterLab restarted it five times and showed
    "No Kernel", the cells stuck at [*]."""
    base, token, root = vm_server
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    try:
        open_box_notebook(page, notebook_url(base, token, ui, f"project/vm-{ui}.ipynb"))
        kernels = _kernels(base, token)
        assert kernels, "the page started no kernel"
        run_cell(page, 0)
        wait_for_output(page, 0, "tkbox image build", timeout=120_000)
        said = output_text(page, 0)
        lines = [x for x in said.splitlines() if x.strip()]
        assert len(lines) == 1 and 'isolation = "namespace"' in lines[0], said
        assert "never printed" not in said and "Traceback" not in said
        run_cell(page, 1)  # the kernel answers the next cell the same way: alive, not restarted
        wait_for_output(page, 1, "tkbox image build", timeout=120_000)
        for _ in range(60):  # idle again, the same kernels (none restarted, none died)
            now = _kernels(base, token)
            if set(now) == set(kernels) and all(s == "idle" for s in now.values()):
                break
            page.wait_for_timeout(1000)
        assert set(now) == set(kernels) and all(s == "idle" for s in now.values()), (kernels, now)
        assert "No Kernel" not in page.inner_text("body")
        log = (root / "server.log").read_text(errors="replace")
        assert "restarting kernel" not in log.lower() and "KernelRestarter" not in log, log[-3000:]
        screenshot(page, f"box-cannot-start-{ui}")
    except BaseException:
        screenshot(page, f"box-cannot-start-{ui}-failed")
        raise
    finally:
        page.close()
