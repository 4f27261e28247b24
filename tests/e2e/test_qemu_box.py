"""Real QEMU micro-VM boxes: a guest image built from Debian, booted under TCG (or KVM where it works), no NIC.

The image is built once per machine into a persistent cache (inputs unchanged: no rebuild), with the small package
set (python3 and ipykernel) so CI spends its time on boxes rather than on pandas. Skipped, with the reason, where
QEMU is not installed or the image cannot be built (no mmdebstrap, no Debian mirror).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tkbox_nb import Box, BoxEnded, Policy
from tkbox_nb.backends.image import build_image
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.bundle.verify import verify_bundle

from .conftest import IMAGE_HOME, TEST_PACKAGES, qemu_box

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def box(signer, qemu_image, tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws")
    (ws / "data.txt").write_text("host data\n")
    b = qemu_box(qemu_image, workspace=ws, bundle_path=tmp_path_factory.mktemp("out") / "vm.tkb").start()
    b.host_workspace = ws
    yield b
    b.stop()


def sh(box, script):
    return box.run(["sh", "-c", script])


def test_command_round_trip_with_stdin_and_exit_status(box):
    r = box.run(["python3", "-c", "import sys; print(6 * 7); sys.exit(3)"])
    assert (r.exit_code, r.stdout) == (3, b"42\n")
    assert box.run(["cat"], stdin=b"through the virtio-serial door\n").stdout == b"through the virtio-serial door\n"
    big = box.run(["python3", "-c", "import sys; sys.stdout.write('x' * 3_000_000)"])
    assert big.exit_code == 0 and big.stdout == b"x" * 3_000_000


def test_the_guest_has_no_network_device(box):
    r = sh(box, "ls /sys/class/net")
    assert r.stdout.split() in ([b"lo"], [])
    r = box.run(["python3", "-c", "import socket; print(sorted(n for _, n in socket.if_nameindex()))"])
    assert r.stdout.strip() in (b"['lo']", b"[]")
    r = box.run(["python3", "-c", "import socket; socket.create_connection(('198.18.0.1', 80), timeout=2)"])
    assert r.exit_code != 0 and b"Network is unreachable" in r.stderr


DEVICES = r"""
import glob, os
def read(path):
    with open(path) as f:
        return f.read().strip()
