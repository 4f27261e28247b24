"""Fixtures of the end-to-end tests that boot VMs: the guest image they share, built once and cached across runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tkbox_nb import Box
from tkbox_nb.backends.image import build_image, find_image
from tkbox_nb.backends.qemu import QemuBackend
from tkbox_nb.core.errors import TkboxError

TEST_PACKAGES = ["python3", "python3-ipykernel"]
IMAGE_HOME = Path(os.environ.get("TKBOX_TEST_IMAGE_HOME", "/var/tmp/tkbox-test-images"))


def qemu_box(image, warm: bool = True, **kw) -> Box:
    """A QEMU box on `image` (the test image, not the user's default one): made as a bwrap box, then its backend
    swapped before it starts."""
    box = Box(backend="bwrap", **kw)
    box.backend = QemuBackend(image=image, warm=warm)
    return box


@pytest.fixture(scope="session")
def qemu_image():
    """The test guest image (a smaller package set than the default image): QEMU boots it, and the Firecracker
    backend's tests convert its kernel."""
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
    if not shutil.which("mmdebstrap") and find_image(TEST_PACKAGES, home=IMAGE_HOME) is None:
        pytest.skip("no cached test image and no mmdebstrap to build one (apt-get install mmdebstrap)")
    try:
        image, _ = build_image(TEST_PACKAGES, home=IMAGE_HOME, say=lambda s: None)
    except TkboxError as e:
        pytest.skip(f"the guest image cannot be built here: {e}")
    return image


# -- the browser tests: a Jupyter server on loopback, headless Chromium from Debian driven by Playwright --------------
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
JUPYTER_LAB = Path(sys.executable).parent / "jupyter-lab"
NEEDS_A_BROWSER = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and JUPYTER_LAB.exists()),
                                     reason="needs Debian's chromium and jupyterlab (make test installs both)")
ARTIFACTS = Path(__file__).resolve().parents[2] / "out" / "test-artifacts"


def screenshot(page, name: str) -> None:
    """The page as it is now, whole, kept as out/test-artifacts/NAME.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(root: Path, env: dict[str, str] | None = None):
    """JupyterLab 4 (and, where installed, Notebook 7) serving `root` on loopback: yields (base URL, token)."""
    port, token = free_port(), os.urandom(16).hex()
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [str(JUPYTER_LAB), "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--ServerApp.disable_check_xsrf=True",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, stdout=log, stderr=log, start_new_session=True,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".jupyter"), "JUPYTER_RUNTIME_DIR": str(root / ".runtime"),
             **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("the Jupyter server did not start: " + (root / "server.log").read_text()[-2000:])
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


def box_notebook(path: Path, cells: list[str]) -> None:
    """A notebook at `path` on the shipped `tkbox` kernelspec, holding `cells` (code cells)."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "tkbox", "display_name": "Python 3 (Tracekit Box)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


def notebook_url(base: str, token: str, ui: str, path: str) -> str:
    """The page that opens notebook `path` (relative to the server's root) in JupyterLab ("lab", a workspace of its
    own, reset) or Notebook 7 ("nb7")."""
    return f"{base}/lab/workspaces/{ui}/tree/{path}?reset&token={token}" if ui == "lab" else \
        f"{base}/notebooks/{path}?token={token}"


def open_box_notebook(page, url: str) -> None:
    """Go to a notebook's page and wait until its cells are editable and its Tracekit Box kernel is named."""
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell .jp-InputArea-editor", timeout=90_000)
    page.wait_for_function("document.body.innerText.includes('Tracekit Box')", timeout=90_000)
    time.sleep(1)


def run_cell(page, index: int) -> None:
    """Select cell `index` and run it (Shift+Enter), the same keys in JupyterLab and Notebook 7."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def wait_for_output(page, index: int, text: str, timeout: float = 90_000) -> None:
    """Until cell `index`'s output (not its source, which may hold the same words) shows `text`."""
    page.wait_for_function("([i, t]) => { const o = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
                           ".querySelector('.jp-OutputArea'); return !!o && o.innerText.includes(t); }",
                           arg=[index, text], timeout=timeout)


def output_text(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()
