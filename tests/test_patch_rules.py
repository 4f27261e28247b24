"""The patch door's pure parts: the stream reader, the per-file rules and the workspace writer, on bad input."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from tkbox_nb.rules import patch_rules as rules
from tkbox_nb.rules.patch_reader import PatchReader
from tkbox_nb.guest.patch import encode
from tkbox_nb.guest.protocol import ProtocolError
from tkbox_nb.rules.patch_diff import DiffFile, render
from tkbox_nb.policy import Policy
from tkbox_nb.doors.workspace_writer import FileChange, Staging, apply_changes, sha256_file_digest


def decide(path, op="add", type="file", size=3, policy=None, **extra):
    facts = dict(door="patch", kind="file", path=path, op=op, type=type, mode=0o644, size=size, index=0,
                 total_before=0, binary=False, **extra)
    return (policy or Policy.default()).decide(facts)


# -- the reader ------------------------------------------------------------------------------------------------
def entry(path="a.txt", content=b"abc", **kw):
    return encode(dict({"path": path, "op": "add", "type": "file", "mode": 0o644}, **kw), content)


def test_reader_takes_entries_split_anywhere():
    data = entry("a", b"one") + entry("b", b"") + entry("c", b"x" * 5000)
    for cut in (1, 3, 7, 100):
        r = PatchReader(1 << 20, 1 << 30)
        got = []
        for i in range(0, len(data), cut):
            got += r.feed(data[i:i + cut])
        r.finish()
        assert [(e.path, e.content) for e in got] == [("a", b"one"), ("b", b""), ("c", b"x" * 5000)]


def test_huge_declared_size_is_counted_not_buffered():
    r = PatchReader(keep_bytes=100, max_stream_bytes=1 << 30)
    [e] = r.feed(entry("big", b"y" * 10_000))
    assert e.dropped and e.content is None and e.size == 10_000
    assert decide("big", size=e.size, dropped=True, policy=Policy.from_toml("[patch]\nmax_file_bytes = 100\n")
                  ).rule == "patch.max_file_bytes"


NEG = json.dumps({"path": "a", "op": "add", "type": "file", "mode": 1, "size": -1}).encode()


@pytest.mark.parametrize("raw, why", [
    (struct.pack(">I", 0), "header of 0 bytes"),
    (struct.pack(">I", 1 << 20), "header of"),
    (struct.pack(">I", 4) + b"null", "not an object"),
    (struct.pack(">I", 2) + b"{]", "not JSON"),
    (encode({"path": "a", "op": "add", "type": "file", "mode": 0o644, "evil": 1}, b""), "unknown field"),
    (encode({"path": "a", "op": "add", "type": "file", "mode": "rwx"}, b""), "mode is not int"),
    (encode({"path": "a", "op": "add", "type": "file"}, b""), "without mode"),
    (struct.pack(">I", len(NEG)) + NEG, "impossible size"),
])
def test_malformed_stream_is_a_violation(raw, why):
    with pytest.raises(ProtocolError, match=why):
        PatchReader(1 << 20, 1 << 30).feed(raw)


def test_truncated_entry_and_flooding_are_violations():
    r = PatchReader(1 << 20, 1 << 30)
    r.feed(entry("a", b"abc")[:-1])
    with pytest.raises(ProtocolError, match="inside an entry"):
        r.finish()
    with pytest.raises(ProtocolError, match="over 1000 bytes"):
        PatchReader(100, 1000).feed(entry("a", b"z" * 2000))
    with pytest.raises(ProtocolError, match="more than 2 entries"):
        PatchReader(100, 1 << 20, max_entries=2).feed(entry() * 3)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_patch_reader(data):
    r = PatchReader(256, 4096, max_entries=50)
    try:
        for e in r.feed(data):
            assert e.content is None or len(e.content) == e.size <= 256
            assert isinstance(e.path, str) and isinstance(e.mode, int)
            decide(e.path, e.op, e.type, e.size)  # a verdict, never an exception
    except ProtocolError:
        pass


# -- the rules: a test per bad input of the issue ---------------------------------------------------------------
@pytest.mark.parametrize("path, rule", [
    ("../etc/passwd", "patch.path"), ("a/../../x", "patch.path"), ("/etc/passwd", "patch.path"),
    ("a\\..\\b", "patch.path"), ("a\x00b", "patch.path"), ("a\nb", "patch.path"), ("a\x1bb", "patch.path"),
    ("a\x85b", "patch.path"), ("./a", "patch.path"), ("a//b", "patch.path"), ("", "patch.path"),
    ("x" * 256, "patch.path"), ("/".join(["d"] * 40), "patch.path"), ("/".join(["d" * 200] * 6), "patch.path"),
    ("a\udcffb", "patch.path"),
    (".git/config", "patch.git"), (".GIT/hooks/pre-commit", "patch.git"), (".git./config", "patch.git"),
    (".git /config", "patch.git"), ("sub/.git/config", "patch.git"), (".git", "patch.git"),
    ("GIT~1/config", "patch.git"),
    (".github/workflows/ci.yml", "patch.deny_default[0]"), (".GitHub/Workflows/x.yml", "patch.deny_default[0]"),
    (".env", "patch.deny_default[2]"), ("app/.env", "patch.deny_default[2]"),
    ("app/.env.local", "patch.deny_default[3]"),
    (".ENV", "patch.deny_default[2]"),
])
def test_bad_paths_are_refused_with_their_rule(path, rule):
    v = decide(path)
    assert (v.verdict, v.rule) == ("deny", rule), v
    assert v.reason


@pytest.mark.parametrize("ftype", ["symlink", "hardlink", "fifo", "socket", "device", "other"])
def test_only_regular_files_are_applied(ftype):
    v = decide("x", type=ftype)
    assert (v.verdict, v.rule) == ("deny", "patch.type")


def test_rename_sources_outside_the_workspace_are_refused():
    assert decide("b", op="rename", **{"from": "../../etc/shadow"}).rule == "patch.from"
    assert decide("b", op="rename", **{"from": "/etc/shadow"}).rule == "patch.from"
    assert decide("b", op="rename", **{"from": ".git/config"}).rule == "patch.from"
    assert decide("b", op="rename", **{"from": "a"}).verdict == "allow"
    assert decide("b", op="copy").rule == "patch.op"


def test_duplicates_collisions_limits_and_globs():
    assert decide("a", duplicate_of="a").rule == "patch.duplicate"
    assert decide("A.txt", collides_with="a.txt").rule == "patch.collision"
    p = Policy.from_toml('[patch]\nallow = ["src/**"]\ndeny = ["src/secret*"]\nmax_file_bytes = 10\n'
                         'max_total_bytes = 15\nmax_files = 2\nbinary = false\n')
    assert decide("src/a.py", policy=p).rule == "patch.allow[0]"
    assert decide("README", policy=p).rule == "patch.allow"
    assert decide("src/secret.txt", policy=p).rule == "patch.deny[0]"
    assert decide("src/a.py", size=11, policy=p).rule == "patch.max_file_bytes"
    assert decide("src/a.py", size=10, policy=p).verdict == "allow"
    facts = dict(door="patch", kind="file", path="src/b", op="add", type="file", mode=0o644, size=10, index=1,
                 total_before=10, binary=False)
    assert p.decide(facts).rule == "patch.max_total_bytes"
    assert p.decide(dict(facts, index=2, total_before=0)).rule == "patch.max_files"
    assert p.decide(dict(facts, total_before=0, binary=True)).rule == "patch.binary"


def test_collision_keys_fold_case_and_unicode_form():
    assert rules.fold("Caf\u00e9.txt") == rules.fold("cafe\u0301.TXT")
    assert rules.fold("a") != rules.fold("b")


def test_modes_are_clamped():
    assert rules.clamp_mode(0o4755) == 0o755 and rules.clamp_mode(0o2644) == 0o644
    assert rules.clamp_mode(0o777) == 0o755 and rules.clamp_mode(0o666) == 0o644


@pytest.mark.parametrize("text, why", [
    ('[patch]\napply = "sometimes"\n', "patch.apply must be one of"),
    ("[patch]\nmax_file_bytes = 0\n", "patch.max_file_bytes must be positive"),
    ('[patch]\nallow = "**"\n', "patch.allow must be a list"),
    ("[patch]\nfollow_symlinks = true\n", "unknown key patch.follow_symlinks"),
])
def test_bad_patch_policy_is_one_line(text, why):
    from tkbox_nb.core.errors import PolicyError
    with pytest.raises(PolicyError, match=why):
        Policy.from_toml(text)


# -- the writer ----------------------------------------------------------------------------------------------------
def add(path, data=b"new\n", mode=0o644, base=None):
    return FileChange(path, "add", data, mode, base)


def test_writer_never_follows_a_symlink_on_the_host(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (ws / "link").symlink_to(outside)
    (ws / "file-link").symlink_to(outside / "f")
    out = apply_changes(str(ws), [add("link/x"), add("file-link"), add("ok")])
    assert [(o.applied, o.reason) for o in out][:2] == [
        (False, "'link' on the host is a symlink or not a directory"), (False, "the host path is a symlink")]
    assert out[2].applied and (ws / "ok").read_bytes() == b"new\n"
    assert list(outside.iterdir()) == []


def test_writer_refuses_a_host_file_that_moved_on_and_keeps_it(tmp_path):
    (tmp_path / "a").write_bytes(b"host edit\n")
    [o] = apply_changes(str(tmp_path), [FileChange("a", "modify", b"box\n", 0o644, sha256_file_digest(b"base\n"))])
    assert not o.applied and "changed since the box started" in o.reason
    assert (tmp_path / "a").read_bytes() == b"host edit\n"


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_host_edit_made_between_staging_and_commit_is_kept_and_that_file_alone_refused(tmp_path):
    """The patch door stages while the signer records (doors/patch.py): an edit the user saves meanwhile, to a file
    the patch modifies or deletes, is never overwritten; the other files are applied; nothing staged is left."""
    base = sha256_file_digest(b"base\n")
    for name in ("edited", "deleted", "kept"):
        (tmp_path / name).write_bytes(b"base\n")
    staging = Staging(str(tmp_path), [FileChange("edited", "modify", b"box\n", 0o644, base),
                                      FileChange("deleted", "delete", None, 0o644, base),
                                      FileChange("kept", "modify", b"box\n", 0o644, base), add("new/file")])
    staging.stage()
    (tmp_path / "edited").write_bytes(b"the user's unsaved work\n")
    (tmp_path / "deleted").write_bytes(b"written again by the user\n")
    out = staging.commit()
    assert [(o.applied, o.reason) for o in out] == [
        (False, "the host file changed while the patch was being signed"),
        (False, "the host file changed while the patch was being signed"), (True, ""), (True, "")]
    assert (tmp_path / "edited").read_bytes() == b"the user's unsaved work\n"
    assert (tmp_path / "deleted").read_bytes() == b"written again by the user\n"
    assert (tmp_path / "kept").read_bytes() == b"box\n" and (tmp_path / "new/file").read_bytes() == b"new\n"
    assert _listing(tmp_path) == ["deleted", "edited", "kept", "new", "new/file"]  # no temporary file left


def test_a_file_that_cannot_be_replaced_at_commit_is_refused_alone_and_leaves_nothing_staged(tmp_path):
    """A target turned into a directory after staging: its rename fails; that file is refused with the reason, the
    others are applied, its temporary file and a directory made only for it are removed, nothing is raised."""
    staging = Staging(str(tmp_path), [add("out/a.txt"), add("out/b.txt"), add("only/c.txt"), add("out/d.txt")])
    staging.stage()
    (tmp_path / "out" / "b.txt").mkdir()
    (tmp_path / "out" / "b.txt" / "inside").write_bytes(b"x")
    (tmp_path / "only" / "c.txt").mkdir()
    out = staging.commit()
    assert [o.applied for o in out] == [True, False, False, True]
    assert all("Is a directory" in o.reason for o in out[1:3]), out
    assert _listing(tmp_path) == ["only", "only/c.txt", "out", "out/a.txt", "out/b.txt", "out/b.txt/inside",
                                  "out/d.txt"]


def test_a_staging_called_off_removes_every_staged_file_and_every_directory_made(tmp_path):
    (tmp_path / "keep").write_bytes(b"k")
    staging = Staging(str(tmp_path), [add("a/b/c.txt"), add("top.txt"), FileChange("keep", "delete", None, 0o644,
                                                                                    sha256_file_digest(b"k"))])
    staging.stage()
    assert any(".tkbox-" in name for name in _listing(tmp_path))
    staging.abort()
    staging.abort()  # twice is harmless
    assert _listing(tmp_path) == ["keep"]


def test_writer_clamps_modes_and_writes_atomically(tmp_path):
    [o] = apply_changes(str(tmp_path), [add("d/e/run.sh", b"#!/bin/sh\n", 0o6777)])
    assert o.applied and (tmp_path / "d/e/run.sh").stat().st_mode & 0o7777 == 0o755
    assert not [n for n in os.listdir(tmp_path / "d/e") if ".tkbox-" in n]  # no temporary file left


def test_writer_on_a_full_disk_changes_nothing(tmp_path):
    """A small tmpfs in a private mount namespace: staging fails part way, and the workspace is as it was."""
    script = (
        "import os, sys; sys.path.insert(0, %r)\n"
        "from tkbox_nb.doors.workspace_writer import FileChange, apply_changes, ApplyError\n"
        "ws = %r; open(os.path.join(ws, 'keep'), 'wb').write(b'kept')\n"
        "changes = [FileChange('d%%d/f' %% i, 'add', b'x' * 200_000, 0o644, None) for i in range(20)]\n"
        "changes.append(FileChange('keep', 'modify', b'changed', 0o644, "
        "'sha256:' + __import__('hashlib').sha256(b'kept').hexdigest()))\n"
        "try:\n    apply_changes(ws, changes)\nexcept ApplyError as e:\n    print('APPLYERROR', e)\n"
        "print(sorted(os.listdir(ws)), open(os.path.join(ws, 'keep'), 'rb').read())\n"
    ) % (os.getcwd(), str(tmp_path / "m"))
    (tmp_path / "m").mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path / 'm'} && "
                        f"{sys.executable} -c \"$0\"", script], capture_output=True, text=True, timeout=60)
    if "mount" in r.stderr and r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:100]}")
    assert "APPLYERROR nothing applied: No space left on device" in r.stdout, r.stdout + r.stderr
    assert "['keep'] b'kept'" in r.stdout  # no staged file, no directory made for them, the old file intact


def test_writer_rename_and_delete(tmp_path):
    (tmp_path / "a").write_bytes(b"A")
    (tmp_path / "gone").write_bytes(b"G")
    out = apply_changes(str(tmp_path), [
        FileChange("b", "rename", b"A", 0o644, None, "a", sha256_file_digest(b"A")),
        FileChange("gone", "delete", None, 0o644, sha256_file_digest(b"G"))])
    assert all(o.applied for o in out)
    assert sorted(os.listdir(tmp_path)) == ["b"]


# -- the diff ------------------------------------------------------------------------------------------------------
def test_diff_applies_with_git(tmp_path):
    (tmp_path / "m.txt").write_text("1\n2\n3\n")
    (tmp_path / "d.txt").write_text("bye\n")
    (tmp_path / "r.txt").write_text("same\n")
    diff = render([DiffFile("m.txt", "modify", b"1\n2\n3\n", b"1\ntwo\n3", 0o644, 0o644),
                   DiffFile("n/new.py", "add", None, b"print(1)\n", 0o755),
                   DiffFile("d.txt", "delete", b"bye\n", None),
                   DiffFile("moved.txt", "rename", b"same\n", b"same\n", source="r.txt"),
                   DiffFile("bin", "add", None, b"\x00\x01")])
    (tmp_path / "p.diff").write_bytes(diff)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    text = [line for line in diff.decode().splitlines() if not line.startswith("Binary")]
    (tmp_path / "p.diff").write_text("\n".join(text).replace("diff --git a/bin b/bin\nnew file mode 100644", "")
                                     + "\n")
    r = subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.txt").read_text() == "1\ntwo\n3"
    assert (tmp_path / "n/new.py").read_text() == "print(1)\n" and os.access(tmp_path / "n/new.py", os.X_OK)
    assert not (tmp_path / "d.txt").exists() and (tmp_path / "moved.txt").read_text() == "same\n"
