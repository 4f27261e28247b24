"""The notebook's folder is the box's workspace (docs/jupyter.md, "The notebook's folder"), and the kernel never dies
for a box: real kernels through jupyter_client, started in a folder as every frontend starts them."""

from __future__ import annotations

import pytest
from conftest import run_cli

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.core.tree_digest import tree_digest

from . import test_kernel
from .test_kernel import Client, machine_policy, only_bundle, refused_until_a_policy_cell

kernel_env = test_kernel.kernel_env

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])


def test_a_box_cell_reads_a_file_of_the_notebook_s_folder_and_the_run_states_its_digest(kernel_env, tmp_path):
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "data.csv").write_text("a,b\n1,2\n3,4\n")
    c = Client(folder)
    try:
        reply, outs = c.run("import pandas as pd\nprint(pd.read_csv('data.csv').b.sum())")
        assert reply["status"] == "ok", reply
        assert ("stream", {"name": "stdout", "text": "6\n"}) in outs
    finally:
        c.stop()
    run = open_run(only_bundle(kernel_env))
    assert run.box["workspace_digest"] == tree_digest(folder, exclude=[".tkbox", "*.tkb"])


def test_the_workspace_leaves_out_what_a_user_expects_and_the_digest_leaves_it_out_too(kernel_env, tmp_path):
    folder = tmp_path / "nb"
    for rel in (".git/config", ".venv/bin/python", "node_modules/x/index.js", "sub/__pycache__/m.pyc",
                ".ipynb_checkpoints/a-checkpoint.ipynb", "old.tkb", "sub/keep.py", "keep.txt"):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text("x")
    c = Client(folder)
    try:
        reply, outs = c.run("import os\nprint(sorted(os.path.relpath(os.path.join(d, f)) for d, _, fs in "
                            "os.walk('.') for f in fs))")
        assert reply["status"] == "ok", reply
        assert ("stream", {"name": "stdout", "text": "['keep.txt', 'sub/keep.py']\n"}) in outs
    finally:
        c.stop()
    kept = tmp_path / "kept"
    (kept / "sub").mkdir(parents=True)
    (kept / "keep.txt").write_text("x")
    (kept / "sub" / "keep.py").write_text("x")
    assert open_run(only_bundle(kernel_env)).box["workspace_digest"] == tree_digest(kept)


def test_an_oversize_folder_refuses_the_box_in_one_line_naming_its_largest_entry_and_the_setting(kernel_env, tmp_path,
                                                                                                monkeypatch):
    folder = tmp_path / "nb"
    (folder / "big").mkdir(parents=True)
    (folder / "big" / "blob.bin").write_bytes(b"\0" * (3 << 20))
    (folder / "small.txt").write_text("x")
    machine_policy(tmp_path, monkeypatch, "[workspace]\nmax_mib = 2\n", "p.toml")
    c = Client(folder)
    try:
        # TKBOX_WORKSPACE is not read by a running kernel; a policy naming an empty workspace starts the next box
        line = refused_until_a_policy_cell(c, '%%box_policy\n[workspace]\npath = "none"\n',
                                           "import os; print(os.listdir('.'))", "[]\n")
        assert "\n" not in line and "'big' 3 MiB" in line and "max_mib = 2" in line and "[mounts.NAME]" in line
    finally:
        c.stop()


def test_a_vm_policy_without_an_image_answers_kernel_info_and_fails_the_first_cell_in_one_line(kernel_env, tmp_path,
                                                                                             monkeypatch):
    """Before, the box's backend was chosen before the kernel served anything: no backend for `isolation = "vm"`
    raised there, the kernel died before kernel_info, and JupyterLab restarted it five times."""
    machine_policy(tmp_path, monkeypatch, '[box]\nisolation = "vm"\n', "vm.toml")
    c = Client()  # wait_for_ready: kernel_info answered
    try:
        assert c.km.is_alive()
        line = refused_until_a_policy_cell(c, '%%box_policy\n[box]\nisolation = "namespace"\n')
        assert "\n" not in line and "isolation >= 'vm'" in line
        assert "tkbox image build" in line and 'isolation = "namespace"' in line
    finally:
        c.stop()


def _tree(root) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


