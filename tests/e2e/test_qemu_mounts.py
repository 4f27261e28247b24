"""Dataset mounts ([mounts.NAME]) in a real QEMU box: each a read-only virtio-blk disk holding an ext4 image of a copy
of the source (made with `mke2fs -d`, never mounted on the host), cached by the mount's signed digest; the guest
mounts it ro,nodev,nosuid,noexec at the target. The digest signed at the start and the check at the stop are
bubblewrap's (tests/test_mounts.py holds those and the policy's refusals)."""

from __future__ import annotations

import hashlib
import os

import pytest
from test_mounts import WRITE_TRIES, dataset, dataset_and_labels, independent_digest, start_args

from tkbox_nb.backends.microvm import mount_disk
from tkbox_nb.backends.mounts import prepare
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.policy import Policy

from .conftest import qemu_box

pytestmark = pytest.mark.slow

WRITES = r"""
import ctypes, mmap, os, subprocess
tries = {
""" + WRITE_TRIES + r"""    "exec": lambda: subprocess.run(["/data/run.sh"], check=True),
    "file": lambda: open("/labels.csv", "a").write("x"),
}


def remount(flags):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, b"/data", None, flags, None) != 0:
        raise OSError(ctypes.get_errno(), "mount")


def write_after_a_bind_remount():
    try:  # MS_REMOUNT | MS_BIND: this mount's own flags cleared (root in its guest may); its file system stays ro
        remount(32 | 4096)
    except OSError:
        pass
    open("/data/new.txt", "x")


tries["remount"] = lambda: remount(32)  # MS_REMOUNT: the disk's file system read-write
tries["write after a bind remount"] = write_after_a_bind_remount
for name, f in tries.items():
    try:
        f()
        print("WROTE", name)
    except (OSError, subprocess.CalledProcessError):
        print("refused", name)
print(open("/data/a.txt").read().strip(), open("/labels.csv").read().strip())
"""


def test_a_qemu_box_reads_its_mounts_from_read_only_disks_and_signs_their_digests(signer, qemu_image, tmp_path):
    ds, labels, mounts = dataset_and_labels(tmp_path)
    toml = '[box]\nbackend = "bwrap"\n' + mounts
    box = qemu_box(qemu_image, policy=toml, bundle_path=tmp_path / "r.tkb")
    with box:
        r = box.run(["sh", "-c", "sha256sum /data/sub/b.bin; cat /data/a.txt /labels.csv; readlink /data/inside-link;"
                     " grep -E ' (/data|/labels.csv) ' /proc/mounts; grep -c ' / overlay ro,' /proc/mounts"])
        w = box.run(["python3", "-c", WRITES])
    out = r.stdout.decode()
    assert r.exit_code == 0, r.stderr
    want = hashlib.sha256((ds / "sub" / "b.bin").read_bytes()).hexdigest()
    lines = out.splitlines()
    assert lines[:4] == [f"{want}  /data/sub/b.bin", "alpha", "id,label", "sub/b.bin"], out
    mounts = lines[4:6]  # each the dataset disk's ext4, mounted with every flag a read-only mount should have
    assert len(mounts) == 2 and all(m.split()[2] == "ext4" and {"ro", "nosuid", "nodev", "noexec"} <= set(
        m.split()[3].split(",")) for m in mounts), out
    assert lines[6] == "1", out  # the root: made read-only again once the targets were made
    assert w.exit_code == 0, w.stderr
    said = w.stdout.decode()
    assert "WROTE" not in said and said.count("refused") == 13 and said.endswith("alpha id,label\n"), said
    # the host's data is as it was
    assert (ds / "a.txt").read_text() == "alpha\n" and labels.read_text() == "id,label\n"
    assert sorted(os.listdir(ds)) == ["a.txt", "inside-link", "run.sh", "sub"]
    start, stop = start_args(tmp_path / "r.tkb")
    assert start["backend"] == "qemu" and start["boot"] == "cold"
    assert start["mounts"]["data"] == {"target": "/data", "digest": independent_digest(ds), "files": 3,
                                       "bytes": 6 + 10240 + 10}
    assert start["mounts"]["labels"]["target"] == "/labels.csv" and "mounts_changed" not in stop
    assert verify_bundle(tmp_path / "r.tkb", trust=signer.trust_path).valid
    # each disk cached by its digest: a second box's reuses it, made no second time
    disks = sorted((signer.home / "mount-cache" / "disks").glob("*.img"))
    assert [d.name for d in disks] == sorted(f"{m['digest'].rsplit(':', 1)[1]}.img" for m in start["mounts"].values())
    inodes = [d.stat().st_ino for d in disks]
    again = box.backend.mount_disks(prepare(Policy.from_toml(toml, "p.toml"), signer.home, "qemu"), signer.home)
    assert sorted(os.stat(d).st_ino for d, _ in again) == sorted(inodes)


def test_a_disk_is_made_only_from_a_copy_whose_digest_is_the_signed_one(signer, tmp_path):
    """The box reads what was signed: a source that changed between its digest and its disk is refused, no disk kept."""
    ds = dataset(tmp_path)
    (m,) = prepare(Policy.from_toml(f'[mounts.data]\nsource = "{ds}"\ntarget = "/data"\n', "p.toml"), signer.home,
                   "qemu")
    (ds / "a.txt").write_text("changed after the digest\n")
    cache = tmp_path / "disks"
    with pytest.raises(TkboxError) as e:
        mount_disk(m.source, m.digest, cache)
    assert "changed while its disk was made" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert list(cache.iterdir()) == []
    (ds / "a.txt").write_text("alpha\n")
    disk = mount_disk(m.source, m.digest, cache)
    assert disk.name == m.digest.rsplit(":", 1)[1] + ".img" and oct(disk.stat().st_mode & 0o777) == "0o600"
    with open(disk, "rb") as f:  # an ext4 image labelled as a dataset's (never the root's or the config's)
        f.seek(1024 + 56)
        assert f.read(2) == b"\x53\xef"
        f.seek(1024 + 120)
        assert f.read(16).rstrip(b"\0") == b"tkbox-data"
