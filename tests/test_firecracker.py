"""The Firecracker backend's parts that need no VM: the API requests against Firecracker's documented schema, the
version and requirement checks, the jailer's command line, the guest's door port, and `tkbox doctor`'s report."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tkbox_nb.backends.base import BoxSpec
from tkbox_nb.backends.firecracker import (DOOR_PORT, MAX_MOUNT_DISKS, MIN_VERSION, FirecrackerApi,
                                           FirecrackerBackend, api_requests, boot_args, fault_message, jail_root,
                                           jailer_argv, parse_version)
from tkbox_nb.backends.registry import get_backend
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.guest.vm import vsock_port
from tkbox_nb.policy import Policy, PolicyError

from conftest import run_cli
from firecracker_standin import check

STANDIN = Path(__file__).resolve().parent / "firecracker_standin.py"


def standin_binary(tmp_path: Path, **env: str) -> str:
    """An executable `firecracker` that is the stand-in, with its settings baked in (the backend starts its VMM with
    a clean environment)."""
    import sys
    exe = tmp_path / "firecracker"
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    exe.write_text(f"#!/bin/sh\n{exports}exec {sys.executable} {STANDIN} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def spec(**kw) -> BoxSpec:
    return BoxSpec(box_id="b1", seed=None, **kw)


def test_every_request_holds_to_the_documented_api_and_no_nic_is_ever_configured():
    reqs = api_requests(spec(memory_mib=768, cpus=3, workspace_mib=99), "/k", "/i", "/r.img", "/c.img", "/t/v.sock")
    assert [(m, p) for m, p, _ in reqs] == [("PUT", "/machine-config"), ("PUT", "/boot-source"),
                                            ("PUT", "/drives/root"), ("PUT", "/drives/cfg"), ("PUT", "/vsock"),
                                            ("PUT", "/actions")]
    for _, path, body in reqs:
        assert check(path, body) is None, (path, body)
    bodies = {p: b for _, p, b in reqs}
    assert bodies["/machine-config"] == {"vcpu_count": 3, "mem_size_mib": 768, "smt": False}
    assert all(bodies[f"/drives/{d}"]["is_read_only"] is True for d in ("root", "cfg"))
    assert bodies["/vsock"] == {"guest_cid": 3, "uds_path": "/t/v.sock"}
    assert bodies["/actions"] == {"action_type": "InstanceStart"}
    assert f"tkbox.door=vsock:{DOOR_PORT}" in bodies["/boot-source"]["boot_args"]
    assert "tkbox.ws=99" in bodies["/boot-source"]["boot_args"]
    assert not any("network" in p for _, p, _ in reqs)


def test_the_schema_check_refuses_what_firecracker_refuses():
    """The stand-in's checks must be able to fail, or the test above proves nothing."""
    assert "unknown field" in check("/machine-config", {"vcpu_count": 1, "mem_size_mib": 1, "ht_enabled": True})
    assert "missing field" in check("/vsock", {"uds_path": "/x"})
    assert "out of range" in check("/vsock", {"guest_cid": 2, "uds_path": "/x"})
    assert "invalid type" in check("/drives/root", {"drive_id": "root", "is_root_device": "no"})
    assert "does not match" in check("/drives/root", {"drive_id": "cfg", "is_root_device": False})
    assert "unknown variant" in check("/actions", {"action_type": "Reboot"})
    # a virtio-block drive must say whether it is read-only; a vhost-user one names a socket and nothing of a file
    assert "`is_read_only` is required" in check("/drives/m0", {"drive_id": "m0", "is_root_device": False,
                                                                "path_on_host": "/d.img"})
    assert "`path_on_host` is required" in check("/drives/m0", {"drive_id": "m0", "is_root_device": False,
                                                                "is_read_only": True})
    assert "should be omitted" in check("/drives/m0", {"drive_id": "m0", "is_root_device": False, "socket": "/s",
                                                       "is_read_only": True})
    assert check("/drives/m0", {"drive_id": "m0", "is_root_device": False, "socket": "/s"}) is None


