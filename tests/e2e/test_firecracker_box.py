"""Boxes on the Firecracker backend.

Where Firecracker can run (a KVM host that boots stock kernels, a firecracker binary of version 1.8 or later, a
built image), `test_a_real_firecracker_vm_runs_a_box` boots one. On the build machines it cannot (nested PVM, no
binary), so it skips with the reason, and the rest run the backend against a stand-in for the firecracker binary
(tests/firecracker_standin.py): the real backend (config disk, the image's kernel converted to the ELF Firecracker
boots, every API call over the Unix socket checked against Firecracker's documented schema, the hybrid-vsock door
listener) and the real guest agent behind the stand-in's vsock connection, in a bubblewrap box.
"""

from __future__ import annotations

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
