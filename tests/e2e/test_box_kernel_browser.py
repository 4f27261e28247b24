"""The Tracekit Box kernel in a real browser: JupyterLab 4 and Notebook 7 on loopback, headless Chromium from Debian
driven by Playwright, every cell run in a bubblewrap box.

One notebook, run cell by cell in each frontend: an ipywidgets slider made in the box is moved in the page and its
new value read back by the next cell (comms both ways through the exec door); a cell's `clear_output()` is seen to
clear; `%box_view` shows the live run view (host widgets beside the box's), filtered and verified in the page.
Screenshots under out/test-artifacts/.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.jupyter.run_view import PAGE_SIZE

from .conftest import (NEEDS_A_BROWSER, box_notebook, jupyter_lab, notebook_url, open_box_notebook, output_text,
                       run_cell, screenshot, wait_for_output)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    NEEDS_A_BROWSER,
    pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
]

CELLS = [
    "import ipywidgets as w\nslider = w.IntSlider(value=3, min=0, max=10, description='knob')\nslider",
    "print('slider is', slider.value)",
    "from IPython.display import clear_output\nprint('to be cleared')\nclear_output()\nprint('after the clear')",
    "%box_view",
]


@pytest.fixture(scope="module")
def server(signer, tmp_path_factory):
    """A Jupyter server (JupyterLab 4 and Notebook 7) whose kernels find the shipped `tkbox` kernelspec."""
    root = tmp_path_factory.mktemp("boxlab")
    for ui in ("lab", "nb7"):
        box_notebook(root / f"box-{ui}.ipynb", CELLS)
    with jupyter_lab(root, {"JUPYTER_PATH": str(ROOT), "TKBOX_BUNDLE_DIR": str(root / "bundles")}) as served:
        yield served


def _doors(page) -> list[str]:
    """The door column (the table's third) of each row the run view's table shows."""
    return page.evaluate("[...document.querySelectorAll('.tkbox-table tbody tr')]"
                         ".map(tr => tr.children[2].innerText.trim())")


@pytest.mark.parametrize("ui", ["lab", "nb7"])
def test_a_notebook_in_the_box_with_widgets_clear_output_and_the_run_view(browser, server, ui):
    base, token = server
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    try:
        open_box_notebook(page, notebook_url(base, token, ui, f"box-{ui}.ipynb"))
        _drive(page, ui)
    except BaseException:
        screenshot(page, f"box-kernel-{ui}-failed")
        raise
    finally:
        page.close()


def _drive(page, ui: str) -> None:
    run_cell(page, 0)  # a slider made in the box
    track = page.locator(".jp-Notebook .jp-Cell").nth(0).locator(".noUi-target")
    track.wait_for(timeout=90_000)
    box = track.bounding_box()
    # a click at 70% of the track moves the slider to 7 in the page; the new value goes to the box over its comm
    page.mouse.click(box["x"] + box["width"] * 0.7, box["y"] + box["height"] / 2)
    page.wait_for_function("[...document.querySelectorAll('.widget-readout')].some(e => e.innerText.trim() === '7')",
                           timeout=30_000)
    time.sleep(0.5)
    run_cell(page, 1)
    wait_for_output(page, 1, "slider is")
    assert "slider is 7" in output_text(page, 1)

    run_cell(page, 2)
    wait_for_output(page, 2, "after the")
    cleared = output_text(page, 2)
    assert "after the clear" in cleared and "to be cleared" not in cleared

    run_cell(page, 3)  # the run view: host widgets, in the same page as the box's
    page.wait_for_selector(".tkbox-summary", timeout=90_000)
    page.wait_for_function("document.querySelectorAll('.tkbox-table tbody tr').length >= 3", timeout=30_000)
    before = _doors(page)
    # the whole run is on the first page, and it holds crossings of other doors than exec (the box's start)
    assert len(before) < PAGE_SIZE and "box" in before and before.count("exec") >= 3, before
    page.get_by_label("door", exact=True).select_option("exec")
    # the filter leaves exactly the exec rows: the row count drops to theirs, and no row is of another door
    page.wait_for_function(f"document.querySelectorAll('.tkbox-table tbody tr').length === {before.count('exec')}",
                           timeout=30_000)
    after = _doors(page)
    assert after == ["exec"] * before.count("exec") and len(after) < len(before), (before, after)
    page.get_by_role("button", name="Verify").click()
    page.wait_for_selector(".tkbox-verdict", timeout=120_000)
    verdict = page.locator(".tkbox-verdict").inner_text()
    assert "VALID" in verdict and "INVALID" not in verdict, verdict
    screenshot(page, f"box-kernel-{ui}")