def test_each_mount_is_one_more_read_only_drive_and_the_boot_args_count_them():
    """Mount I's disk is the drive mI, read-only, at the path given; `tkbox.mounts=N` tells the guest's init (the
    config disk names each target and its disk's UUID); more mounts than the guest takes are refused."""
    disks = [("/cache/aa.img", "/data"), ("/cache/bb.img", "/labels.csv")]
    s = spec(disks=disks, mounts=[("/src/a", "/data"), ("/src/b", "/labels.csv")])
    reqs = api_requests(s, "/k", "/i", "/r.img", "/c.img", "/t/v.sock", disks=[d for d, _ in disks])
    assert [p for _, p, _ in reqs] == ["/machine-config", "/boot-source", "/drives/root", "/drives/cfg",
                                       "/drives/m0", "/drives/m1", "/vsock", "/actions"]
    for _, path, body in reqs:
        assert check(path, body) is None, (path, body)
    bodies = {p: b for _, p, b in reqs}
    assert bodies["/drives/m0"] == {"drive_id": "m0", "path_on_host": "/cache/aa.img", "is_root_device": False,
                                    "is_read_only": True}
    assert bodies["/drives/m1"]["path_on_host"] == "/cache/bb.img" and bodies["/drives/m1"]["is_read_only"] is True
    assert bodies["/boot-source"]["boot_args"].endswith(f"tkbox.door=vsock:{DOOR_PORT} tkbox.mounts=2")
    assert "tkbox.mounts" not in boot_args(spec())
    with pytest.raises(TkboxError, match=f"at most {MAX_MOUNT_DISKS} dataset mounts"):
        api_requests(s, "/k", "/i", "/r.img", "/c.img", "/t/v.sock", disks=["/cache/aa.img"])  # one not given
    many = [(f"/cache/{i}.img", f"/d{i}") for i in range(MAX_MOUNT_DISKS + 1)]
    with pytest.raises(TkboxError, match=f"at most {MAX_MOUNT_DISKS} dataset mounts"):
        api_requests(spec(disks=many), "/k", "/i", "/r.img", "/c.img", "/v", disks=[d for d, _ in many])


def test_more_mounts_than_the_guest_takes_are_refused_in_one_line_before_any_disk_is_made(tmp_path):
    with pytest.raises(TkboxError) as e:
        FirecrackerBackend(binary="/bin/true").mount_disks([object()] * (MAX_MOUNT_DISKS + 1), tmp_path)
    assert str(e.value) == (f"[mounts]: a firecracker box takes at most {MAX_MOUNT_DISKS} mounts (the guest's init), "
                            f"this policy has {MAX_MOUNT_DISKS + 1}")
    assert list(tmp_path.iterdir()) == []
    assert FirecrackerBackend(binary="/bin/true").mount_disks([], tmp_path) == []


def test_a_mount_not_given_as_a_drive_never_starts_a_firecracker_box(tmp_path):
    """Fail closed: a spec whose mounts are not each a disk (a caller that skipped Backend.mount_disks) is refused
    before anything is made or started, not booted without the data or with the wrong disk at a target."""
    log = tmp_path / "api.jsonl"
    backend = FirecrackerBackend(binary=standin_binary(tmp_path, FC_STANDIN_LOG=str(log)))
    with pytest.raises(TkboxError, match="mounts must each be given as a disk"):
        backend.start(spec(mounts=[(str(tmp_path), "/data")]))
    assert not log.exists()