def test_box_pull_brings_a_written_file_into_the_folder_now_and_refuses_bad_names_links_and_host_edits(kernel_env,
                                                                                                     tmp_path):
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "a.txt").write_text("v1\n")
    (tmp_path / "outside.txt").write_text("untouched\n")
    c = Client(folder)
    try:
        reply, _ = c.run("import os\nos.makedirs('res', exist_ok=True)\nopen('res/out.txt', 'w').write('42\\n')\n"
                         "open('a.txt', 'w').write('box\\n')\nos.symlink('/etc/passwd', 'link')\n"
                         "os.symlink('../../outside.txt', 'up')")
        assert reply["status"] == "ok", reply
        reply, outs = c.run("%box_pull res/out.txt")
        assert reply["status"] == "ok", reply
        assert ("stream", {"name": "stdout", "text": "res/out.txt: pulled (3 bytes), signed\n"}) in outs
        assert (folder / "res" / "out.txt").read_text() == "42\n"

        before = _tree(tmp_path)
        reply, outs = c.run("%box_pull ../../etc/passwd")
        assert reply["status"] == "error" and "\n" not in reply["evalue"], reply
        assert "'../../etc/passwd': a '..' component in the path" in reply["evalue"]
        assert "nothing moved" in reply["evalue"]
        reply, outs = c.run("%box_pull link up")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert "link: refused by patch.type: a symlink is never applied (only regular files)" in text, text
        assert "up: refused by patch.type" in text and "only regular files come back" in text
        assert _tree(tmp_path) == before  # neither the bad name nor the links wrote anything, in the folder or out
        (folder / "a.txt").write_text("user\n")  # the user edits the file on the host meanwhile
        before = _tree(tmp_path)
        reply, outs = c.run("%box_pull a.txt")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert text == "a.txt: not written: the host file changed since the box started\n", text
        assert _tree(tmp_path) == before  # nothing half-written, nothing outside the folder touched
        assert (folder / "a.txt").read_text() == "user\n" and not (folder / "link").exists()
    finally:
        c.stop()


def pull(c: Client, paths: str) -> str:
    """`%box_pull PATHS` in the kernel of `c`, which must answer ok: what the cell said of each file."""
    reply, outs = c.run(f"%box_pull {paths}")
    assert reply["status"] == "ok", reply
    return "".join(x.get("text", "") for t, x in outs if t == "stream")


