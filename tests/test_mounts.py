"""Dataset mounts ([mounts.NAME]) in real bubblewrap boxes: read-only at their target with nothing beyond the source,
refused where the host or the policy says no, digested in the documented format (re-implemented here), signed at the
start with the file list disclosed and checked by verify, a change under the mount signed at the stop, and a rerun
with changed data refused unless --allow-changed-data."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
from conftest import forged_bundle, run_cli

from tkbox_nb import Box
from tkbox_nb.core.errors import PolicyError, TkboxError
from tkbox_nb.bundle.mount_digest import digest, scan
from tkbox_nb.policy import Policy
from tkbox_nb.core.tree_digest import tree_digest
from tkbox_nb.bundle.verify import verify_bundle


def policy(source: Path | str, target: str = "/data", extra: str = "") -> str:
    return f'[box]\nbackend = "bwrap"\n[mounts.data]\nsource = "{source}"\ntarget = "{target}"\n{extra}'


def dataset(root: Path) -> Path:
    ds = root / "ds"
    (ds / "sub").mkdir(parents=True)
    (ds / "a.txt").write_text("alpha\n")
    (ds / "sub" / "b.bin").write_bytes(bytes(range(256)) * 40)
    (ds / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(ds / "run.sh", 0o755)
    os.symlink("sub/b.bin", ds / "inside-link")
    return ds


# The writes every backend's mount refuses, as entries of a `tries` dict in a script run in the box (the dataset of
# `dataset` at /data; the script imports mmap and os). Each backend's test adds the ones it has besides.
WRITE_TRIES = r"""    "write": lambda: open("/data/a.txt", "r+").write("x"),
    "truncate": lambda: os.truncate("/data/a.txt", 0),
    "create": lambda: open("/data/new.txt", "x"),
    "mkdir": lambda: os.mkdir("/data/newdir"),
    "chmod": lambda: os.chmod("/data/a.txt", 0o777),
    "rename": lambda: os.rename("/data/a.txt", "/data/z.txt"),
    "unlink": lambda: os.unlink("/data/a.txt"),
    "symlink": lambda: os.symlink("/etc/passwd", "/data/l"),
    "mmap": lambda: mmap.mmap(os.open("/data/sub/b.bin", os.O_RDONLY), 0, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE),
"""


def dataset_and_labels(root: Path) -> tuple[Path, Path, str]:
    """Two mounts, a folder (`dataset`, at /data) and a file (labels.csv, at /labels.csv), and their policy's
    [mounts] tables."""
    ds = dataset(root)
    labels = root / "labels.csv"
    labels.write_text("id,label\n")
    return ds, labels, (f'[mounts.data]\nsource = "{ds}"\ntarget = "/data"\n'
                        f'[mounts.labels]\nsource = "{labels}"\ntarget = "/labels.csv"\n')


def independent_digest(root: Path) -> str:
    """docs/bundle-format.md, "The workspace digest" (version 2), re-implemented: every entry's (path, kind, body)
    framed by 8-byte big-endian lengths, in the order of the paths' bytes, after the domain tag."""
    h = hashlib.sha256(b"tkbox-tree-2\0")
    paths = sorted(os.path.relpath(os.path.join(d, n), root).encode() for d, ds, fs in os.walk(root) for n in ds + fs)
    for rel in paths:
        p = root / rel.decode()
        st = os.lstat(p)
        kind, body = ((b"l", os.readlink(p).encode()) if stat.S_ISLNK(st.st_mode) else (b"d", b"")
                      if stat.S_ISDIR(st.st_mode) else (b"fx" if st.st_mode & 0o111 else b"f-",
                                                        hashlib.sha256(p.read_bytes()).hexdigest().encode()))
        h.update(b"".join(len(x).to_bytes(8, "big") + x for x in (rel, kind, body)))
    return "tree2:sha256:" + h.hexdigest()


