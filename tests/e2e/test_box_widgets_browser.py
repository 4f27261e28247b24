"""Widgets from the box in a real browser: JupyterLab 4 and Notebook 7 on loopback, headless Chromium from Debian
driven by Playwright, every cell run in a bubblewrap box (docs/threat-model.md, I56).

A box cell tries each way widget state could carry script or a remote fetch into the page past the host's checks:
a `Text` subclass with an extra synced key holding an HTML output, `jsdlink`ed into an `Output`'s `outputs`; a
`Text` whose value is `jslink`ed into an `HTML` widget's `value`; an HTML widget whose style's `background` is a
remote `url(...)`. Each payload's `onerror` would set `window.tkboxPwned` and the page's title, and each names a URL
in 198.18.0.0/15 (the test range): the page must run none of them and ask for no URL off loopback (every request
the page makes is recorded, and any off loopback is recorded and aborted). Ordinary widgets go on working: an
`Output` used as `with out:` in a box cell shows what the cell printed in it, a slider is shown, and `interact`'s
slider, moved in the page, shows what its function printed for the new value. The notebook is
then saved and reloaded, so the page loads every widget again from the box's `update_states`: the same holds.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tkbox_nb.backends.bwrap import BwrapBackend

from .conftest import NEEDS_A_BROWSER, box_notebook, jupyter_lab, run_cell, screenshot, wait_for_output

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    NEEDS_A_BROWSER,
    pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
]

ATTACKS = """\
import ipywidgets as w, traitlets
from IPython.display import display
RUN = '<img src="x-probe-%s" onerror="window.tkboxPwned=1;document.title=\\'PWNED %s\\'">'
FETCH = '<img src="http://198.18.0.9/tkbox-probe-%s">'
class T(w.Text):
    x = traitlets.List().tag(sync=True)
t = T(x=[{'output_type': 'display_data', 'metadata': {},
          'data': {'text/html': RUN % ('link', 'link') + FETCH % 'link'}}])
o = w.Output()
w.jsdlink((t, 'x'), (o, 'outputs'))
t2 = w.Text(value=RUN % ('html', 'html') + FETCH % 'html')
h = w.HTML(value='<b>plain html</b>')
w.jslink((t2, 'value'), (h, 'value'))
s = w.HTML(value='styled html', style={'background': 'url(http://198.18.0.9/tkbox-probe-css)'})
display(t, o, t2, h, s)
print('attacks shown')
"""
ORDINARY = """\
out = w.Output()
display(out, w.IntSlider(value=4, description='knob'))
with out:
    print('printed inside the output widget')
w.interact(lambda n: print('n is', n), n=(0, 10))
print('ordinary shown')
"""


@pytest.fixture(scope="module")
def server(signer, tmp_path_factory):
    """A Jupyter server (JupyterLab 4 and Notebook 7) whose kernels find the shipped `tkbox` kernelspec."""
    root = tmp_path_factory.mktemp("boxwidgets")
    for ui in ("lab", "nb7"):
        box_notebook(root / f"widgets-{ui}.ipynb", [ATTACKS, ORDINARY])
    with jupyter_lab(root, {"JUPYTER_PATH": str(ROOT), "TKBOX_BUNDLE_DIR": str(root / "bundles")}) as served:
        yield served


@pytest.mark.parametrize("ui", ["lab", "nb7"])
def test_no_widget_of_the_box_s_runs_script_or_fetches_a_remote_url_in_the_page(browser, server, ui):
    base, token = server
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    requested: list[str] = []
    off_loopback: list[str] = []
    page.on("request", lambda r: requested.append(r.url))

    def refuse(route):  # never leaves the machine: recorded, then aborted
        off_loopback.append(route.request.url)
        route.abort()
    page.route(re.compile(r"^(?!(?:https?|wss?)://127\.0\.0\.1[:/]|data:|blob:|about:)"), refuse)
    path = f"widgets-{ui}.ipynb"
    page.goto(f"{base}/lab/workspaces/w{ui}/tree/{path}?reset&token={token}" if ui == "lab" else
              f"{base}/notebooks/{path}?token={token}")
    try:
        page.wait_for_selector(".jp-Notebook .jp-Cell .jp-InputArea-editor", timeout=90_000)
        page.wait_for_function("document.body.innerText.includes('Tracekit Box')", timeout=90_000)
        time.sleep(1)
        run_cell(page, 0)
        wait_for_output(page, 0, "attacks shown")
        page.wait_for_function("document.body.innerText.includes('styled html')", timeout=60_000)
        run_cell(page, 1)
        wait_for_output(page, 1, "ordinary shown")
        page.wait_for_selector(".noUi-target", timeout=60_000)
        wait_for_output(page, 1, "n is 5")
        # interact's slider moved in the page: the box runs the function for the new value `with out:`, its msg_id
        # the frontend's comm_msg (a request the box was sent), and the frontend shows what it printed
        track = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".noUi-target").nth(1)
        box = track.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 0.8, box["y"] + box["height"] / 2)
        wait_for_output(page, 1, "n is 8")
        # the Output widget captured what the box cell printed in it (its msg_id, the cell's own request)
        page.wait_for_function("[...document.querySelectorAll('.jupyter-widgets .jp-OutputArea')]"
                               ".some(e => e.innerText.includes('printed inside the output widget'))", timeout=60_000)
        time.sleep(3)  # time for a link to copy, an image to fail and its handler to run
        _nothing_ran_nor_left(page, ui, "", requested, off_loopback)
        # saved and reloaded, the page loads every widget from the box's update_states (links among them, if the
        # host let them through): the same holds
        page.keyboard.press("Control+s")
        time.sleep(2)
        page.reload()
        page.wait_for_function("[...document.querySelectorAll('.widget-html-content')]"
                               ".some(e => e.innerText.includes('styled html'))", timeout=90_000)
        time.sleep(3)
        _nothing_ran_nor_left(page, ui, "-reloaded", requested, off_loopback)
    finally:
        page.close()


def _nothing_ran_nor_left(page, ui: str, when: str, requested: list[str], off_loopback: list[str]) -> None:
    screenshot(page, f"box-widgets-{ui}{when}")
    assert page.evaluate("window.tkboxPwned") is None
    assert "PWNED" not in page.title()
    assert "plain html" in page.locator(".widget-html-content").first.inner_text()  # the link never copied
    assert off_loopback == [] and not [u for u in requested if "tkbox-probe" in u], (off_loopback, requested)
