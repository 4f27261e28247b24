"""The Firecracker backend: each box is a Firecracker micro-VM with no network interface, on a KVM host.

Firecracker is driven through its API socket (httpx over a Unix socket): machine config, boot source (the image's
kernel as the uncompressed ELF Firecracker boots, made once from its bzImage by linux_kernel.py), the image's root
disk and the box's config disk (both read-only), one read-only drive per dataset mount (the disk QEMU gets: an ext4
image of a copy of the source whose digest is the signed one, cached by it), a vsock device, then InstanceStart. No
network interface is ever configured, so the guest has none. The door is hybrid vsock: the guest agent connects to
CID 2 on DOOR_PORT, and Firecracker connects that stream to `<uds_path>_<DOOR_PORT>` on the host, where this process
listens before the VM starts. The workspace is a tmpfs inside the guest that the host never mounts, as with QEMU.

With `jailer`, Firecracker runs under its jailer: chrooted into a directory holding only this box's files, as an
unprivileged uid and gid, in new mount and PID namespaces. Without it (the default), Firecracker runs as this user
with its own seccomp filters only. Both are documented in docs/backends.md.

The guest image (kernel, initramfs, root) is the QEMU backend's: `tkbox image build`. Debian's cloud kernel has no
CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES, so it finds Firecracker's devices through ACPI, which Firecracker gives x86_64
guests from version 1.8 on: older versions are refused by `available()`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tkbox_nb.core import scratch
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.backends.base import BoxSpec
from tkbox_nb.backends.image import Image, current_image
from tkbox_nb.backends.microvm import (ImageBackend, VmRunning, accept_door, config_disk, kvm_usable, mount_disks,
                                       reaped_with_us, stop_process_group, vmm_limits)

DOOR_PORT = 1024          # the guest's vsock port for the door (ports below 1024 are privileged in the guest)
GUEST_CID = 3             # the lowest CID a guest may have; each VM has its own vsock device, so they never clash
MIN_VERSION = (1, 8, 0)   # ACPI device discovery on x86_64
API_TIMEOUT_S = 10.0
API_REPLY_MAX = 64 << 10
VERSION_RE = re.compile(r"^Firecracker v(\d{1,4})\.(\d{1,4})\.(\d{1,6})(?:[-+][\w.-]{0,64})?$")
DRIVE_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
JAIL_UID = JAIL_GID = 65534  # nobody, nogroup
# The guest's init takes 1 to 5 dataset mounts (tkbox.mounts=[1-5], as for QEMU). Firecracker itself would take more:
# on x86_64 each virtio-mmio device has one of the IRQs 5 to 23 (19, some of which its ACPI devices use), and the
# root, config and vsock devices take three.
MAX_MOUNT_DISKS = 5


def parse_version(text: str) -> tuple[int, int, int] | None:
    """`firecracker --version`'s first line ("Firecracker v1.10.1") as a tuple, or None."""
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    m = VERSION_RE.match(line)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def boot_args(spec: BoxSpec) -> str:
    """The guest kernel's command line: serial console, reset on reboot (Firecracker exits), no PCI probing, the
    workspace size, the door's vsock port and the number of dataset mounts for the init (as QEMU's)."""
    mounts = f" tkbox.mounts={len(spec.disks)}" if spec.disks else ""
    return (f"console=ttyS0 reboot=k panic=-1 pci=off quiet tkbox.ws={int(spec.workspace_mib)} "
            f"tkbox.door=vsock:{DOOR_PORT}{mounts}")


def api_requests(spec: BoxSpec, kernel: str, initrd: str, root: str, config: str, vsock_uds: str,
                 disks: list[str] = ()) -> list[tuple[str, str, dict]]:
    """The API calls that configure and start one box, in order, as (method, path, JSON body). Paths are as
    Firecracker sees them (inside its chroot under the jailer). There is no /network-interfaces call: no NIC. Each
    dataset mount's disk (`disks`, in the order of `spec.disks`) is one more read-only drive, `mI`; the guest finds
    mount I's by the file system UUID the config disk names, never by the drive's order or id."""
    if len(disks) != len(spec.disks) or len(disks) > MAX_MOUNT_DISKS:
        raise TkboxError(f"a firecracker box takes at most {MAX_MOUNT_DISKS} dataset mounts, each one drive")
    cpus = max(1, min(int(spec.cpus), 32))  # without SMT, any count from 1 to 32
    requests = [
        ("PUT", "/machine-config", {"vcpu_count": cpus, "mem_size_mib": int(spec.memory_mib), "smt": False}),
        ("PUT", "/boot-source", {"kernel_image_path": kernel, "initrd_path": initrd, "boot_args": boot_args(spec)}),
    ]
    for drive_id, path in (("root", root), ("cfg", config), *((f"m{i}", d) for i, d in enumerate(disks))):
        requests.append(("PUT", f"/drives/{drive_id}", {"drive_id": drive_id, "path_on_host": path,
                                                         "is_root_device": False, "is_read_only": True}))
    requests.append(("PUT", "/vsock", {"guest_cid": GUEST_CID, "uds_path": vsock_uds}))
    requests.append(("PUT", "/actions", {"action_type": "InstanceStart"}))
    return requests