def start_args(bundle: Path) -> tuple[dict, dict]:
    with zipfile.ZipFile(bundle) as z:
        d = [json.loads(line) for line in z.read("box/disclosures.jsonl").splitlines()]
    facts = [x["args"] for x in d if x.get("type") == "policy.decision" and x["args"].get("door") == "box"]
    return next(a for a in facts if a["kind"] == "start"), next(a for a in facts if a["kind"] == "stop")


@pytest.mark.parametrize("body, says", [
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/workspace"', "over /workspace"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/workspace/data"', "over /workspace"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/proc"', "over /proc"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/opt"', "over /opt/tkbox"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/"', "would hide the whole box"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "data"', "absolute path in normal form"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/data/../etc"', "absolute path in normal form"),
    ('[mounts.d]\nsource = "srv/x"\ntarget = "/data"', "source must be an absolute path"),
    ('[mounts.d]\nsource = "/srv/x"\ntarget = "/data"\nreadonly = false', "a mount is always read-only"),
    ('[mounts.d]\ntarget = "/data"', "source is missing"),
    ('[mounts.a]\nsource = "/srv/x"\ntarget = "/data"\n[mounts.b]\nsource = "/srv/y"\ntarget = "/data"',
     "two mounts on one target"),
    ('[mounts.a]\nsource = "/srv/x"\ntarget = "/data"\n[mounts.b]\nsource = "/srv/y"\ntarget = "/data/more"',
     "overlaps mounts.a"),
    ('[box]\nmounts = ["/srv/x"]', "unknown key box.mounts"),
])
def test_a_bad_mount_is_one_policy_error(body, says):
    with pytest.raises(PolicyError) as e:
        Policy.from_toml(body, "p.toml")
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_reads_work_at_the_target_and_every_kind_of_write_fails(signer, tmp_path):
    ds = dataset(tmp_path)
    script = r"""
import errno, hashlib, mmap, os
print(open("/data/a.txt").read().strip(), hashlib.sha256(open("/data/sub/b.bin", "rb").read()).hexdigest())
print(open("/data/inside-link", "rb").read() == open("/data/sub/b.bin", "rb").read())
tries = {
""" + WRITE_TRIES + r"""    "chown": lambda: os.chown("/data/a.txt", 0, 0),
    "utime": lambda: os.utime("/data/a.txt", (0, 0)),
    "rmdir": lambda: os.rmdir("/data/sub"),
    "link": lambda: os.link("/data/a.txt", "/data/hard"),
    "remount": lambda: os.system("mount -o remount,rw /data 2>/dev/null") == 0 or (_ for _ in ()).throw(OSError()),
}
for name, f in tries.items():
    try:
        f()
        print("WROTE", name)
    except OSError:
        print("refused", name)
"""
    with Box(policy=policy(ds), bundle_path=tmp_path / "r.tkb") as box:
        r = box.run(["python3", "-c", script])
    out = r.stdout.decode()
    assert r.exit_code == 0, r.stderr
    assert out.startswith(f"alpha {hashlib.sha256((ds / 'sub' / 'b.bin').read_bytes()).hexdigest()}\nTrue\n"), out
    assert "WROTE" not in out and out.count("refused") == 14, out
    assert (ds / "a.txt").read_text() == "alpha\n" and sorted(os.listdir(ds)) == ["a.txt", "inside-link", "run.sh",
                                                                                   "sub"]