def test_a_file_pulled_again_replaces_what_was_pulled_but_never_what_the_user_edited_since(kernel_env, tmp_path):
    """Before, a file was written only over what the box started from: a second `%box_pull` of a result the box
    recomputed was refused ("the host file changed since the box started"), the change being the first pull's. Now
    the host file may be what the box started from or what this box last wrote there; an edit of the user's since
    is never overwritten. The folder holds symlinks that loop and point out: the box starts all the same (they are
    copied as links, never followed)."""
    import os
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "seeded.txt").write_text("start\n")
    os.symlink("loop", folder / "loop")
    os.symlink("..", folder / "up")
    c = Client(folder)

    try:
        reply, outs = c.run("import os\nprint(os.readlink('loop'), os.readlink('up'))\n"
                            "open('r.txt', 'w').write('v1\\n'); open('seeded.txt', 'w').write('box 1\\n')")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "loop ..\n"}) in outs, (reply, outs)
        assert pull(c, "r.txt seeded.txt") == "r.txt: pulled (3 bytes), signed\nseeded.txt: pulled (6 bytes), signed\n"
        c.run("open('r.txt', 'w').write('v2!\\n'); open('seeded.txt', 'w').write('box 2!\\n')")
        assert pull(c, "r.txt seeded.txt") == "r.txt: pulled (4 bytes), signed\nseeded.txt: pulled (7 bytes), signed\n"
        assert (folder / "r.txt").read_text() == "v2!\n" and (folder / "seeded.txt").read_text() == "box 2!\n"
        (folder / "r.txt").write_text("user\n")  # the user edits the pulled files on the host meanwhile
        (folder / "seeded.txt").write_text("user too\n")
        c.run("open('r.txt', 'w').write('v3\\n'); open('seeded.txt', 'w').write('box 3\\n')")
        before = _tree(tmp_path)
        said = pull(c, "r.txt seeded.txt")
        assert said == ("r.txt: not written: the host file changed since this box last wrote it\n"
                        "seeded.txt: not written: the host file changed since this box last wrote it\n"), said
        assert _tree(tmp_path) == before  # nothing half-written, nothing outside the folder touched
    finally:
        c.stop()
    # each pull's signed file result names what its write went over: the seed's digest (or none) the first time,
    # the previous pull's the next (before, the record named only the seed's `base`, so a second pull's looked
    # like a write over the starting file)
    from tkbox_nb.doors.workspace_writer import sha256_file_digest as d
    run = open_run(only_bundle(kernel_env))
    files = [x for x in run.crossings() if x.door == "patch" and (x.args or {}).get("kind") == "file"]
    over = {p: [(x.args["base"], x.result.get("applied_over"), x.result.get("applied_over_kind"))
                for x in files if x.args["path"] == p] for p in ("r.txt", "seeded.txt")}
    assert over == {"r.txt": [(None, None, "start"), (None, d(b"v1\n"), "last_write"),
                              (None, d(b"v2!\n"), "last_write")],
                    "seeded.txt": [(d(b"start\n"), d(b"start\n"), "start"),
                                   (d(b"start\n"), d(b"box 1\n"), "last_write"),
                                   (d(b"start\n"), d(b"box 2!\n"), "last_write")]}, over
    r = run_cli("verify", str(only_bundle(kernel_env)))
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_rename_whose_source_this_box_last_wrote_is_refused_in_the_words_of_that_rule(kernel_env, tmp_path):
    """A rename's source is checked against what this box last wrote there when it wrote it (a pull), as its target
    is; the refusal said "since the box started" all the same. Its signed result names the source's digest so."""
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "s.txt").write_text("start\n")
    c = Client(folder)

    try:
        c.run("open('s.txt', 'w').write('box 1\\n')")
        assert pull(c, "s.txt") == "s.txt: pulled (6 bytes), signed\n"
        # the starting content again, under a new name: the box's change is now a rename of s.txt to t.txt
        c.run("import os; open('s.txt', 'w').write('start\\n'); os.rename('s.txt', 't.txt')")
        (folder / "s.txt").write_text("user\n")  # the user edits the pulled file on the host meanwhile
        said = pull(c, "t.txt")
        assert said == "t.txt: not written: the rename source 's.txt' changed on the host since this box last " \
                       "wrote it\n", said
        assert (folder / "s.txt").read_text() == "user\n" and not (folder / "t.txt").exists()
    finally:
        c.stop()
    from tkbox_nb.doors.workspace_writer import sha256_file_digest as d
    [renamed] = [x for x in open_run(only_bundle(kernel_env)).crossings()
                 if x.door == "patch" and (x.args or {}).get("op") == "rename"]
    assert (renamed.args["from_base"], renamed.result["from_applied_over"]) == (d(b"start\n"), d(b"box 1\n"))


def test_box_push_copies_a_host_file_in_signed_and_refuses_a_fifo_in_one_line(kernel_env, tmp_path):
    """A FIFO and a 10 GB file are each refused in one line, before anything is sent (nothing pushed)."""
    import os
    folder = tmp_path / "nb"
    folder.mkdir()
    c = Client(folder)
    try:
        reply, _ = c.run("print(1)")
        (folder / "new.csv").write_text("x\n1\n")
        os.mkfifo(folder / "pipe")  # after the box started: a FIFO in the folder would stop its start, in one line
        reply, outs = c.run("%box_push pipe new.csv")
        assert reply["status"] == "error", reply
        assert reply["evalue"] == "%box_push: 'pipe' is not a regular file (only files are pushed); nothing pushed"
        with open(folder / "huge.bin", "wb") as f:  # 10 GB, sparse: refused by its size, never read
            f.truncate(10 << 30)
        reply, outs = c.run("%box_push new.csv huge.bin")
        assert reply["status"] == "error", reply
        assert reply["evalue"] == ("%box_push: 'huge.bin' is 10737418240 bytes, over [workspace] max_mib; nothing "
                                   "pushed (give data as a dataset mount, [mounts.NAME])")
        reply, outs = c.run("import os; print(os.path.exists('new.csv'), os.path.exists('huge.bin'))")
        assert ("stream", {"name": "stdout", "text": "False False\n"}) in outs, outs
        reply, outs = c.run("%box_push new.csv")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout",
                                                       "text": "new.csv: pushed (4 bytes), signed\n"}) in outs
        reply, outs = c.run("print(open('new.csv').read().split())")
        assert ("stream", {"name": "stdout", "text": "['x', '1']\n"}) in outs
    finally:
        c.stop()
    run = open_run(only_bundle(kernel_env))
    pushed = [x for x in run.crossings() if x.door == "exec" and (x.args or {}).get("argv", [None])[0] == "python3"]
    assert len(pushed) == 1 and pushed[0].decision == "allow" and pushed[0].args["argv"][3] == "new.csv"


