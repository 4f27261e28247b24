"""The notebook's folder is the box's workspace (docs/jupyter.md, "The notebook's folder"), and the kernel never dies
for a box: real kernels through jupyter_client, started in a folder as every frontend starts them."""

from __future__ import annotations

import pytest

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.tree_digest import tree_digest

from . import test_kernel
from .test_kernel import Client, only_bundle

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
    policy = tmp_path / "p.toml"
    policy.write_text("[workspace]\nmax_mib = 2\n")
    monkeypatch.setenv("TKBOX_POLICY", str(policy))
    c = Client(folder)
    try:
        reply, outs = c.run("print('never')")
        assert reply["status"] == "error", reply
        line = reply["evalue"]
        assert "\n" not in line and "'big' 3 MiB" in line and "max_mib = 2" in line and "[mounts.NAME]" in line
        assert not any(t == "stream" and "never" in x.get("text", "") for t, x in outs)
        # TKBOX_WORKSPACE is not read by a running kernel; a policy naming an empty workspace starts the next box
        reply, _ = c.run('%%box_policy\n[workspace]\npath = "none"\n')
        reply, outs = c.run("import os; print(os.listdir('.'))")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "[]\n"}) in outs
    finally:
        c.stop()


def test_a_vm_policy_without_an_image_answers_kernel_info_and_fails_the_first_cell_in_one_line(kernel_env, tmp_path,
                                                                                             monkeypatch):
    """Before, the box's backend was chosen before the kernel served anything: no backend for `isolation = "vm"`
    raised there, the kernel died before kernel_info, and JupyterLab restarted it five times."""
    policy = tmp_path / "vm.toml"
    policy.write_text('[box]\nisolation = "vm"\n')
    monkeypatch.setenv("TKBOX_POLICY", str(policy))
    c = Client()  # wait_for_ready: kernel_info answered
    try:
        assert c.km.is_alive()
        reply, outs = c.run("print('never')")
        assert reply["status"] == "error", reply
        line = reply["evalue"]
        assert "\n" not in line and "isolation >= 'vm'" in line
        assert "tkbox image build" in line and 'isolation = "namespace"' in line
        reply, _ = c.run('%%box_policy\n[box]\nisolation = "namespace"\n')
        reply, outs = c.run("print('now')")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "now\n"}) in outs
    finally:
        c.stop()