def test_the_standin_gives_its_guest_read_only_drives_only(tmp_path):
    """Firecracker takes a writable drive; the stand-in refuses one, as its guest could not keep it unchanged (so a
    test against it cannot pass with a drive the backend forgot to make read-only)."""
    import subprocess
    import time
    sock = tmp_path / "api.sock"
    proc = subprocess.Popen([standin_binary(tmp_path), "--api-sock", str(sock), "--id", "t"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            if sock.exists():
                break
            time.sleep(0.01)
        api = FirecrackerApi(sock)
        try:
            for ro in (False, None):
                body = {"drive_id": "m0", "path_on_host": "/x.img", "is_root_device": False}
                with pytest.raises(TkboxError, match="read-only drives only, and m0 is not read-only" if ro is False
                                   else "`is_read_only` is required"):
                    api.call("PUT", "/drives/m0", body if ro is None else {**body, "is_read_only": ro})
            api.call("PUT", "/drives/m0", {"drive_id": "m0", "path_on_host": "/x.img", "is_root_device": False,
                                           "is_read_only": True})
        finally:
            api.close()
    finally:
        proc.kill()
        proc.wait()


def test_cpus_are_clamped_to_what_firecracker_takes():
    assert api_requests(spec(cpus=64), "k", "i", "r", "c", "v")[0][2]["vcpu_count"] == 32
    assert api_requests(spec(cpus=0), "k", "i", "r", "c", "v")[0][2]["vcpu_count"] == 1


@pytest.mark.parametrize("text,want", [
    ("Firecracker v1.10.1\n", (1, 10, 1)), ("Firecracker v1.8.0-dev\n\nextra", (1, 8, 0)),
    ("Firecracker v1.7.0", (1, 7, 0)), ("firecracker 1.10", None), ("", None), ("Firecracker v1.10.1 junk", None),
    ("Firecracker v99999.1.1", None)])
def test_version_lines_are_parsed_strictly(text, want):
    assert parse_version(text) == want


def test_fault_messages_are_bounded_and_on_one_line():
    assert fault_message(400, b'{"fault_message": "bad\\nthing"}') == "HTTP 400: bad thing"
    assert fault_message(500, b"x" * 1000) == "HTTP 500: " + "x" * 200
    assert fault_message(400, b"") == "HTTP 400"
    assert len(fault_message(400, b'{"fault_message": "' + b"y" * 5000 + b'"}')) < 320


def test_boot_args_name_the_door_and_workspace_only():
    assert boot_args(spec(workspace_mib=7)) == ("console=ttyS0 reboot=k panic=-1 pci=off quiet tkbox.ws=7 "
                                                f"tkbox.door=vsock:{DOOR_PORT}")


@pytest.mark.parametrize("cmdline,want", [
    ("console=ttyS0 tkbox.ws=5", None), (f"quiet tkbox.door=vsock:{DOOR_PORT}", DOOR_PORT),
    ("tkbox.door=vsock:1", 1)])
def test_the_guest_reads_its_door_port_from_the_command_line(cmdline, want):
    assert vsock_port(cmdline) == want


@pytest.mark.parametrize("bad", ["tkbox.door=vsock:", "tkbox.door=vsock:-1", "tkbox.door=vsock:0",
                                 "tkbox.door=vsock:99999999999", "tkbox.door=vsock:1x"])
def test_a_bad_door_port_stops_the_guest_agent(bad):
    with pytest.raises(SystemExit, match="bad door port"):
        vsock_port(bad)


def test_the_jailer_runs_firecracker_as_nobody_in_its_own_chroot(tmp_path):
    argv = jailer_argv("/usr/bin/jailer", "/opt/fc/firecracker", "box7", tmp_path)
    assert argv[:3] == ["/usr/bin/jailer", "--id", "box7"]
    assert argv[argv.index("--uid") + 1] == argv[argv.index("--gid") + 1] == "65534"
    assert argv[argv.index("--exec-file") + 1] == "/opt/fc/firecracker"
    assert argv[argv.index("--chroot-base-dir") + 1] == str(tmp_path)
    assert argv[argv.index("--") + 1:] == ["--api-sock", "/api.sock"]
    assert "--new-pid-ns" not in argv and "--daemonize" not in argv  # the box's process stays the VM's
    assert jail_root(tmp_path, "/opt/fc/firecracker", "box7") == tmp_path / "firecracker" / "box7" / "root"


def test_the_jailer_is_refused_for_other_backends_and_is_a_policy_boolean():
    with pytest.raises(TkboxError, match="jailer is Firecracker's"):
        get_backend("qemu", jailer=True)
    with pytest.raises(TkboxError, match="jailer is Firecracker's"):
        get_backend("bwrap", jailer=True)
    assert Policy.from_toml("[box]\njailer = true\n").get("box", "jailer") is True
    with pytest.raises(PolicyError, match="box.jailer"):
        Policy.from_toml('[box]\njailer = "yes"\n')


def test_checks_name_each_missing_requirement(tmp_path, monkeypatch):
    monkeypatch.delenv("TKBOX_FIRECRACKER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("TKBOX_HOME", str(tmp_path / "home"))
    checks = {w: (ok, d) for w, ok, d in FirecrackerBackend().checks()}
    assert checks["binary"][0] is False and "TKBOX_FIRECRACKER" in checks["binary"][1]
    assert checks["version"][0] is None
    assert checks["image"] == (False, "no guest image built (tkbox image build)")
    ok, why = FirecrackerBackend().available()
    assert not ok and "no firecracker binary" in why

    old = standin_binary(tmp_path, FC_STANDIN_VERSION="Firecracker v1.7.0")
    checks = {w: (ok, d) for w, ok, d in FirecrackerBackend(binary=old).checks()}
    assert checks["binary"] == (True, old)
    assert checks["version"][0] is False and f"{MIN_VERSION[0]}.{MIN_VERSION[1]}.0 or later" in checks["version"][1]

    good = standin_binary(tmp_path, FC_STANDIN_VERSION="Firecracker v1.10.1")
    checks = {w: (ok, d) for w, ok, d in FirecrackerBackend(binary=good, jailer=True).checks()}
    assert checks["version"] == (True, "Firecracker v1.10.1")
    assert checks["jailer"][0] is False and "TKBOX_JAILER" in checks["jailer"][1]
    kvm = checks["kvm"]
    assert kvm[0] == (os.path.exists("/dev/kvm") and not Path("/sys/module/kvm_pvm").exists()), kvm


def test_an_explicit_firecracker_box_without_a_binary_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("TKBOX_FIRECRACKER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(TkboxError, match="no firecracker binary"):
        FirecrackerBackend().start(spec())


def test_doctor_prints_every_firecracker_check(tmp_path):
    exe = standin_binary(tmp_path, FC_STANDIN_VERSION="Firecracker v1.10.1")
    r = run_cli("doctor", env={"TKBOX_HOME": str(tmp_path / "home"), "TKBOX_FIRECRACKER": exe})
    lines = r.stdout.splitlines()
    fc = next(i for i, line in enumerate(lines) if line.startswith("firecracker"))
    block = "\n".join(lines[fc:fc + 6])
    assert f"binary   ok  {exe}" in block
    assert "version  ok  Firecracker v1.10.1" in block
    assert "kvm " in block and "image    no  no guest image built" in block
    assert "boot     -   not tried" in block
