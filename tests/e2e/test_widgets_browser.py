"""The run view in a real browser: JupyterLab on loopback, headless Chromium from Debian driven by Playwright.

A notebook shows a run, filters it to denied egress, clicks Verify and sees the valid verdict; the same on a tampered
copy shows the failing row. Screenshots of both are kept under out/test-artifacts/.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from conftest import record_run, tamper_content

from .conftest import NEEDS_A_BROWSER, jupyter_lab, screenshot

pytestmark = NEEDS_A_BROWSER


@pytest.fixture(scope="module")
def lab(signer, tmp_path_factory):
    """JupyterLab on loopback over a folder holding two notebooks: a run, and a tampered copy of it."""
    root = tmp_path_factory.mktemp("lab")
    bundle = record_run(signer, root / "run.tkb", cells=("x = 1\n",), commands=(["echo", "hi"],),
                        egress=(("metadata.internal", "169.254.169.254"), ("example.org", "198.18.0.9")))
    tamper_content(bundle, root / "tampered.tkb")
    for name in ("run", "tampered"):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(f"import tkbox_nb\ntkbox_nb.view({name + '.tkb'!r}, "
                                              f"trust={str(signer.trust_path)!r})")]
        nbformat.write(nb, root / f"{name}.ipynb")
    with jupyter_lab(root) as server:
        yield server


def _open_and_filter(browser, lab, notebook: str):
    base, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # a workspace of its own, reset: only this notebook open (JupyterLab would restore the last one's tabs)
    page.goto(f"{base}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?reset&token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell .jp-InputArea-editor", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                           ".jp-Toolbar-kernelStatus", timeout=90_000)
    time.sleep(1)
    page.locator(".jp-Notebook:visible .jp-Cell .jp-InputArea-editor").first.click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_selector(".tkbox-summary", timeout=90_000)
    page.get_by_label("door", exact=True).select_option("egress")
    page.get_by_label("decision", exact=True).select_option("deny")
    page.wait_for_function("document.querySelectorAll('.tkbox-table tbody tr').length === 2", timeout=30_000)
    return page


def test_view_filters_denied_egress_and_verifies_valid(browser, lab):
    page = _open_and_filter(browser, lab, "run.ipynb")
    assert "169.254.169.254" in page.locator(".tkbox-table").inner_text()
    page.get_by_role("button", name="Verify").click()
    page.wait_for_selector(".tkbox-verdict", timeout=120_000)
    verdict = page.locator(".tkbox-verdict").inner_text()
    assert verdict.startswith("VALID"), verdict
    assert "✔ valid" in page.locator(".tkbox-table").inner_text()
    screenshot(page, "view-valid")
    page.close()


def test_view_of_a_tampered_copy_shows_the_failing_row(browser, lab):
    page = _open_and_filter(browser, lab, "tampered.ipynb")
    page.get_by_label("door", exact=True).select_option("all")
    page.get_by_label("decision", exact=True).select_option("all")
    page.get_by_role("button", name="Verify").click()
    page.wait_for_selector(".tkbox-verdict", timeout=120_000)
    verdict = page.locator(".tkbox-verdict").inner_text()
    assert verdict.startswith("INVALID") and "content" in verdict, verdict
    failing = page.locator(".tkbox-verified", has_text="✘")
    assert failing.count() >= 1 and "content" in failing.first.inner_text()
    screenshot(page, "view-tampered")
    page.close()