print(sorted(read(d + "/device") for d in glob.glob("/sys/bus/virtio/devices/*")))
print(sorted(glob.glob("/sys/bus/pci/devices/*")))
acpi = {os.path.basename(d).split(":")[0] for d in glob.glob("/sys/bus/acpi/devices/*")}
print(sorted(acpi - {"LNXSYBUS", "LNXSYSTM"}))
print(sorted(l.split()[-1] for l in open("/proc/interrupts") if l.split()[0].rstrip(":").isdigit()))
print(sorted(l.split()[-1] for l in open("/proc/interrupts") if l.split()[0].rstrip(":").isdigit() and "XT-PIC" in l))
print(len(glob.glob("/sys/class/tty/ttyS*")), read("/proc/tty/driver/serial").count("uart:16550A"))
"""


def test_the_guest_finds_only_the_devices_it_was_given(box):
    """What the guest kernel found (I35): two virtio disks and the virtio console (the door), no PCI, and of the
    machine's own devices ACPI's GED and power button, three virtio-mmio slots, fw_cfg, one 16550 UART (the console)
    and the RTC; interrupts from those alone, through the one IO-APIC (no legacy PIC, no second IO-APIC)."""
    r = box.run(["python3", "-c", DEVICES])
    assert r.exit_code == 0, r.stderr
    virtio, pci, acpi, irqs, pic, serial = r.stdout.decode().splitlines()
    assert virtio == "['0x0002', '0x0002', '0x0003']" and pci == "[]"
    assert acpi == "['ACPI0013', 'LNRO0005', 'PNP0501', 'PNP0B00', 'PNP0C0C', 'QEMU0002']"
    assert irqs == "['ACPI:Ged', 'rtc0', 'ttyS0', 'virtio0', 'virtio1', 'virtio2']" and pic == "[]"
    assert serial.split()[1] == "1"  # of the ttyS* the driver makes, one port is there: the console
    r = sh(box, "dmesg | grep -c 'IOAPIC\\['")
    assert r.stdout.strip() == b"1", r


def test_it_is_a_vm_with_its_own_kernel(box):
    r = sh(box, "uname -r; cat /proc/cpuinfo | grep -c ^processor")
    kernel, cpus = r.stdout.split()
    assert b"cloud-amd64" in kernel and kernel.decode() != os.uname().release
    assert int(cpus) == 1  # box.cpus from the policy
    assert box.backend.isolation in ("vm-tcg", "vm-kvm")


def test_qemu_runs_under_seccomp_and_not_as_root(box):
    status = Path(f"/proc/{box.running.vmm_pid()}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["Seccomp"].strip() == "2"  # filter mode
    if os.geteuid() == 0:
        assert fields["Uid"].split()[:2] != ["0", "0"]


def test_root_is_read_only_and_the_workspace_is_a_guest_copy(box):
    for path in ("/usr/x", "/etc/x", "/x", "/opt/tkbox/tkbox_guest/../../x"):
        r = sh(box, f"echo x > {path}")
        assert r.exit_code != 0, path
    assert b"Read-only file system" in sh(box, "echo x > /usr/x").stderr
    r = sh(box, "grep ' / ' /proc/mounts; grep ' /run/tkbox/config ' /proc/mounts")
    assert all(b" ro," in line for line in r.stdout.splitlines()) and len(r.stdout.splitlines()) == 2
    assert sh(box, "echo y > /workspace/new.txt && cat /workspace/data.txt").stdout == b"host data\n"
    assert not (box.host_workspace / "new.txt").exists()
    assert sh(box, "echo z > /run/tkbox/config/seed/data.txt").exit_code != 0


def test_a_cell_runs_in_the_guest_ipykernel(box):
    r = box.execute("import platform; x = 20 + 22; platform.release()")
    assert r.status == "ok"
    text = r.outputs[-1]["data"]["text/plain"]
    assert "cloud-amd64" in text
    r = box.execute("x")
    assert r.outputs[-1]["data"]["text/plain"] == "42"


def test_killed_box_leaves_nothing_running_and_its_bundle_verifies(signer, qemu_image, tmp_path):
    b = qemu_box(qemu_image, bundle_path=tmp_path / "k.tkb").start()
    try:
        assert b.run(["true"]).exit_code == 0
        proc, workdir = b.running.proc, b.running._workdir
        assert proc.poll() is None and workdir.is_dir()
        assert b.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo started"]).stdout == b"started\n"
    finally:
        b.stop()
    assert proc.poll() is not None and not workdir.exists()
    assert not any(f"/proc/{pid}" for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, str(workdir)))
    report = verify_bundle(tmp_path / "k.tkb")
    assert report.valid
    import json
    import zipfile
    with zipfile.ZipFile(tmp_path / "k.tkb") as z:
        manifest = json.loads(z.read("box/manifest.json"))
    assert manifest["backend"] == "qemu" and manifest["isolation"].startswith("vm-")
    assert manifest["image_digest"] == f"tkbox-image:{qemu_image.digest}"


def test_a_guest_that_powers_off_ends_the_box(signer, qemu_image, tmp_path):
    b = qemu_box(qemu_image, bundle_path=tmp_path / "p.tkb").start()
    try:
        with pytest.raises(BoxEnded):
            b.run(["sh", "-c", "echo o > /proc/sysrq-trigger"])
        assert not b.running.alive()
    finally:
        b.stop()
    assert verify_bundle(tmp_path / "p.tkb").valid


def test_memory_vcpus_and_workspace_size_come_from_the_policy(signer, qemu_image, tmp_path):
    policy = Policy.from_toml("[box]\nmemory_mib = 384\ncpus = 2\nworkspace_mib = 8\n")
    with qemu_box(qemu_image, policy=policy, bundle_path=tmp_path / "l.tkb") as b:
        r = sh(b, "grep MemTotal /proc/meminfo; nproc; dd if=/dev/zero of=/workspace/big bs=1M count=16 2>&1")
        lines = r.stdout.decode().splitlines()
        mem_kib = int(lines[0].split()[1])
        assert 256 * 1024 < mem_kib <= 384 * 1024 and lines[1] == "2"
        assert r.exit_code != 0 and "No space left on device" in r.stdout.decode()


def test_isolation_vm_refuses_a_namespace_box():
    with pytest.raises(TkboxError, match="below the policy"):
        Box(backend="bwrap", policy=Policy.from_toml('[box]\nisolation = "vm"\n'))


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_egress_leaves_the_vm_only_through_the_door_and_is_signed(signer, qemu_image, tmp_path):
    from tkbox_nb import open_run
    from testnet import NamespaceNet, available
    if not available()[0]:
        pytest.skip(available()[1])
    from .test_egress import fetch, policy
    with NamespaceNet(index=21) as net:
        with qemu_box(qemu_image, policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "e.tkb") as b:
            out = fetch(b, "http://web.tkb.test:8080/hello.txt")
            assert out.startswith("200 hello from the test network"), out
            refused = fetch(b, "http://other.tkb.test:8080/hello.txt")
            assert refused.startswith("403") and "egress.allow" in refused
            direct = b.run(["python3", "-c", f"import socket; socket.create_connection(('{net.web}', 8080), 3)"])
            assert direct.exit_code != 0 and b"Network is unreachable" in direct.stderr
    assert verify_bundle(tmp_path / "e.tkb").valid
    rows = [c for c in open_run(tmp_path / "e.tkb").crossings() if c.door == "egress"]
    assert len(rows) >= 2


def test_unchanged_inputs_skip_the_rebuild(qemu_image):
    import time
    t = time.monotonic()
    again, built = build_image(TEST_PACKAGES, home=IMAGE_HOME, say=lambda s: None)
    assert not built and again == qemu_image and time.monotonic() - t < 5


def test_secret_is_swapped_in_on_the_host_and_never_enters_the_vm(signer, qemu_image, tmp_path, monkeypatch):
    from testnet import NamespaceNet, available
    if not available()[0]:
        pytest.skip(available()[1])
    from .test_secrets import CLIENTS, VALUE, _test_ca, secrets_policy
    monkeypatch.setenv("TKB_TEST_API_KEY", VALUE)
    chain, ca_file = _test_ca(tmp_path)
    with NamespaceNet(index=22, tls_chain=str(chain)) as net:
        net.upstream_ca = ca_file
        with qemu_box(qemu_image, policy=secrets_policy(net), bundle_path=tmp_path / "s.tkb") as b:
            r = b.run(["python3", "-c", CLIENTS["urllib"]])  # trusts the per-box CA from the config disk
            assert r.exit_code == 0, r.stderr.decode()[-1500:]
            assert "Authorization: Bearer " + "*" * len(VALUE) in r.stdout.decode()
            seen = b.run(["sh", "-c", 'printf %s "$API_KEY"; cat /run/tkbox/config/env.json /proc/cmdline'])
            assert seen.stdout.decode().startswith("tkbox-ph-") and VALUE not in seen.stdout.decode()
    assert VALUE.encode() not in (tmp_path / "s.tkb").read_bytes()
    assert verify_bundle(tmp_path / "s.tkb").valid


def test_the_patch_comes_back_from_the_vm_decided_file_by_file(signer, qemu_image, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("one\n")
    box = qemu_box(qemu_image, workspace=ws, bundle_path=tmp_path / "p.tkb", policy='[patch]\napply = "auto"\n')
    box.start()
    try:
        assert sh(box, "echo two >> a.txt; echo new > b.txt; ln -s /etc/passwd link").exit_code == 0
        patch = box.patch()
    finally:
        box.stop()
    assert {f.path: f.rule for f in patch.files} == {"a.txt": "patch.allow[0]", "b.txt": "patch.allow[0]",
                                                     "link": "patch.type"}
    assert (ws / "a.txt").read_text() == "one\ntwo\n" and (ws / "b.txt").read_text() == "new\n"
    assert not (ws / "link").exists()
    assert verify_bundle(tmp_path / "p.tkb").valid


RAW_CHAT = r'''
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps({"model": "gpt-4o-mini", "max_tokens": 20,
                     "messages": [{"role": "user", "content": "hi vm"}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")})
try:
    body = json.load(urllib.request.urlopen(req, timeout=60))
    print(json.dumps({"status": 200, "content": body["choices"][0]["message"]["content"],
                      "key": os.environ.get("OPENAI_API_KEY", "")}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()[:300]}))
'''


def test_model_calls_leave_the_vm_through_the_model_door(signer, qemu_image, tmp_path, monkeypatch):
    """The VM's model endpoint carries a call to the host's model door: the key is added on the host, a model off
    the allow list is refused there, and both are signed. (The test image has no openai package: raw HTTP.)"""
    from tkbox_nb import open_run
    from testnet import NamespaceNet, available
    if not available()[0]:
        pytest.skip(available()[1])
    from .test_models import OPENAI_KEY, Upstream, models_policy
    monkeypatch.setenv("TKB_TEST_OPENAI_KEY", OPENAI_KEY)
    monkeypatch.setenv("TKB_TEST_ANTHROPIC_KEY", "unused-anthropic-key")
    with NamespaceNet(index=22) as net:
        upstream = Upstream(net)
        try:
            with qemu_box(qemu_image, policy=models_policy(net, mode="live"), bundle_path=tmp_path / "m.tkb") as b:
                out = json.loads(b.run(["python3", "-c", RAW_CHAT]).stdout)
                refused = json.loads(b.run(["python3", "-c", RAW_CHAT.replace("gpt-4o-mini", "gpt-5-secret")]).stdout)
        finally:
            upstream.stop()
        seen = upstream.requests()
    assert out["status"] == 200 and out["content"] and OPENAI_KEY not in out["key"]
    assert refused["status"] == 403 and "models.allow" in refused["body"]
    assert len(seen) == 1 and seen[0]["authorization"] == f"Bearer {OPENAI_KEY}"
    assert verify_bundle(tmp_path / "m.tkb").valid
    calls = [c for c in open_run(tmp_path / "m.tkb").crossings() if c.door == "model"]
    assert [(c.decision, c.args["rule"]) for c in calls] == [("allow", "models.allow[0]"), ("deny", "models.allow")]


HOLD_A_VM = r'''
import sys, time
from pathlib import Path
from tkbox_nb import Box
from tkbox_nb.backends.image import Image
from tkbox_nb.backends.qemu import QemuBackend
box = Box(backend="bwrap", bundle_path=sys.argv[3])
box.backend = QemuBackend(image=Image(sys.argv[1], Path(sys.argv[2])))
box.start()
print(box.running._workdir, flush=True)
time.sleep(600)
'''


def test_a_host_process_killed_with_sigkill_leaves_no_vm_running(signer, qemu_image, tmp_path):
    """QEMU started as root drops to nobody (-runas), which clears the parent-death signal: without its PID
    namespace reaper, a host process killed with SIGKILL left its VM running."""
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", HOLD_A_VM, qemu_image.digest, str(qemu_image.path),
                             str(tmp_path / "h.tkb")], stdout=subprocess.PIPE, text=True, start_new_session=False)
    try:
        workdir = proc.stdout.readline().strip()
        assert workdir.startswith("/tmp/tkbox-vm-"), workdir
        assert any(_cmdline_has(pid, workdir) for pid in os.listdir("/proc") if pid.isdigit())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    import time
    deadline = time.monotonic() + 10
    while any(_cmdline_has(pid, workdir) for pid in os.listdir("/proc") if pid.isdigit()):
        assert time.monotonic() < deadline, "the VM outlived the host process that started it"
        time.sleep(0.2)
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)  # what the killed process could not clean up (its next start would)


# Code in the VM runs as root there, so it can take the door from the agent: stop the agent and duplicate its door
# descriptor (pidfd_getfd: the port cannot be opened twice). What it then writes is the host's hostile input.
TAKE_THE_DOOR = r"""
import ctypes, os, signal, struct, sys, time
sys.path.insert(0, "/opt/tkbox")
from tkbox_guest import protocol as p
agent = os.getppid()
os.kill(agent, signal.SIGSTOP)
[n] = [n for n in os.listdir("/proc/%d/fd" % agent)
       if os.readlink("/proc/%d/fd/%s" % (agent, n)).startswith("/dev/vport")]