def fault_message(status: int, body: bytes) -> str:
    """What Firecracker said when it refused a call: its `fault_message`, bounded and on one line."""
    import json
    text = ""
    if len(body) <= API_REPLY_MAX:
        try:
            doc = json.loads(body.decode("utf-8"))
            if isinstance(doc, dict) and isinstance(doc.get("fault_message"), str):
                text = doc["fault_message"]
        except (UnicodeDecodeError, ValueError):
            pass
    text = " ".join((text or body[:200].decode("utf-8", "replace")).split())[:300]
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def jailer_argv(jailer: str, firecracker: str, box_id: str, chroot_base: Path) -> list[str]:
    """The jailer's command line: this box's id, the Firecracker binary it copies into the jail, the uid and gid it
    drops to; Firecracker's own arguments after `--` (its API socket, inside the jail). Not `--new-pid-ns`: the jailer
    would fork and exit, and the box's process would no longer be the VM's."""
    return [jailer, "--id", box_id, "--exec-file", firecracker, "--uid", str(JAIL_UID), "--gid", str(JAIL_GID),
            "--chroot-base-dir", str(chroot_base), "--", "--api-sock", "/api.sock"]


def jail_root(chroot_base: Path, firecracker: str, box_id: str) -> Path:
    """Where the jailer chroots Firecracker: <base>/<exec file name>/<id>/root."""
    return chroot_base / Path(firecracker).name / box_id / "root"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def find_executable(env_var: str, name: str) -> str | None:
    """The executable $`env_var` names, else `name` on PATH; None unless it is an executable file."""
    exe = os.environ.get(env_var) or shutil.which(name)
    return exe if exe and os.path.isfile(exe) and os.access(exe, os.X_OK) else None


def find_firecracker() -> str | None:
    return find_executable("TKBOX_FIRECRACKER", "firecracker")


def find_jailer() -> str | None:
    return find_executable("TKBOX_JAILER", "jailer")


def firecracker_version(exe: str) -> tuple[tuple[int, int, int] | None, str]:
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{exe} --version failed: {e}"
    out = r.stdout.decode("utf-8", "replace")
    version = parse_version(out)
    return version, (out.strip().splitlines() or ["(nothing)"])[0][:80]


class FirecrackerApi:
    """Firecracker's API on its Unix socket, with httpx; every call must answer 204 or the box does not start."""

    def __init__(self, path: Path):
        import httpx
        self._client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost",
                                    timeout=API_TIMEOUT_S)

    def call(self, method: str, path: str, body: dict) -> None:
        r = self._client.request(method, path, json=body)
        if r.status_code != 204:
            raise TkboxError(f"firecracker refused {method} {path} ({fault_message(r.status_code, r.content)})")

    def close(self) -> None:
        self._client.close()


