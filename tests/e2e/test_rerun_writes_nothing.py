"""A rerun writes its bundle and nothing else (I57): a stranger's bundle whose policy says `[patch] apply = "auto"`,
or whose replayed host magics say `%box_patch auto`, never writes into the folder the user reruns it from; a
replayed `%box_policy PATH` never reads PATH on this host. Real boxes, a real signer, the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
from tkbox_nb.policy import Policy
from tkbox_nb.audit.replay import rerun
from tkbox_nb.bundle.read_back import open_run

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

AUTO = '[exec]\ncells = true\n[patch]\napply = "auto"\n'
PLANT = ("open('/workspace/conftest.py', 'w').write('import os  # planted\\n')\n"
         "open('/workspace/main.py', 'w').write('print(\"rewritten\")\\n')\n")


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def folder(root: Path) -> Path:
    root.mkdir()
    (root / "main.py").write_text("print('mine')\n")
    (root / "data.txt").write_text("1 2 3\n")
    return root


def stranger_run(out: Path, ws: Path, policy: str, magics: list[tuple[str, str, str | None]] = ()) -> Path:
    """A run a stranger made: PLANT in a cell, then `magics` (host-side), under `policy` from its start."""
    nb = NotebookBox(policy=Policy.from_toml(policy), workspace=ws, bundle_dir=out.parent / f"{out.stem}-b")
    nb.ensure_box().execute(PLANT)
    for name, line, body in magics:
        HostMagics(nb, lambda prompt: "").run(name, line, body)
    nb.stop("done").replace(out)
    return out


def test_a_rerun_of_a_bundle_whose_policy_says_auto_leaves_the_workspace_untouched(signer, tmp_path):
    bundle = stranger_run(tmp_path / "stranger.tkb", folder(tmp_path / "theirs"), AUTO)
    assert (tmp_path / "theirs" / "conftest.py").exists()  # where the stranger ran it, auto did apply
    mine = folder(tmp_path / "mine")
    before = snapshot(mine)
    r = run_cli("rerun", str(bundle), "-o", str(tmp_path / "r.tkb"), "--workspace", str(mine))
    assert r.returncode == 0, r.stderr
    assert snapshot(mine) == before  # byte for byte, no new file
    summary = [c for c in open_run(tmp_path / "r.tkb").crossings() if c.door == "patch" and c.args["kind"] ==
               "summary"]
    assert summary and summary[-1].args["apply"] == "review" and summary[-1].result["applied"] == 0
    # the user applies it, reviewed, when they choose to
    listed = run_cli("apply", str(tmp_path / "r.tkb"), "--list")
    assert listed.returncode == 0 and "conftest.py" in listed.stdout, listed.stderr


def test_a_rerun_of_a_replayed_box_patch_auto_under_the_user_s_review_policy_leaves_the_workspace_untouched(
        signer, tmp_path):
    review = '[exec]\ncells = true\n[patch]\napply = "review"\n'
    bundle = stranger_run(tmp_path / "stranger.tkb", folder(tmp_path / "theirs"), review,
                          [("box_patch", "auto", None)])
    assert (tmp_path / "theirs" / "conftest.py").exists()
    (tmp_path / "mine.toml").write_text(review)
    mine = folder(tmp_path / "mine")
    before = snapshot(mine)
    r = run_cli("rerun", str(bundle), "-o", str(tmp_path / "r.tkb"), "--workspace", str(mine),
                "--policy", str(tmp_path / "mine.toml"))
    assert r.returncode == 0, r.stderr
    assert snapshot(mine) == before
    again = open_run(tmp_path / "r.tkb")
    assert [c.args["line"] for c in again.crossings() if c.door == "host"] == ["auto"]  # made again, held to review
    files = [c for c in again.crossings() if c.door == "patch" and c.args["kind"] == "file"]
    assert {c.args["path"] for c in files} == {"conftest.py", "main.py"}


def test_a_replayed_box_policy_path_never_reads_the_host_file_it_names(signer, tmp_path):
    """The run set its policy from a file; by rerun time the file holds something else (a stranger's bundle names
    any path it likes). The rerun sets the policy the bundle discloses for that event, and reads nothing there."""
    named = tmp_path / "etc" / "policy.toml"
    named.parent.mkdir()
    named.write_text("[exec]\ncells = true\n")
    nb = NotebookBox(bundle_dir=tmp_path / "b")
    HostMagics(nb, lambda prompt: "").run("box_policy", str(named))
    nb.ensure_box().execute("x = 1")
    original = nb.stop("done")
    named.write_text("# what the host holds there now\n[exec]\ncells = true\n")
    planted = Policy.load(named).hash
    done = rerun(original, tmp_path / "r.tkb")
    again = open_run(done.path)
    assert planted not in again._b.policies
    assert set(again._b.policies) == set(open_run(original)._b.policies)
    assert [c.decision for c in again.crossings() if c.door == "exec" and c.args.get("kind") == "cell"] == ["allow"]
