"""The patch door end to end: real boxes change their workspace; every file comes back decided and signed; only
allowed files reach the host workspace, never through a symlink, never outside it, never half-written."""

from __future__ import annotations

import os
import subprocess
import zipfile

import pytest

from tests.conftest import VENV_BIN, run_cli, tamper_content
from tkbox_nb import Box
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.bundle.verify import verify_bundle

AUTO = '[patch]\napply = "auto"\nmax_file_bytes = 100000\n'


def patch_rows(bundle):
    return {c.args["path"]: c for c in open_run(bundle).crossings()
            if c.door == "patch" and c.args.get("kind") == "file"}


def snapshot(root):
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(top, name)
            st = os.lstat(full)
            out[os.path.relpath(full, root)] = (st.st_mode, open(full, "rb").read() if os.path.isfile(full)
                                                 and not os.path.islink(full) else os.readlink(full)
                                                 if os.path.islink(full) else None)
    return out


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("one\ntwo\n")
    (ws / "old.txt").write_text("gone\n")
    (ws / "mv.txt").write_text("moving\n")
    return ws


def test_review_mode_keeps_the_workspace_and_tkbox_apply_writes_the_allowed_files(signer, workspace, tmp_path):
    before = snapshot(workspace)
    bundle = tmp_path / "r.tkb"
    with Box(workspace=workspace, bundle_path=bundle) as box:
        box.run(["sh", "-c", "echo three >> a.txt; rm old.txt; mv mv.txt moved.txt; mkdir -p d; "
                             "printf 'x' > d/new.py; chmod 755 d/new.py; echo S=1 > .env"])
    assert snapshot(workspace) == before  # review: nothing written until asked
    assert verify_bundle(bundle).valid
    rows = patch_rows(bundle)
    assert {p: (c.args["op"], c.decision, c.args["rule"]) for p, c in rows.items()} == {
        "a.txt": ("modify", "allow", "patch.allow[0]"), "d/new.py": ("add", "allow", "patch.allow[0]"),
        "moved.txt": ("rename", "allow", "patch.allow[0]"), "old.txt": ("delete", "allow", "patch.allow[0]"),
        ".env": ("add", "deny", "patch.deny_default[2]")}
    assert rows[".env"].rule_ids == ["TKB-POLICY-DENY"]
    # the diff in the bundle applies with git to the starting workspace
    diff = zipfile.ZipFile(bundle).read("box/patch.diff")
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(workspace), str(copy)], check=True)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    r = subprocess.run(["git", "apply", "-"], input=diff, cwd=copy, capture_output=True)
    assert r.returncode == 0, r.stderr
    # the review step
    listed = run_cli("apply", str(bundle), "--list")
    assert listed.returncode == 0 and "refused      add     .env" in listed.stdout
    applied = run_cli("apply", str(bundle), "-w", str(workspace))
    assert applied.returncode == 0, applied.stderr
    assert "4 allowed, 4 applied" in applied.stdout
    assert sorted(os.listdir(workspace)) == ["a.txt", "d", "moved.txt"]
    assert (workspace / "a.txt").read_text() == (copy / "a.txt").read_text() == "one\ntwo\nthree\n"
    assert (workspace / "d/new.py").stat().st_mode & 0o777 == 0o755
    assert run_cli("apply", str(bundle), "-w", str(workspace)).returncode == 0  # applying again changes nothing
    assert sorted(os.listdir(workspace)) == ["a.txt", "d", "moved.txt"]
    # the independent verifier accepts it too
    trust = tmp_path / "trust.json"
    assert run_cli("trust", "-o", str(trust)).returncode == 0
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(bundle), "--trust", str(trust)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # a readable diff that is not the signed one is caught, even with the manifest rewritten to match
    import hashlib
    import json
    from tkbox_nb.bundle.archive import read_bundle_file, write_zip
    files = read_bundle_file(bundle)
    files["box/patch.diff"] = files["box/patch.diff"].replace(b"+three", b"+rm -rf ~")
    manifest = json.loads(files.pop("manifest.json"))
    manifest["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    write_zip(tmp_path / "diff.tkb", {"manifest.json": json.dumps(manifest).encode(), **files})
    report = verify_bundle(tmp_path / "diff.tkb")
    assert not report.valid and report.first_failure.name == "patch diff"


def test_a_changed_host_file_is_never_overwritten(signer, workspace, tmp_path):
    bundle = tmp_path / "c.tkb"
    with Box(workspace=workspace, bundle_path=bundle) as box:
        box.run(["sh", "-c", "echo box >> a.txt"])
    (workspace / "a.txt").write_text("edited on the host\n")
    r = run_cli("apply", str(bundle), "-w", str(workspace))
    assert r.returncode == 1 and "the host file changed since the box started" in r.stdout
    assert (workspace / "a.txt").read_text() == "edited on the host\n"


def test_tkbox_apply_refuses_a_bundle_that_does_not_verify(signer, workspace, tmp_path):
    bundle = tmp_path / "t.tkb"
    with Box(workspace=workspace, bundle_path=bundle) as box:
        box.run(["sh", "-c", "echo box >> a.txt"])
    bad = tamper_content(bundle, tmp_path / "bad.tkb")
    before = snapshot(workspace)
    r = run_cli("apply", str(bad), "-w", str(workspace))
    assert r.returncode != 0 and "does not verify" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert snapshot(workspace) == before


HOSTILE_TREE = r"""
set -e
mkdir -p real sub .GIT .git. '.git ' deep
ln -s /etc etc-link; ln -s real alias; echo through > alias/f.txt
mkfifo fifo
python3 -c "import socket; socket.socket(socket.AF_UNIX).bind('sock')"
echo hard > h1; ln h1 h2
echo x > .GIT/config; echo x > .git./config; echo x > '.git /config'; mkdir -p sub/.git; echo x > sub/.git/config
printf 'gitdir: /etc\n' > sub/.git-file; mv sub/.git-file sub2.git 2>/dev/null || true; printf 'gitdir: /etc\n' > .git
echo a > A.txt; echo b > a.txt
printf 'nfc' > "$(printf 'caf\303\251')"; printf 'nfd' > "$(printf 'cafe\314\201')"
echo s > suid; chmod 4755 suid
echo n > "$(printf 'new\nline')"; echo b > 'back\slash'; echo u > "$(printf 'not-utf8-\377')"
p=deep; for i in $(seq 1 40); do p=$p/d; done; mkdir -p $p; echo deep > $p/f
head -c 200000 /dev/zero > big.bin
mkdir -p .github/workflows; echo 'on: push' > .github/workflows/ci.yml
echo fine > fine.txt
"""


def test_hostile_entries_made_in_the_box_are_refused_and_nothing_escapes(signer, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    around = tmp_path / "around"  # a neighbour of the workspace: must not change
    around.mkdir()
    (around / "keep").write_text("keep\n")
    bundle = tmp_path / "h.tkb"
    with Box(workspace=ws, bundle_path=bundle, policy=AUTO) as box:
        r = box.run(["sh", "-c", HOSTILE_TREE])
        assert r.exit_code == 0, r.stderr
        patch = box.patch()
    rows = patch_rows(bundle)
    rule = {p: c.args["rule"] for p, c in rows.items()}
    assert rule["etc-link"] == rule["alias"] == rule["fifo"] == rule["sock"] == "patch.type"
    assert rule["h1"] == rule["h2"] == "patch.type"  # hard links
    for p in (".GIT/config", ".git./config", ".git /config", "sub/.git/config", ".git"):
        assert rule[p] == "patch.git", p
    assert rule["a.txt"] == "patch.collision" or rule["A.txt"] == "patch.collision"
    cafe = [p for p in rows if p.startswith("caf")]
    assert sorted(rule[p] for p in cafe) == ["patch.allow[0]", "patch.collision"]
    assert rule["new\nline"] == rule["back\\slash"] == rule["not-utf8-\\udcff"] == "patch.path"
    assert [r for p, r in rule.items() if p.startswith("deep/")] == ["patch.path"]
    assert rule["big.bin"] == "patch.max_file_bytes"
    assert rule[".github/workflows/ci.yml"] == "patch.deny_default[0]"
    assert rule["real/f.txt"] == rule["fine.txt"] == rule["suid"] == "patch.allow[0]"
    for p, c in rows.items():  # each refusal is signed with its reason
        assert (c.decision == "deny") == (c.args["verdict"] == "deny"), p
        assert c.decision == "allow" or c.args["verdict_reason"]
    # what reached the host: exactly the allowed regular files, modes clamped
    applied = {f.path for f in patch.files if f.applied}
    assert applied == {p for p, r in rule.items() if r == "patch.allow[0]"}
    assert (ws / "suid").stat().st_mode & 0o7777 == 0o755
    for top, dirs, files in os.walk(ws):
        for name in dirs + files:
            full = os.path.join(top, name)
            assert not os.path.islink(full)
            assert not os.path.isfile(full) or os.stat(full).st_nlink == 1
    assert not (ws / ".git").exists() and not (ws / ".GIT").exists() and not (ws / "big.bin").exists()
    assert [p.name for p in around.iterdir()] == ["keep"]
    assert verify_bundle(bundle).valid


def test_a_symlink_already_on_the_host_is_never_followed(signer, tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f").write_text("start\n")
    outside.mkdir()
    bundle = tmp_path / "s.tkb"
    with Box(workspace=ws, bundle_path=bundle, policy=AUTO) as box:
        box.run(["sh", "-c", "echo box > sub/f; echo new > sub/g"])
        (ws / "sub").rename(tmp_path / "sub-moved")  # meanwhile on the host: sub becomes a symlink out
        (ws / "sub").symlink_to(outside)
        patch = box.patch()
    assert not any(f.applied for f in patch.files)
    assert all("symlink" in f.apply_reason for f in patch.files)
    assert list(outside.iterdir()) == []
    assert verify_bundle(bundle).valid


CRAFTED = r"""
import sys
sys.path.insert(0, "/opt/tkbox")
from tkbox_guest import agent, patch

def crafted(seed, work):
    e = lambda path, content=b"x", **kw: patch.encode(dict({"path": path, "op": "add", "type": "file",
                                                            "mode": 0o644}, **kw), content)
    yield e("../escape")
    yield e("/etc/cron.d/evil")
    yield e("twice.txt", b"first")
    yield e("twice.txt", b"second")
    yield e("stolen", op="rename", **{"from": "../../etc/shadow"})
    yield e("huge.bin", b"z" * 300000)
    yield e("good.txt", b"good\n")
    TAIL

patch.stream = crafted  # the agent sends this instead of its real changes
sys.exit(agent.main())
"""


@pytest.mark.parametrize("tail", ["", "yield b'\\x00\\x00\\x00\\x09{\"path\":1}'",
                                  "yield patch.encode({'path': 'x', 'op': 'add', 'type': 'file', 'mode': 420}, "
                                  "b'')[:-1] + b'\\x00\\x00\\x10\\x00' + b'a'"])
def test_a_crafted_patch_stream_is_refused_entry_by_entry_or_ends_the_box(signer, tmp_path, tail):
    ws = tmp_path / "ws"
    ws.mkdir()
    program = CRAFTED.replace("TAIL", tail or "pass")
    bundle = tmp_path / "g.tkb"
    box = Box(workspace=ws, bundle_path=bundle, policy=AUTO, agent_argv=["python3", "-c", program]).start()
    box.collect_patch_at_stop = False
    try:
        if not tail:
            patch = box.patch()
            why = {f.path: (f.rule, f.reason) for f in patch.files}
            assert why["../escape"][0] == why["/etc/cron.d/evil"][0] == "patch.path"
            assert why["stolen"][0] == "patch.from"
            assert why["huge.bin"][0] == "patch.max_file_bytes"
            assert [(f.path, f.decision, f.rule) for f in patch.files if f.path == "twice.txt"] == [
                ("twice.txt", "allow", "patch.allow[0]"), ("twice.txt", "deny", "patch.duplicate")]
            assert sorted(os.listdir(ws)) == ["good.txt", "twice.txt"]
            assert (ws / "twice.txt").read_bytes() == b"first"
        else:
            with pytest.raises(Exception, match="has ended"):
                box.patch()
            assert "protocol violation" in box.ended
            assert os.listdir(ws) == []  # nothing of a broken patch is applied
    finally:
        box.stop()
    assert verify_bundle(bundle).valid


def test_audit_compares_the_patches_of_two_runs(signer, tmp_path):
    from tkbox_nb.audit.compare import audit
    bundles = []
    for i, text in enumerate(["same", "same", "other"]):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        with Box(workspace=ws, bundle_path=tmp_path / f"a{i}.tkb") as box:
            box.run(["sh", "-c", f"echo {text} > out.txt; echo kept > keep.txt"])
        bundles.append(box.bundle_path)
    assert audit(bundles[0], bundles[1]).equivalent
    different = audit(bundles[0], bundles[2])
    assert not different.equivalent
    # the command that wrote it (commands are compared too) and out.txt (keep.txt is patch #1)
    assert [d["what"] for d in different.as_dict()["differences"]] == ["command argv #1", "patch #2"]


def test_a_signer_lost_while_files_are_staged_leaves_the_workspace_as_it_was(private_signer, workspace, tmp_path):
    """The allowed files are written beside their targets while the signer records their results and the summary
    (doors/patch.py, _StageBehind); if the signer is lost before the summary is allowed, nothing becomes visible and
    every staged file and every directory made for them is removed."""
    import signal
    import threading
    import time

    from tkbox_nb.core.errors import TkboxError
    before = snapshot(workspace)
    box = Box(backend="bwrap", home=private_signer.home, workspace=workspace, bundle_path=tmp_path / "lost.tkb",
              policy=AUTO).start()
    box.collect_patch_at_stop = False
    box.run(["python3", "-c", "import os\nfor i in range(3000):\n d = 'n%02d' % (i // 100)\n"
                              " os.makedirs(d, exist_ok=True)\n open(f'{d}/f%04d' % i, 'w').write(str(i))\n"])
    killed = threading.Event()

    def kill_once_staging_shows():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed.is_set():
            for top, _dirs, names in os.walk(workspace):
                if any(".tkbox-" in n for n in names):  # a file is staged: the signer is still recording
                    os.kill(private_signer.pid(), signal.SIGKILL)
                    killed.set()
                    return
            time.sleep(0.002)

    watcher = threading.Thread(target=kill_once_staging_shows)
    watcher.start()
    with pytest.raises(TkboxError):
        box.patch()
    watcher.join()
    assert killed.is_set()  # the kill landed while files were staged, before the summary was allowed
    assert snapshot(workspace) == before  # no staged file, no directory made for them, nothing applied
    with pytest.raises(Exception):
        box.stop()
    private_signer.ensure()


# -- a review's findings: what a box could make the host do through the patch door --------------------------------
def crafted_box(ws, bundle, entries, policy=AUTO):
    """A started box whose agent states `entries` ((header, content) pairs) as its patch instead of its changes."""
    program = CRAFTED.split("def crafted")[0] + (
        "def crafted(seed, work):\n    for header, content in ENTRIES:\n        yield patch.encode(header, content)\n"
        "patch.stream = crafted\nsys.exit(agent.main())\n").replace("ENTRIES", repr(entries))
    box = Box(workspace=ws, bundle_path=bundle, policy=policy, agent_argv=["python3", "-c", program]).start()
    box.collect_patch_at_stop = False
    return box


def test_a_rename_cannot_delete_a_file_the_policy_protects(signer, tmp_path):
    """`mv .github/workflows/ci.yml src/` in the box: a rename passes only where deleting its source would, so the
    protected host file stays (its source is refused by the default deny list, the policy's deny or allow)."""
    ws = tmp_path / "ws"
    (ws / ".github/workflows").mkdir(parents=True)
    (ws / "secret").mkdir()
    (ws / ".github/workflows/ci.yml").write_text("on: push\n")
    (ws / ".env").write_text("TOKEN=abc\n")
    (ws / "secret/keep.txt").write_text("keep me\n")
    (ws / "notes.txt").write_text("notes\n")
    before = snapshot(ws)
    bundle = tmp_path / "r.tkb"
    policy = '[patch]\napply = "auto"\nallow = ["src/**"]\ndeny = ["secret/**"]\n'
    with Box(workspace=ws, bundle_path=bundle, policy=policy) as box:
        box.run(["sh", "-c", "mkdir -p src && mv .github/workflows/ci.yml src/ci.yml && mv .env src/env && "
                             "mv secret/keep.txt src/keep.txt && mv notes.txt src/notes.txt"])
        patch = box.patch()
    why = {f.path: (f.decision, f.rule, f.reason) for f in patch.files}
    assert why["src/ci.yml"] == ("deny", "patch.deny_default[0]",
                                 "the rename source .github/workflows/ci.yml matches .github/workflows/**")
    assert why["src/env"] == ("deny", "patch.deny_default[2]", "the rename source .env matches **/.env")
    assert why["src/keep.txt"] == ("deny", "patch.deny[0]", "the rename source secret/keep.txt matches secret/**")
    assert why["src/notes.txt"] == ("deny", "patch.allow", "the rename source notes.txt is not in [patch] allow")
    assert snapshot(ws) == before  # every protected file is still there, and nothing was written
    assert verify_bundle(bundle).valid


def test_a_rename_onto_itself_is_refused_and_deletes_nothing(signer, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("precious\n")
    (ws / "other.txt").write_text("other\n")
    bundle = tmp_path / "s.tkb"
    rename = {"op": "rename", "type": "file", "mode": 0o644}
    box = crafted_box(ws, bundle, [(dict(rename, path="data.txt", **{"from": "data.txt"}), b"new content\n"),
                                   (dict(rename, path="OTHER.txt", **{"from": "other.txt"}), b"other\n")])
    try:
        patch = box.patch()
    finally:
        box.stop()
    assert [(f.path, f.rule, f.reason) for f in patch.files] == [
        ("data.txt", "patch.from", "the rename source is its own target"),
        ("OTHER.txt", "patch.from", "the rename source is its own target")]
    assert (ws / "data.txt").read_text() == "precious\n" and (ws / "other.txt").read_text() == "other\n"
    assert sorted(os.listdir(ws)) == ["data.txt", "other.txt"]
    assert verify_bundle(bundle).valid


def test_an_add_over_a_file_the_box_started_with_is_refused(signer, workspace, tmp_path):
    """A box may not call a change of an existing file a new one: the diff would say `new file` over it."""
    bundle = tmp_path / "o.tkb"
    box = crafted_box(workspace, bundle, [({"path": "a.txt", "op": "add", "type": "file", "mode": 0o644}, b"evil\n"),
                                          ({"path": "moved.txt", "op": "rename", "type": "file", "mode": 0o644,
                                            "from": "old.txt"}, b"gone\n"),
                                          ({"path": "mv.txt", "op": "rename", "type": "file", "mode": 0o644,
                                            "from": "a.txt"}, b"one\ntwo\n")])
    try:
        patch = box.patch()
    finally:
        box.stop()
    assert [(f.path, f.decision, f.rule) for f in patch.files] == [
        ("a.txt", "deny", "patch.overwrite"), ("moved.txt", "allow", "patch.allow[0]"),
        ("mv.txt", "deny", "patch.overwrite")]
    assert (workspace / "a.txt").read_text() == "one\ntwo\n" and (workspace / "mv.txt").read_text() == "moving\n"
    assert b"new file" not in patch.diff and b"rename from old.txt\nrename to moved.txt" in patch.diff
    assert verify_bundle(bundle).valid


def test_the_host_reads_a_workspace_file_once_however_often_the_box_names_it(signer, tmp_path, monkeypatch):
    """Each entry naming a large host file used to cost a read of it and a copy kept until the patch was decided
    (200 entries of 8 MiB: 1.6 GB). Now each seed file is digested once, a duplicate costs no host I/O, and its
    bytes are read only for an allowed file's diff, once a path."""
    import pathlib

    from tkbox_nb.doors import patch as door
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_bytes(b"line\n" * 20_000)
    digests, reads = [], []
    digest, read_bytes = door.current_digest, pathlib.Path.read_bytes
    monkeypatch.setattr(door, "current_digest", lambda root, path: digests.append(path) or digest(root, path))
    monkeypatch.setattr(pathlib.Path, "read_bytes",
                        lambda self: reads.append(self.name) or read_bytes(self))
    entries = [({"path": "data.txt", "op": "delete", "type": "file", "mode": 0o644}, b"")] * 100
    entries += [({"path": f"copy{i}.txt", "op": "rename", "type": "file", "mode": 0o644, "from": "data.txt"},
                 b"changed %d\n" % i) for i in range(20)]
    box = crafted_box(ws, tmp_path / "b.tkb", entries, policy='[patch]\napply = "review"\n')
    try:
        patch = box.patch()
    finally:
        box.stop()
    assert [f.rule for f in patch.files[:2]] == ["patch.allow[0]", "patch.duplicate"]
    # one source, one rename: each further one would put the source's bytes in the diff again
    assert [f.path for f in patch.allowed] == ["data.txt", "copy0.txt"]
    assert {f.reason for f in patch.files[101:]} == {"the rename source went to 'copy0.txt' already"}
    assert patch.diff.count(b"-line\n") == 20_000
    assert digests.count("data.txt") == 1 and reads.count("data.txt") == 1


def test_applying_keeps_a_private_file_private_and_the_diff_shows_every_mode(signer, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for name in ("credentials.yml", "run.sh"):
        (ws / name).write_text("token: abc\n")
        os.chmod(ws / name, 0o600)
    (ws / "tool").write_text("#!/bin/sh\n")
    os.chmod(ws / "tool", 0o750)
    bundle = tmp_path / "m.tkb"
    with Box(workspace=ws, bundle_path=bundle, policy=AUTO) as box:
        box.run(["sh", "-c", "echo 'region: eu' >> credentials.yml; chmod 755 run.sh; chmod -x tool; "
                             "echo new > new.txt; chmod 600 new.txt"])
        patch = box.patch()
    assert all(f.applied for f in patch.files)
    modes = {n: (ws / n).stat().st_mode & 0o7777 for n in ("credentials.yml", "run.sh", "tool", "new.txt")}
    assert modes == {"credentials.yml": 0o600, "run.sh": 0o700, "tool": 0o640, "new.txt": 0o644 & ~_umask()}
    diff = patch.diff.decode()
    assert "diff --git a/credentials.yml b/credentials.yml\n---" in diff  # 0600 before and after
    assert "diff --git a/run.sh b/run.sh\nold mode 100600\nnew mode 100700\n" in diff
    assert "diff --git a/tool b/tool\nold mode 100750\nnew mode 100640\n" in diff
    assert verify_bundle(bundle).valid


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_bundle_decided_under_the_earlier_rules_still_verifies(signer, tmp_path, monkeypatch):
    """A statement without the `rules` fact (2) is decided as before it: a bundle made then still verifies, and
    `tkbox apply` of such a rename onto itself still deletes nothing."""
    from tkbox_nb.rules import patch_rules
    monkeypatch.setattr(patch_rules, "RULES", 1, raising=False)
    ws = tmp_path / "ws"
    (ws / ".github/workflows").mkdir(parents=True)
    (ws / ".github/workflows/ci.yml").write_text("on: push\n")
    (ws / "data.txt").write_text("precious\n")
    bundle = tmp_path / "old.tkb"
    box = crafted_box(ws, bundle, [({"path": "ci.yml", "op": "rename", "type": "file", "mode": 0o644,
                                     "from": ".github/workflows/ci.yml"}, b"on: push\n"),
                                   ({"path": "data.txt", "op": "rename", "type": "file", "mode": 0o644,
                                     "from": "data.txt"}, b"precious\n")], policy='[patch]\napply = "review"\n')
    try:
        patch = box.patch()
    finally:
        box.stop()
    assert [(f.path, f.decision) for f in patch.files] == [("ci.yml", "allow"), ("data.txt", "allow")]
    monkeypatch.undo()
    assert verify_bundle(bundle).valid
    r = run_cli("apply", str(bundle), "-w", str(ws))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (ws / "data.txt").read_text() == "precious\n"


def test_a_folder_the_box_made_unreadable_fails_the_patch_instead_of_deleting_its_files(signer, tmp_path):
    """The guest cannot list a folder (chmod 000 in the box): the patch is refused with the reason, never a patch
    that lists the folder's files as deleted; the host workspace keeps them."""
    from tkbox_nb.core.errors import TkboxError
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "keep.txt").write_text("keep\n")
    with Box(policy=AUTO, backend="bwrap", workspace=ws, bundle_path=tmp_path / "u.tkb") as b:
        assert b.run(["chmod", "000", "/workspace/d"]).exit_code == 0
        with pytest.raises(TkboxError, match="could not list its changes.*Permission denied"):
            b.patch()
        assert b.run(["chmod", "755", "/workspace/d"]).exit_code == 0
    assert (ws / "d" / "keep.txt").read_text() == "keep\n"
    assert not [r for r in patch_rows(tmp_path / "u.tkb").values() if r.args.get("op") == "delete"]
