"""What the audit compares of a cell's outputs, with real bwrap runs: the same output cut into other stream chunks is
the same, and a different HTML or PNG (behind the same text/plain and MIME keys) is found, the PNG by digest.

The knob, as in test_audit_battery.py: a command writes the values of the environment variables it sets into /tmp;
the bundle records their names only, so every crossing's arguments stay equal while what the cells read changes."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
from conftest import run_cli

from tkbox_nb import Box, open_run
from tkbox_nb.audit.compare import audit
from tkbox_nb.backends.bwrap import BwrapBackend

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

POLICY = "[exec]\ncells = true\n"
KNOB = 'for n in FLUSH HTML PNG; do eval "printf %s \\"\\$$n\\"" > /tmp/$n; done'
CELLS = [
    # each line its own stream message when /tmp/FLUSH says so (a flush and a pause), else all in one
    "import sys, time\nflush = open('/tmp/FLUSH').read() == '1'\nfor i in range(4):\n"
    "    print('line', i, flush=flush)\n    if flush:\n        time.sleep(0.3)\n"
    "sys.stderr.write('warned\\n')",
    "from IPython.display import HTML, display\ndisplay(HTML(open('/tmp/HTML').read()))",
    "from IPython.display import Image, display\n"
    "display(Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + open('/tmp/PNG', 'rb').read(), format='png'))",
]
PNG_HEAD = b"\x89PNG\r\n\x1a\n"
BASE = {"FLUSH": "0", "HTML": "<b>one</b>", "PNG": "pixels-a"}


def record(out: Path, env: dict) -> Path:
    with Box(policy=POLICY, backend="bwrap", bundle_path=out) as box:
        assert box.run(["sh", "-c", KNOB], env=env).exit_code == 0
        for cell in CELLS:
            box.execute(cell)
    return out


@pytest.fixture(scope="module")
def runs(signer, tmp_path_factory):
    d = tmp_path_factory.mktemp("outputs")
    return {name: record(d / f"{name}.tkb", {**BASE, **change}) for name, change in (
        ("original", {}), ("chunks", {"FLUSH": "1"}), ("html", {"HTML": "<b>two</b>"}), ("png", {"PNG": "pixels-b"}))}


def recorded_outputs(path: Path, index: int) -> list[dict]:
    run = open_run(path)
    cells = [c for c in run.crossings() if c.door == "exec" and c.args.get("kind") == "cell"]
    return json.loads(run.content(cells[index].result["outputs"]))


def test_the_same_output_in_other_stream_chunks_is_equivalent(runs):
    chunks = [[o.get("name") for o in recorded_outputs(runs[r], 0) if o["output_type"] == "stream"]
              for r in ("original", "chunks")]
    assert chunks[0].count("stdout") == 1 and chunks[1].count("stdout") == 4, chunks  # the pair means something
    r = run_cli("audit", str(runs["original"]), str(runs["chunks"]))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT"), r.stdout
    assert "exec cells 3/3, exec commands 1/1" in r.stdout


@pytest.mark.parametrize("name,mime", [("html", "text/html"), ("png", "image/png")])
def test_a_different_html_or_png_behind_the_same_text_is_different(runs, name, mime):
    [a], [b] = (recorded_outputs(runs[r], 1 if name == "html" else 2) for r in ("original", name))
    assert a["data"]["text/plain"] == b["data"]["text/plain"] and sorted(a["data"]) == sorted(b["data"])
    assert a["data"][mime] != b["data"][mime]
    report = audit(runs["original"], runs[name])
    assert [d.what for d in report.differences] == [f"cell outputs #{3 if name == 'html' else 4}"], \
        [(d.what, d.a, d.b) for d in report.differences]
    [d] = report.differences
    if name == "html":  # text: shown, with a short diff
        assert "<b>one</b>" in d.a and "<b>two</b>" in d.b
        assert "-" in d.diff and "<b>one</b>" in d.diff and "<b>two</b>" in d.diff
    else:  # binary data: by the digest of its bytes, never its base64
        digests = ["sha256:" + hashlib.sha256(PNG_HEAD + p).hexdigest() for p in (b"pixels-a", b"pixels-b")]
        assert digests[0] in d.a and digests[1] in d.b and digests[0] in d.diff
        assert base64.b64encode(PNG_HEAD + b"pixels-a").decode() not in d.a


def test_a_binary_value_is_decoded_strictly_so_bytes_outside_base64_are_not_dropped_from_the_comparison():
    """Found by a review: a lenient base64 decode skips characters outside the alphabet, so a value with extra
    ones compared equal to the value without them. Line breaks (how nbformat may wrap base64) are not a difference."""
    from tkbox_nb.audit.door_items import _mime_value
    png = "iVBORw0KGgoAAAANSUhEUg=="
    assert _mime_value("image/png", png, []) == _mime_value("image/png", "iVBORw0KGgoAAAA\nNSUhEUg==\n", [])
    for other in ("iVBORw0KGgo<AAAANSUhEUg==>", "iVBORw0KGgo AAAANSUhEUg==!", {png: None}):
        assert _mime_value("image/png", other, []) != _mime_value("image/png", png, [])
