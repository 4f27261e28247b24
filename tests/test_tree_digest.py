"""The workspace digest: version 2 (`tree2:sha256:`) frames every field with its length, so trees that version 1's
newline framing confused get different digests; it does not depend on the order files were made; it is what
docs/bundle-format.md specifies; and a bundle that stated a version-1 digest still verifies and reruns."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import VENV_BIN, run_cli

from tkbox_nb.core.tree_digest import digest_version, tree_digest

DATA = Path(__file__).resolve().parent / "data"
SAMPLES = Path(__file__).resolve().parent.parent / "notebooks" / "samples"


def colliding(tmp_path: Path) -> tuple[Path, Path]:
    """Two different trees whose version-1 bytes are equal: the link `a` to "t\\nq" and the file `r`, against the
    link `a` to "t" and the file "q\\nr" (same content): version 1 hashed `a\\0l\\0t\\nq\\nr\\0f-\\0HEX\\n` for both."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    os.symlink("t\nq", one / "a")
    (one / "r").write_text("C\n")
    os.symlink("t", two / "a")
    (two / "q\nr").write_text("C\n")
    return one, two


def test_two_workspaces_whose_names_differ_by_a_newline_get_different_digests(tmp_path):
    one, two = colliding(tmp_path)
    assert tree_digest(one, 1) == tree_digest(two, 1)  # the ambiguity of version 1
    assert tree_digest(one) != tree_digest(two)
    assert tree_digest(one).startswith("tree2:sha256:") and digest_version(tree_digest(one)) == 2


def test_the_digest_is_the_documented_format_and_independent_of_the_order_files_were_made(tmp_path):
    """Recomputed here from docs/bundle-format.md alone: SHA-256 of "tkbox-tree-2\\0", then per entry in the byte
    order of paths, each of path, kind and body as an 8-byte big-endian length and its bytes."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root, order in ((a, ("z", "d/y", "d/x\nw")), (b, ("d/x\nw", "z", "d/y"))):
        (root / "d").mkdir(parents=True)
        for name in order:
            (root / name).write_bytes(name.encode())
        os.chmod(root / "z", 0o755)
        os.symlink("../z", root / "d" / "l")
    h = hashlib.sha256(b"tkbox-tree-2\0")
    for path, kind, body in (("d", b"d", b""), ("d/l", b"l", b"../z"), ("d/x\nw", b"f-", None), ("d/y", b"f-", None),
                             ("z", b"fx", None)):
        body = hashlib.sha256(path.encode()).hexdigest().encode() if body is None else body
        h.update(b"".join(len(p).to_bytes(8, "big") + p for p in (path.encode(), kind, body)))
    assert tree_digest(a) == tree_digest(b) == "tree2:sha256:" + h.hexdigest()
    os.chmod(b / "z", 0o644)
    assert tree_digest(a) != tree_digest(b)


@pytest.mark.parametrize("digest, version", [("tree2:sha256:" + "0" * 64, 2), ("sha256:" + "a" * 64, 1),
                                             ("tree2:sha256:" + "A" * 64, None), ("sha256:" + "0" * 63, None),
                                             ("tree3:sha256:" + "0" * 64, None), (None, None), ("", None)])
def test_a_digest_names_its_version(digest, version):
    assert digest_version(digest) == version


def test_shipped_bundles_and_a_version_1_workspace_digest_still_verify():
    """tests/data/workspace-tree1.tkb was made by `tkbox run --workspace` before version 2, from the tree `one` of
    `colliding`, with a trust config of its own."""
    r = run_cli("verify", str(DATA / "workspace-tree1.tkb"), "--trust", str(DATA / "workspace-tree1.trust.json"))
    assert r.returncode == 0 and r.stdout.startswith("VALID"), r.stdout + r.stderr
    with zipfile.ZipFile(DATA / "workspace-tree1.tkb") as z:
        assert digest_version(json.loads(z.read("box/manifest.json"))["workspace_digest"]) == 1
    for sample in sorted(SAMPLES.glob("*.tkb")):
        r = run_cli("verify", str(sample), "--trust", str(SAMPLES / "trust.json"))
        assert r.returncode == 0 and r.stdout.startswith("VALID"), (sample, r.stdout + r.stderr)


def test_a_rerun_of_a_version_1_run_compares_its_workspace_in_version_1_and_states_version_2(signer, tmp_path):
    one = colliding(tmp_path)[0]
    (one / "notes.txt").write_text("hello\n")
    with zipfile.ZipFile(DATA / "workspace-tree1.tkb") as z:
        assert json.loads(z.read("box/manifest.json"))["workspace_digest"] == tree_digest(one, 1)
    out = tmp_path / "rerun.tkb"
    r = run_cli("rerun", str(DATA / "workspace-tree1.tkb"), "--trust", str(DATA / "workspace-tree1.trust.json"),
                "--workspace", str(one), "-o", str(out), "--backend", "bwrap")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "version-1 tree digest, which this rerun's workspace has too" in r.stderr, r.stderr
    with zipfile.ZipFile(out) as z:
        assert json.loads(z.read("box/manifest.json"))["workspace_digest"] == tree_digest(one)
    v = subprocess.run([str(VENV_BIN / "tkbox"), "verify", str(out), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr
    a = run_cli("audit", str(DATA / "workspace-tree1.tkb"), str(out), "--no-verify")
    assert a.returncode == 1 and "(tree digest version 1)" in a.stdout, a.stdout + a.stderr


def test_the_copy_s_digest_is_the_tree2_digest_of_exactly_what_it_wrote(tmp_path):
    """copy_seed hashes each file as it copies it (one read): the digest it returns is, byte for byte, the version-2
    digest of the copy and of the folder less its excludes, names with a newline, links, executable bits and an
    empty directory included; an empty copy is none."""
    from tkbox_nb.box.workspace_seed import copy_seed
    src = tmp_path / "src"
    for rel, data in (("a.txt", b"A\n"), ("sub/deep/b.bin", os.urandom(3 << 20)), ("n\nx", b"q"),
                      (".git/config", b"left out"), ("sub/.venv/x", b"left out")):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    (src / "empty").mkdir()
    os.symlink("a.txt", src / "link")
    os.symlink("t\nq", src / "odd-link")
    exclude = [".git", ".venv"]
    digest = copy_seed(src, tmp_path / "copy", exclude)
    assert digest == tree_digest(tmp_path / "copy") == tree_digest(src, exclude=exclude)
    assert digest_version(digest) == 2 and not (tmp_path / "copy" / ".git").exists()
    assert os.stat(tmp_path / "copy" / "run.sh").st_mode & 0o777 == 0o755
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / ".git").mkdir()
    assert copy_seed(tmp_path / "none", tmp_path / "none-copy", exclude) is None