def test_box_patch_lists_each_file_s_decision_and_box_patch_apply_writes_the_allowed_ones(kernel_env, tmp_path):
    """Before, a file listed by `%box_patch` (review) was not decided again, so no later patch could apply it."""
    folder = tmp_path / "nb"
    folder.mkdir()
    c = Client(folder)
    try:
        c.run("open('r.txt', 'w').write('r\\n'); open('.env', 'w').write('K=1\\n')")
        reply, outs = c.run("%box_patch")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert [t for t, _ in outs] == ["stream"], outs  # each file said once, by the magic, not again as a notice
        assert "r.txt  not applied: apply = review" in text and ".env  refused by patch.deny_default" in text, text
        assert not (folder / "r.txt").exists()
        reply, outs = c.run("%box_patch apply")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert "r.txt  applied" in text, text
        assert (folder / "r.txt").read_text() == "r\n" and not (folder / ".env").exists()
    finally:
        c.stop()


def test_a_kernel_s_bundles_go_beside_the_notebook_named_after_it_and_box_status_names_the_bundle(kernel_env,
                                                                                                 tmp_path, monkeypatch):
    folder = tmp_path / "nb"
    folder.mkdir()
    monkeypatch.delenv("TKBOX_BUNDLE_DIR")
    monkeypatch.setenv("JPY_SESSION_NAME", str(folder / "my analysis.ipynb"))
    c = Client(folder)
    try:
        # the box gets the cell less its host magics (before, the whole cell: `%box_status` failed in the box)
        reply, outs = c.run("%box_status\nprint(sorted(__import__('os').listdir('.')))")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert reply["status"] == "ok" and text.endswith("\n[]\n") and "UsageError" not in text, text
        reply, outs = c.run("%box_status")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert f"its bundle at the end: {folder}/.tkbox/runs/my_analysis-" in text, text
        assert f"folder   {folder}\n" in text and f"notebook {folder}/my analysis.ipynb" in text
    finally:
        c.stop()
    found = list((folder / ".tkbox" / "runs").glob("my_analysis-*.tkb"))
    assert len(found) == 1 and open_run(found[0]).crossings()
    # the bundle names its notebook, signed in its box.start (before, nothing linked a bundle to its notebook)
    run = open_run(found[0])
    start = next(x for x in run.crossings() if x.door == "box" and x.args.get("kind") == "start")
    assert run.notebook == start.args["notebook"] == str(folder / "my analysis.ipynb") and run.verify().valid
    shown = run_cli("show", str(found[0]))
    assert shown.returncode == 0 and f"\nnotebook {folder}/my analysis.ipynb\n" in shown.stdout, shown.stdout


def test_a_kernel_no_frontend_names_writes_a_box_bundle_that_names_no_notebook(kernel_env, tmp_path, monkeypatch):
    """nbclient and papermill set no JPY_SESSION_NAME: nothing is guessed (not the folder, not a file in it)."""
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "other.ipynb").write_text("{}")
    monkeypatch.delenv("TKBOX_BUNDLE_DIR")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    c = Client(folder)
    try:
        reply, outs = c.run("print(1)")
        assert reply["status"] == "ok", reply
        reply, outs = c.run("%box_status")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert reply["status"] == "ok" and "notebook none named by the frontend\n" in text, text
        # %box_bundle says in plain words what it checked of the run so far, and that the run is still open
        reply, outs = c.run(f"%box_bundle {tmp_path / 'so-far.tkb'}")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert reply["status"] == "ok" and "\nVALID: " in text and " records signed by tkbox.local/" in text, text
        assert "every disclosed cell and file matches its signed digest" in text and "the run is still open" in text
        assert "VERIFIED TO HEAD" not in text and "ed25519" not in text
    finally:
        c.stop()
    found = list((folder / ".tkbox" / "runs").glob("*.tkb"))
    assert len(found) == 1 and found[0].name.startswith("box-"), found
    run = open_run(found[0])
    assert run.notebook is None and "notebook" not in run.box and run.verify().valid
    shown = run_cli("show", str(found[0]))
    assert shown.returncode == 0 and "\nnotebook " not in shown.stdout, shown.stdout
