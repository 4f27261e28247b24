"""The notebook a kernel's frontend names (JPY_SESSION_NAME) as the run signs it (rules/notebook_name.py): bounded,
no control or format character (dropped, the reason recorded instead), signed in box.start, checked by verify,
named by `tkbox show` and `Run.notebook`; bundles without it verify as before."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from test_bundle_bad_input import assert_refused, entries, rewrite

from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.policy import Policy
from tkbox_nb.rules.notebook_name import MAX_CHARS, bundle_stem, describe, notebook_facts
from tkbox_nb.signing.recorder import RunRecorder


@pytest.mark.parametrize("raw, facts", [
    (None, {}), ("", {}),
    ("/home/u/my analysis.ipynb", {"notebook": "/home/u/my analysis.ipynb"}),
    ("work/Überblick.ipynb", {"notebook": "work/Überblick.ipynb"}),
    ("a\nb.ipynb", {"notebook_dropped": "JPY_SESSION_NAME holds a control or format character (\\x0a)"}),
    ("\x1b[2Jfake.ipynb", {"notebook_dropped": "JPY_SESSION_NAME holds a control or format character (\\x1b)"}),
    ("cod\u202eexe.ipynb", {"notebook_dropped": "JPY_SESSION_NAME holds a control or format character (\\u202e)"}),
    ("x\udcff.ipynb", {"notebook_dropped": "JPY_SESSION_NAME is not valid UTF-8"}),
    ("a" * (MAX_CHARS + 1), {"notebook_dropped": f"JPY_SESSION_NAME is {MAX_CHARS + 1} characters, over 1024"}),
    ("a" * MAX_CHARS, {"notebook": "a" * MAX_CHARS}),
])
def test_the_frontend_s_name_is_recorded_only_when_plain_and_bounded(raw, facts):
    assert notebook_facts(raw) == facts


@pytest.mark.parametrize("facts, stem", [
    ({}, "box"), ({"notebook_dropped": "why"}, "box"),
    ({"notebook": "/home/u/my analysis.ipynb"}, "my_analysis"),
    ({"notebook": "../../etc/passwd"}, "passwd"),
    ({"notebook": "/x/.hidden.ipynb"}, "hidden"),
    ({"notebook": "/x/...ipynb"}, "box"),
    ({"notebook": "/x/" + "n" * 300 + ".ipynb"}, "n" * 80),
    ({"notebook": "sub/résumé; rm -rf.ipynb"}, "r_sum___rm_-rf"),
])
def test_the_bundle_s_file_name_takes_only_the_notebook_s_stem_in_safe_characters(facts, stem):
    assert bundle_stem(facts) == stem


def _run(signer, out, facts: dict[str, str]):
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none",
                                                 **facts}).open()
    rec.close("test done")
    return rec.write_bundle(out)


def test_the_notebook_is_signed_in_box_start_named_by_show_and_a_manifest_naming_another_is_invalid(signer, tmp_path):
    """Before, a bundle named no notebook; a manifest's notebook that the box.start did not sign must not pass."""
    path = _run(signer, tmp_path / "nb.tkb", notebook_facts("/home/u/my analysis.ipynb"))
    assert verify_bundle(path).valid
    run = open_run(path)
    start = next(c for c in run.crossings() if c.door == "box" and c.args.get("kind") == "start")
    assert run.notebook == start.args["notebook"] == "/home/u/my analysis.ipynb"
    shown = run_cli("show", str(path))
    assert shown.returncode == 0 and "\nnotebook /home/u/my analysis.ipynb\n" in shown.stdout, shown.stdout
    good = _run(signer, tmp_path / "none.tkb", {})
    assert verify_bundle(good).valid and open_run(good).notebook is None
    for source, value, name in ((path, "/home/u/other.ipynb", "other.tkb"), (path, None, "gone.tkb"),
                                (good, "/home/u/claimed.ipynb", "claims.tkb")):
        files = entries(source)
        box = json.loads(files["box/manifest.json"])
        box["notebook"] = value
        if value is None:
            del box["notebook"]
        files["box/manifest.json"] = json.dumps(box).encode()
        assert_refused(rewrite(files, tmp_path / name), 1, "INVALID: box manifest: notebook disagree", tmp_path)


def test_a_name_with_a_control_character_is_not_recorded_and_show_says_why_escaped(signer, tmp_path):
    path = _run(signer, tmp_path / "c.tkb", notebook_facts("\x1b[1A\x1b[2Kforged.ipynb"))
    assert verify_bundle(path).valid
    run = open_run(path)
    assert run.notebook is None and "forged" not in json.dumps(run.box)
    shown = run_cli("show", str(path))
    assert shown.returncode == 0 and "\x1b" not in shown.stdout
    assert "\nnotebook not recorded: JPY_SESSION_NAME holds a control or format character (\\x1b)\n" in shown.stdout
    assert describe(run.box) == "not recorded: JPY_SESSION_NAME holds a control or format character (\\x1b)"