fd = ctypes.CDLL(None, use_errno=True).syscall(438, os.pidfd_open(agent), int(n), 0)
assert fd >= 0, os.strerror(ctypes.get_errno())
os.write(fd, ATTACK)
time.sleep(60)
"""
VM_ATTACKS = {
    "garbage": "b'\\xff' * 64",
    "oversized frame": "struct.pack('>IBI', 100 << 20, 2, 1)",
    "too many streams": "b''.join(p.encode_json(p.OPEN, i, {}) for i in range(4, 400, 2))",
}


@pytest.mark.parametrize("attack", sorted(VM_ATTACKS))
def test_code_that_takes_the_door_in_the_vm_ends_its_own_box(signer, qemu_image, tmp_path, attack):
    """The host's end of a VM's door is the same strict parser as a bubblewrap box's: a guest that speaks nonsense
    ends its box fail-closed, the reason is signed, and the next box starts."""
    b = qemu_box(qemu_image, bundle_path=tmp_path / "h.tkb").start()
    try:
        with pytest.raises(BoxEnded, match="protocol violation|door stream"):
            b.run(["python3", "-c", TAKE_THE_DOOR.replace("ATTACK", VM_ATTACKS[attack], 1)], timeout=120)
        assert not b.running.alive()
    finally:
        b.stop()
    run = open_run(tmp_path / "h.tkb")
    assert "protocol violation" in run.box["end_reason"] or "door stream" in run.box["end_reason"]
    assert verify_bundle(tmp_path / "h.tkb").valid
    with qemu_box(qemu_image, bundle_path=tmp_path / "next.tkb") as again:
        assert again.run(["echo", "ok"]).stdout == b"ok\n"
