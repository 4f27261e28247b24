"""The run view in a real browser: JupyterLab on loopback, headless Chromium from Debian driven by Playwright.

A notebook shows a run, filters it to denied egress, clicks Verify and sees the valid verdict; the same on a tampered
copy shows the failing row. Screenshots of both are kept under out/test-artifacts/.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import record_run, tamper_content

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "out" / "test-artifacts"

pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and shutil.which("jupyter-lab", path=str(
    Path(sys.executable).parent))), reason="needs Debian's chromium and jupyterlab (make test installs both)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port, token = _free_port(), os.urandom(16).hex()
    log = open(root / "lab.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--ServerApp.disable_check_xsrf=True", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, stdout=log, stderr=log, env={**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".jupyter"),
                                                "JUPYTER_RUNTIME_DIR": str(root / ".runtime")},
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("JupyterLab did not start: " + (root / "lab.log").read_text()[-2000:])
    yield base, token
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
    log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


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
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "view-valid.png"), full_page=True)
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
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "view-tampered.png"), full_page=True)
    page.close()