def wait_for_socket(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            out = proc.stdout.read1(4096).decode("utf-8", "replace").strip()
            last = out.splitlines()[-1][:300] if out else proc.returncode
            raise TkboxError(f"firecracker exited before its API socket appeared ({last})")
        if time.monotonic() > deadline:
            raise TkboxError(f"firecracker made no API socket within {timeout_s:.0f} s")
        time.sleep(0.01)


class FirecrackerBackend(ImageBackend):
    name = "firecracker"
    isolation = "vm-kvm"
    ready_timeout_s = 30.0
    kernel_ready_s = 90.0

    def __init__(self, image: Image | None = None, binary: str | None = None, jailer: bool = False):
        self._image = image
        self.binary = binary or find_firecracker()
        self.jailer = jailer

    def checks(self) -> list[tuple[str, bool | None, str]]:
        """Each requirement as (what, ok, detail), in the order a user would fix them; None: not checked, because an
        earlier one failed. `tkbox doctor` prints them all."""
        out: list[tuple[str, bool | None, str]] = []
        if not self.binary:
            out.append(("binary", False, "no firecracker binary (install a release from "
                        "github.com/firecracker-microvm/firecracker as /usr/local/bin/firecracker, or set "
                        "TKBOX_FIRECRACKER; docs/backends.md)"))
            out.append(("version", None, "no binary to ask"))
        else:
            out.append(("binary", True, self.binary))
            version, text = firecracker_version(self.binary)
            if version is None:
                out.append(("version", False, f"cannot read its version ({text})"))
            elif version < MIN_VERSION:
                out.append(("version", False, f"{text}; {'.'.join(map(str, MIN_VERSION))} or later is needed (ACPI "
                                              "device discovery for Debian's kernel)"))
            else:
                out.append(("version", True, text))
        if self.jailer:
            jailer = find_jailer()
            if not jailer:
                out.append(("jailer", False, "no jailer binary (set TKBOX_JAILER or put it on PATH)"))
            elif os.geteuid() != 0:
                out.append(("jailer", False, "the jailer must be started as root"))
            else:
                out.append(("jailer", True, jailer))
        kvm, why = kvm_usable()
        out.append(("kvm", kvm, why))
        try:
            image = self._image or current_image()
            out.append(("image", image is not None,
                        f"{image.digest[:12]} in {image.path.parent}" if image
                        else "no guest image built (tkbox image build)"))
        except TkboxError as e:
            out.append(("image", False, str(e)))
        return out

    def available(self) -> tuple[bool, str]:
        checks = self.checks()
        for what, ok, detail in checks:
            if ok is False:
                return False, detail
        found = {what: detail for what, _, detail in checks}
        return True, (f"{found['binary']} ({found['version']}), image {found['image'][:12]}, KVM"
                      + (", jailer" if self.jailer else ""))

    def mount_disks(self, mounts: list, home: Path) -> list[tuple[str, str]]:
        """Each dataset mount as a read-only drive: the disk QEMU would get (microvm.mount_disks, cached by its
        digest), at most MAX_MOUNT_DISKS. A Firecracker box always boots cold (no snapshot is restored here), so
        nothing warm has to carry the drives."""
        return mount_disks(mounts, home, "firecracker", MAX_MOUNT_DISKS, "the guest's init") if mounts else []

    def start(self, spec: BoxSpec) -> VmRunning:
        if spec.agent_argv is not None:
            raise TkboxError("the firecracker backend runs only the image's guest agent")
        if len(spec.disks) != len(spec.mounts):  # fail closed: a mount the guest would not be given
            raise TkboxError("a firecracker box's mounts must each be given as a disk (Backend.mount_disks)")
        if not self.binary:
            raise TkboxError(self.available()[1])
        from tkbox_nb.backends.linux_kernel import vmlinux_for
        img = self.image
        vmlinux = vmlinux_for(img.path)
        workdir = scratch.fresh("tkbox-fc-", "/tmp")  # short: Unix socket paths live here
        dirs = [workdir]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = api = running = door_path = None
        wrapped = False
        try:
            cfg_img = config_disk(spec, workdir, self.kernel_ready_s)
            if self.jailer:
                base = img.path.parent / "jail"  # beside the image: the same filesystem, so its files are hard links
                base.mkdir(mode=0o711, exist_ok=True)
                root = jail_root(base, self.binary, spec.box_id)
                root.mkdir(parents=True)
                dirs.append(root.parent)
                for name, src in (("vmlinux", vmlinux), ("initrd.img", img.initrd), ("root.img", img.root),
                                  ("config.img", cfg_img)):
                    _link_or_copy(src, root / name)
                for i, (disk, _) in enumerate(spec.disks):  # the cached disk is root's alone (0600): a copy for nobody
                    shutil.copyfile(disk, root / f"m{i}.img")
                    os.chown(root / f"m{i}.img", JAIL_UID, JAIL_GID)
                    os.chmod(root / f"m{i}.img", 0o400)
                disks = [f"/m{i}.img" for i in range(len(spec.disks))]
                os.chown(root, JAIL_UID, JAIL_GID)  # Firecracker, as nobody, makes its sockets here
                paths = ("/vmlinux", "/initrd.img", "/root.img", "/config.img", "/v.sock")
                host_vsock, api_sock = root / "v.sock", root / "api.sock"
                argv, wrapped = reaped_with_us(jailer_argv(find_jailer() or "jailer", self.binary, spec.box_id, base))
            else:
                host_vsock, api_sock = workdir / "v.sock", workdir / "api.sock"
                paths = (str(vmlinux), str(img.initrd), str(img.root), str(cfg_img), str(host_vsock))
                disks = [disk for disk, _ in spec.disks]
                argv = [self.binary, "--api-sock", str(api_sock), "--id", spec.box_id]
            door_path = Path(f"{host_vsock}_{DOOR_PORT}")
            listener.bind(str(door_path))  # before the VM starts: the guest's first connect finds it
            listener.listen(1)
            if self.jailer:
                os.chown(door_path, JAIL_UID, JAIL_GID)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env={"PATH": "/usr/bin:/bin"}, preexec_fn=vmm_limits(spec.cpu_time_s),
                                    start_new_session=True)
            wait_for_socket(api_sock, proc, API_TIMEOUT_S)
            api = FirecrackerApi(api_sock)
            for method, path, body in api_requests(spec, *paths, disks=disks):
                api.call(method, path, body)
            running = VmRunning(proc, accept_door(listener, proc, self.ready_timeout_s, "firecracker"), workdir,
                                extra_dirs=dirs[1:], wrapped=wrapped)
            return running
        finally:
            listener.close()
            if api is not None:
                api.close()
            if door_path is not None:
                with contextlib.suppress(OSError):
                    door_path.unlink()
            if running is None:
                if proc is not None:
                    stop_process_group(proc)
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