@pytest.mark.parametrize("target", ["/etc/shadow", "../secret"])
def test_a_link_out_of_the_source_is_refused_and_one_made_while_the_box_runs_shows_nothing(signer, tmp_path, target):
    ds = dataset(tmp_path)
    (tmp_path / "secret").write_text("host secret\n")
    os.symlink(target, ds / "out")
    with pytest.raises(TkboxError) as e:
        Box(policy=policy(ds)).start()
    assert "a symbolic link pointing out of it" in str(e.value) and "\n" not in str(e.value), str(e.value)
    os.unlink(ds / "out")
    with Box(policy=policy(ds), bundle_path=tmp_path / "r.tkb") as box:
        os.symlink(target, ds / "out")  # made on the host while the box runs: it resolves in the box's own root
        r = box.run(["sh", "-c", "cat /data/out; echo rc=$?"])
    assert b"host secret" not in r.stdout and b"root:" not in r.stdout and b"rc=1" in r.stdout, r.stdout


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_in_the_source_is_refused(signer, tmp_path, kind):
    ds = dataset(tmp_path)
    if kind == "fifo":
        os.mkfifo(ds / "sub" / "pipe")
    else:
        os.mknod(ds / "sub" / "pipe", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    runs = sorted(signer.runs_dir.iterdir())
    box = Box(policy=policy(ds))
    with pytest.raises(TkboxError) as e:
        box.start()
    assert "sub/pipe, which is not a file, directory or symbolic link" in str(e.value), str(e.value)
    # the walk ends after the box is spawned (its agent waiting for the GO): the box is killed, no run was opened
    assert box.recorder is None and sorted(signer.runs_dir.iterdir()) == runs
    assert box.running is not None and box.running.proc.poll() is not None


def test_a_source_inside_or_over_tkbox_home_is_refused(signer, tmp_path):
    for source in (signer.home / "signer", signer.home.parent):
        with pytest.raises(TkboxError) as e:
            Box(policy=policy(source)).start()
        assert "$TKBOX_HOME" in str(e.value) and "signer's keys" in str(e.value), str(e.value)
    with pytest.raises(TkboxError, match="does not exist"):
        Box(policy=policy(tmp_path / "nowhere")).start()


def test_every_backend_takes_mounts_and_auto_takes_bwrap_or_qemu(tmp_path):
    """bubblewrap binds the sources, QEMU and Firecracker give them as read-only disks (tests/e2e/test_qemu_mounts.py,
    tests/e2e/test_firecracker_box.py); a backend that could not would be refused in one line."""
    from tkbox_nb.backends.mounts import backend_for, refuse_backend
    from tkbox_nb.backends.registry import BACKENDS
    p = Policy.from_toml(policy(tmp_path), "p.toml")
    for name in BACKENDS:
        assert backend_for(p, name) == name
    with pytest.raises(TkboxError) as e:
        refuse_backend(p, "other")
    assert str(e.value).startswith("[mounts] needs the bwrap, qemu or firecracker backend: a other box cannot mount "
                                   "host data") and "\n" not in str(e.value), str(e.value)
    refuse_backend(Policy.from_toml("", "p.toml"), "other")  # no mounts: nothing to refuse
    for isolation, want in (("vm", "qemu"), ("namespace", "bwrap")):
        p = Policy.from_toml(policy(tmp_path).replace('backend = "bwrap"', f'isolation = "{isolation}"'), "p.toml")
        assert backend_for(p, "auto") == want


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_signed_digest_is_the_documented_format_and_verify_checks_the_disclosed_list(signer, tmp_path):
    ds = dataset(tmp_path)
    other = tmp_path / "other"  # the same tree made in another order: the same digest
    (other / "sub").mkdir(parents=True)
    os.symlink("sub/b.bin", other / "inside-link")
    (other / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(other / "run.sh", 0o755)
    (other / "sub" / "b.bin").write_bytes((ds / "sub" / "b.bin").read_bytes())
    (other / "a.txt").write_text("alpha\n")
    want = independent_digest(ds)
    assert digest(scan(str(ds)), None)[0] == want == tree_digest(ds) == digest(scan(str(other)), None)[0]
    with Box(policy=policy(ds), bundle_path=tmp_path / "r.tkb") as box:
        box.run(["true"])
    start, stop = start_args(tmp_path / "r.tkb")
    assert start["mounts"] == {"data": {"target": "/data", "digest": want, "files": 3, "bytes": 6 + 10240 + 10}}
    assert "mounts_changed" not in stop
    report = verify_bundle(tmp_path / "r.tkb", trust=signer.trust_path)
    assert report.valid and any(c.name == "mounts" and c.ok for c in report.checks), report.summary()
    # a forged list (one file's digest changed, the bundle's manifest recomputed) no longer opens the signed digest
    from tkbox_nb.bundle.archive import read_bundle_file
    files = read_bundle_file(tmp_path / "r.tkb")
    files["box/mounts/data.jsonl"] = files["box/mounts/data.jsonl"].replace(
        hashlib.sha256(b"alpha\n").hexdigest().encode(), b"0" * 64)
    forged_bundle(files, tmp_path / "forged.tkb")
    report = verify_bundle(tmp_path / "forged.tkb", trust=signer.trust_path)
    assert not report.valid and report.first_failure.name == "mounts", report.summary()
    assert "not the signed" in report.summary(), report.summary()


def _rchar() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def test_a_warm_digest_reads_no_file_data_and_a_changed_file_is_hashed_again(tmp_path):
    ds = tmp_path / "big"
    ds.mkdir()
    for i in range(40):
        (ds / f"f{i:03d}").write_bytes(os.urandom(256 << 10))  # 10 MiB
    home = tmp_path / "home"
    before = _rchar()
    cold = digest(scan(str(ds)), home)[0]
    cold_read = _rchar() - before
    before = _rchar()
    assert digest(scan(str(ds)), home)[0] == cold
    warm_read = _rchar() - before
    assert cold_read >= 10 << 20 and warm_read < 64 << 10, (cold_read, warm_read)  # the cache itself: ~4 KiB
    (ds / "f007").write_bytes(os.urandom(256 << 10))
    before = _rchar()
    again = digest(scan(str(ds)), home)[0]
    assert 256 << 10 <= _rchar() - before < 1 << 20  # f007 only, and the cache
    assert again == independent_digest(ds) != cold
    assert oct(os.stat(home / "mount-cache").st_mode & 0o777) == "0o700"


def test_a_file_changed_while_the_box_runs_is_signed_at_stop_and_shown_by_verify_and_audit(signer, tmp_path):
    ds = dataset(tmp_path)
    with Box(policy=policy(ds), bundle_path=tmp_path / "a.tkb") as box:
        box.run(["cat", "/data/a.txt"])
    with Box(policy=policy(ds), bundle_path=tmp_path / "b.tkb") as box:
        box.run(["cat", "/data/a.txt"])
        (ds / "sub" / "b.bin").write_bytes(b"changed under the box")
    assert start_args(tmp_path / "b.tkb")[1]["mounts_changed"] == {"data": ["sub/b.bin"]}
    report = verify_bundle(tmp_path / "b.tkb", trust=signer.trust_path)
    assert report.valid and "data changed under a mount while the box ran: data: sub/b.bin" in report.summary()
    r = run_cli("audit", str(tmp_path / "a.tkb"), str(tmp_path / "b.tkb"), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    diffs = {d["kind"]: d for d in json.loads(r.stdout)["differences"]}
    assert list(diffs) == ["mounts changed while the box ran"] and diffs[list(diffs)[0]]["b"] == "data: sub/b.bin"


def test_a_rerun_with_changed_data_is_refused_naming_the_file_and_goes_on_with_allow_changed_data(signer, tmp_path):
    ds = dataset(tmp_path)
    p = _write(tmp_path / "p.toml", policy(ds, extra='[exec]\ncommands = ["*"]\n'))
    r = run_cli("run", "--policy", str(p), "-o", str(tmp_path / "a.tkb"), "--", "cat", "/data/a.txt")
    assert r.returncode == 0 and r.stdout == "alpha\n", r.stderr
    r = run_cli("rerun", str(tmp_path / "a.tkb"), "-o", str(tmp_path / "same.tkb"))
    assert r.returncode == 0, r.stderr
    assert run_cli("audit", str(tmp_path / "a.tkb"), str(tmp_path / "same.tkb")).returncode == 0
    (ds / "a.txt").write_text("beta\n")
    r = run_cli("rerun", str(tmp_path / "a.tkb"), "-o", str(tmp_path / "b.tkb"))
    assert r.returncode != 0 and not (tmp_path / "b.tkb").exists(), r.stdout + r.stderr
    said = f"mount data ({ds}): its data differs from the original run's, first at a.txt"
    assert r.stderr.count("\n") == 1 and said in r.stderr and "--allow-changed-data" in r.stderr, r.stderr
    r = run_cli("rerun", str(tmp_path / "a.tkb"), "-o", str(tmp_path / "b.tkb"), "--allow-changed-data")
    assert r.returncode == 0 and "first at a.txt" in r.stderr, r.stderr
    assert start_args(tmp_path / "b.tkb")[0]["mounts"]["data"]["differs_from_original"] == "a.txt"
    r = run_cli("audit", str(tmp_path / "a.tkb"), str(tmp_path / "b.tkb"), "--json")
    diffs = {d["kind"]: d for d in json.loads(r.stdout)["differences"]}
    assert r.returncode == 1 and "data: files that differ: a.txt" in diffs["mounts"]["diff"], r.stdout
    assert "command stdout" in diffs


def test_box_status_lists_the_mounts_from_the_policy_and_once_started_their_digests(signer, tmp_path):
    from tkbox_nb.box.notebook_box import NotebookBox
    ds = dataset(tmp_path)
    nb = NotebookBox(policy=Policy.from_toml(policy(ds), "p.toml"))
    assert f"mounts   data: {ds} at /data (read-only, digested when the box starts)" in nb.status(), nb.status()
    try:
        nb.ensure_box()
        assert f"mounts   data: {ds} at /data (read-only, {independent_digest(ds)[:25]}..., 3 files)" in nb.status()
    finally:
        nb.stop()


def test_a_mount_of_one_file_is_the_tree_of_one_entry_with_the_empty_path(signer, tmp_path):
    f = tmp_path / "labels.csv"
    f.write_text("id,label\n1,cat\n")
    body = hashlib.sha256(f.read_bytes()).hexdigest().encode()
    want = "tree2:sha256:" + hashlib.sha256(b"tkbox-tree-2\0" + b"".join(
        len(x).to_bytes(8, "big") + x for x in (b"", b"f-", body))).hexdigest()
    with Box(policy=policy(f, "/data/labels.csv"), bundle_path=tmp_path / "r.tkb") as box:
        r = box.run(["sh", "-c", "cat /data/labels.csv; echo more >> /data/labels.csv || echo refused"])
    assert r.stdout == b"id,label\n1,cat\nrefused\n", r.stdout + r.stderr
    assert start_args(tmp_path / "r.tkb")[0]["mounts"]["data"]["digest"] == want
    assert verify_bundle(tmp_path / "r.tkb", trust=signer.trust_path).valid


def test_a_cached_list_that_is_not_the_cached_tree_s_is_never_taken(tmp_path):
    """The warm path takes the cached tree's digest only with the list it was made with (two walks replacing the
    cache's files one at a time could pair one's tree with the other's list): another list is recomputed."""
    import tkbox_nb.bundle.mount_digest as md
    ds = dataset(tmp_path)
    home = tmp_path / "home"
    want = digest(scan(str(ds)), home)
    (cache,) = (home / "mount-cache").glob("*.list")
    cache.write_bytes(b'["a.txt","f-","' + b"0" * 64 + b'"]\n')
    assert digest(scan(str(ds)), home) == want
    assert md.parse_list(cache.read_bytes()) == md.parse_list(want[1])


def test_a_source_of_more_entries_than_the_limit_is_refused_while_it_is_walked(tmp_path, monkeypatch):
    import tkbox_nb.bundle.mount_digest as md
    ds = tmp_path / "many"
    ds.mkdir()
    for i in range(40):
        (ds / f"f{i}").write_bytes(b"x")
    monkeypatch.setattr(md, "MAX_ENTRIES", 30)
    with pytest.raises(TkboxError, match="holds more than 30 entries"):
        scan(str(ds))
