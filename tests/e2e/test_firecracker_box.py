"""Boxes on the Firecracker backend.

Where Firecracker can run (a KVM host that boots stock kernels, a firecracker binary of version 1.8 or later, a
built image), `test_a_real_firecracker_vm_runs_a_box` boots one. On the build machines it cannot (nested PVM, no
binary), so it skips with the reason, and the rest run the backend against a stand-in for the firecracker binary
(tests/firecracker_standin.py): the real backend (config disk, the image's kernel converted to the ELF Firecracker
boots, every API call over the Unix socket checked against Firecracker's documented schema, the hybrid-vsock door
listener) and the real guest agent behind the stand-in's vsock connection, in a bubblewrap box.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from tkbox_nb import Box, Policy
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.backends.firecracker import DOOR_PORT, FirecrackerBackend
from tkbox_nb.backends.linux_kernel import elf_info
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.bundle.verify import verify_bundle

from test_firecracker import standin_binary
from test_mounts import dataset_and_labels, independent_digest, start_args

from tkbox_nb.backends.firecracker import MAX_MOUNT_DISKS

from .test_qemu_mounts import WRITES

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not BwrapBackend().available()[0], reason="the stand-in's guest runs in bubblewrap")]


def fc_box(image, binary: str, **kw) -> Box:
    box = Box(backend="bwrap", **kw)  # then swapped: the test image and the stand-in binary
    box.backend = FirecrackerBackend(image=image, binary=binary)
    return box


def api_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def leftover(pattern: str) -> str:
    return subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.strip()


def test_a_box_runs_behind_the_firecracker_api_and_its_vsock_door(signer, qemu_image, tmp_path):
    log = tmp_path / "api.jsonl"
    exe = standin_binary(tmp_path, FC_STANDIN_LOG=str(log))
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_text("from the host\n")
    out = tmp_path / "fc.tkb"
    box = fc_box(qemu_image, exe, workspace=ws, bundle_path=out,
                 policy=Policy.from_toml("[box]\nmemory_mib = 640\ncpus = 2\nworkspace_mib = 9\n")).start()
    try:
        r = box.run(["sh", "-c", "cat /workspace/in.txt; echo err >&2; exit 3"])
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"from the host\n", b"err\n")
        cell = box.execute("6 * 7")
        assert cell.status == "ok" and cell.outputs[-1]["data"]["text/plain"] == "42"
        workdir = Path(box.running._workdir)
        assert workdir.is_dir() and not Path(f"{workdir}/v.sock_{DOOR_PORT}").exists()  # unlinked once connected
    finally:
        box.stop()
    assert not workdir.exists()
    assert not leftover(str(workdir))

    calls = api_log(log)
    assert [(c["method"], c["path"]) for c in calls] == [
        ("PUT", "/machine-config"), ("PUT", "/boot-source"), ("PUT", "/drives/root"), ("PUT", "/drives/cfg"),
        ("PUT", "/vsock"), ("PUT", "/actions")]
    assert calls[0]["body"] == {"vcpu_count": 2, "mem_size_mib": 640, "smt": False}
    boot = calls[1]["body"]
    assert "tkbox.ws=9" in boot["boot_args"]
    assert Path(boot["kernel_image_path"]) == qemu_image.path / "vmlinux"
    assert elf_info((qemu_image.path / "vmlinux").read_bytes()).pvh_note  # Firecracker boots it through PVH
    assert boot["initrd_path"] == str(qemu_image.initrd)
    assert calls[2]["body"]["path_on_host"] == str(qemu_image.root)

    assert verify_bundle(out).valid
    with zipfile.ZipFile(out) as z:
        manifest = json.loads(z.read("box/manifest.json"))
    assert (manifest["backend"], manifest["isolation"]) == ("firecracker", "vm-kvm")
    assert manifest["image_digest"] == f"tkbox-image:{qemu_image.digest}"


def test_a_call_firecracker_refuses_stops_the_start_and_leaves_nothing(signer, qemu_image, tmp_path):
    """Firecracker answers 400 with a fault message: the box does not start, says why, and leaves no process."""
    exe = standin_binary(tmp_path, FC_STANDIN_REFUSE="/vsock")
    box = fc_box(qemu_image, exe, bundle_path=tmp_path / "x.tkb")
    before = set(Path("/tmp").glob("tkbox-fc-*"))
    with pytest.raises(TkboxError, match=r"firecracker refused PUT /vsock \(HTTP 400: refused by the test\)"):
        box.start()
    box.stop()
    assert not leftover("firecracker_standin")
    assert set(Path("/tmp").glob("tkbox-fc-*")) <= before  # its working directory went with it


def test_a_firecracker_box_reads_its_mounts_from_read_only_drives_and_signs_their_digests(signer, qemu_image, tmp_path):
    """Two mounts (a folder, a file), each the cached disk QEMU gets, as a read-only drive; the stand-in's guest finds
    each by the UUID the config disk names and binds its extracted content read-only at the target (docs/backends.md
    says what only a real Firecracker shows: the guest kernel's ro,noexec mount)."""
    log = tmp_path / "api.jsonl"
    ds, labels, toml = dataset_and_labels(tmp_path)
    box = fc_box(qemu_image, standin_binary(tmp_path, FC_STANDIN_LOG=str(log)), bundle_path=tmp_path / "m.tkb",
                 policy=Policy.from_toml(toml, "p.toml")).start()
    writes = WRITES.replace('    "exec": lambda: subprocess.run(["/data/run.sh"], check=True),\n', "")
    assert writes != WRITES  # (the stand-in's bind is not noexec: a guest kernel's mount is, tests/e2e/test_qemu_*)
    try:
        r = box.run(["sh", "-c", "sha256sum /data/sub/b.bin; cat /data/a.txt /labels.csv; readlink /data/inside-link"])
        w = box.run(["python3", "-c", writes])
    finally:
        box.stop()
    want = hashlib.sha256((ds / "sub" / "b.bin").read_bytes()).hexdigest()
    assert r.exit_code == 0 and r.stdout.decode().splitlines() == [f"{want}  /data/sub/b.bin", "alpha", "id,label",
                                                                   "sub/b.bin"], r
    said = w.stdout.decode()
    assert w.exit_code == 0 and "WROTE" not in said and said.count("refused") == 12, (said, w.stderr)
    assert (ds / "a.txt").read_text() == "alpha\n" and labels.read_text() == "id,label\n"

    start, stop = start_args(tmp_path / "m.tkb")
    assert start["backend"] == "firecracker" and "mounts_changed" not in stop
    assert start["mounts"]["data"] == {"target": "/data", "digest": independent_digest(ds), "files": 3,
                                       "bytes": 6 + 10240 + 10}
    assert start["mounts"]["labels"]["target"] == "/labels.csv"
    drives = {c["path"]: c["body"] for c in api_log(log) if c["path"].startswith("/drives/m")}
    cache = signer.home / "mount-cache" / "disks"
    assert drives == {f"/drives/m{i}": {"drive_id": f"m{i}", "is_root_device": False, "is_read_only": True,
                                        "path_on_host": str(cache / f"{start['mounts'][name]['digest'][-64:]}.img")}
                      for i, name in enumerate(("data", "labels"))}
    boot = next(c["body"] for c in api_log(log) if c["path"] == "/boot-source")
    assert boot["boot_args"].endswith(" tkbox.mounts=2")
    assert verify_bundle(tmp_path / "m.tkb", trust=signer.trust_path).valid


def test_more_mounts_than_a_firecracker_box_takes_are_refused_in_one_line(signer, qemu_image, tmp_path):
    log = tmp_path / "api.jsonl"
    toml = ""
    for i in range(MAX_MOUNT_DISKS + 1):
        (tmp_path / f"f{i}.csv").write_text(f"{i}\n")
        toml += f'[mounts.m{i}]\nsource = "{tmp_path / f"f{i}.csv"}"\ntarget = "/d{i}.csv"\n'
    box = fc_box(qemu_image, standin_binary(tmp_path, FC_STANDIN_LOG=str(log)), bundle_path=tmp_path / "x.tkb",
                 policy=Policy.from_toml(toml, "p.toml"))
    cache = signer.home / "mount-cache" / "disks"
    before = set(cache.glob("*")) if cache.is_dir() else set()
    with pytest.raises(TkboxError) as e:
        box.start()
    box.stop()
    assert str(e.value) == (f"[mounts]: a firecracker box takes at most {MAX_MOUNT_DISKS} mounts (the guest's init), "
                            f"this policy has {MAX_MOUNT_DISKS + 1}")
    assert not log.exists() and (set(cache.glob("*")) if cache.is_dir() else set()) == before  # no VMM, no disk


def test_a_real_firecracker_vm_runs_a_box(signer, tmp_path):
    backend = FirecrackerBackend()
    ok, why = backend.available()
    if not ok:
        pytest.skip(f"Firecracker cannot run here: {why}")
    box = Box(backend="firecracker", bundle_path=tmp_path / "real.tkb").start()
    try:
        r = box.run(["sh", "-c", "ls /sys/class/net; cat /proc/cmdline"])
        assert r.stdout.split(b"\n")[0] == b"lo" and b"tkbox.door=vsock" in r.stdout
    finally:
        box.stop()
    assert verify_bundle(tmp_path / "real.tkb").ok
    assert os.path.exists(tmp_path / "real.tkb")
