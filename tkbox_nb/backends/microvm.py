"""What the two micro-VM backends (QEMU, Firecracker) share: whether KVM works here, the box's config disk, the VMM
process's limits, and the running VM (its console tail, its end, its cleanup). It sits below both backends (and the
registry that chooses between them) so that no backend imports another.

A VMM process runs the guest's code on its vCPUs, so it gets the box's limits: the box's CPU time is its CPU time, it
never dumps core (a core is guest memory), and it dies with this process (PR_SET_PDEATHSIG), so a host kernel killed
with SIGKILL leaves no VM running.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

from tkbox_nb.core import scratch
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.backends.base import Backend, BoxSpec, RunningBox
from tkbox_nb.backends.image import (CONFIG_LABEL, ENVIRONMENT, MOUNT_LABEL, Image, current_image, ext4_uuid,
                                     make_ext4)

BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "USER": "root"}
PR_SET_PDEATHSIG = 1
DISK_UUID_NAMESPACE = uuid.UUID("6f1c2a4e-3b5d-5e7f-8a9b-0c1d2e3f4a5b")  # mount_disk_uuid's; never change it


def kvm_usable() -> tuple[bool, str]:
    """Whether KVM can boot a stock kernel here (nested PVM cannot: it boots only PVM-enabled guests)."""
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not readable and writable by this user"
    if Path("/sys/module/kvm_pvm").exists():
        return False, "/dev/kvm is nested PVM (kvm_pvm), which does not boot stock kernels"
    return True, "/dev/kvm works"


def _prctl():
    """libc's prctl, looked up before fork (so the child only calls it), or None where it cannot be found."""
    import ctypes
    import ctypes.util
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def vmm_limits(cpu_time_s: int) -> Callable[[], None]:
    """A preexec_fn for a VMM: the box's CPU time, no core dumps, killed when this process dies."""
    prctl = _prctl()

    def in_child():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_time_s, cpu_time_s + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return in_child


def reaped_with_us(argv: list[str]) -> tuple[list[str], bool]:
    """`argv` for a VMM that drops privileges (QEMU's `-runas`, Firecracker's jailer), and whether it was wrapped.
    Such a VMM loses the parent-death signal at its uid change, so a host process killed with SIGKILL would leave its
    VM running. It runs instead as the child of a shell that is PID 1 of a PID namespace of its own: the shell keeps
    the signal (unshare's --kill-child; unshare itself gets ours), and when PID 1 dies the kernel kills everything in
    the namespace. The shell exits with the VMM's status, or 128 + N when signal N ended it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return argv, False
    return [unshare, "--pid", "--fork", "--kill-child", "--", "/bin/sh", "-c", '"$@"; exit $?', "sh", *argv], True


def config_disk(spec: BoxSpec, workdir: Path, kernel_ready_s: float) -> Path:
    """The box's settings as a read-only disk: written here, never mounted here, only read by the guest."""
    cfg = workdir / "config"
    cfg.mkdir()
    (cfg / "box.json").write_text(json.dumps({"workspace_mib": spec.workspace_mib}))
    env = {**BASE_ENV, "TKBOX_BOX_ID": spec.box_id, "TKBOX_KERNEL_READY_S": str(int(kernel_ready_s) - 30), **spec.env}
    (cfg / "env.json").write_text(json.dumps(env, sort_keys=True))
    if spec.ca_bundle is not None:
        (cfg / "ca-bundle.pem").write_bytes(spec.ca_bundle)
    if spec.seed is not None:
        shutil.copytree(spec.seed, cfg / "seed", symlinks=True)
    if spec.disks:  # mounts/I: mount I's target; mounts/I.uuid: its disk's file system (initramfs.py's init)
        (cfg / "mounts").mkdir()
        for i, (disk, target) in enumerate(spec.disks):
            (cfg / "mounts" / str(i)).write_text(target)
            (cfg / "mounts" / f"{i}.uuid").write_text(ext4_uuid(Path(disk)))
    out = workdir / "config.img"
    make_ext4(cfg, out, CONFIG_LABEL, slack_mib=4)
    shutil.rmtree(cfg, ignore_errors=True)
    return out


def mount_disk_uuid(digest: str) -> str:
    """The file-system UUID of the disk of the mount whose signed digest is `digest`: derived from it, so every make
    of the same data names the same UUID (a random one per make let a config disk name one disk's UUID while its VMM
    opened another box's make of the same data, and the guest found no disk for that mount)."""
    return str(uuid.uuid5(DISK_UUID_NAMESPACE, digest))


def publish_disk(staged: Path, out: Path) -> Path:
    """`staged` published at `out` only if no disk is there yet (a hard link, never a rename over it), and `out`: a
    disk already published (by another box that made the same data at the same time) is kept and reused, so a path
    a config disk was made from names the same file until its VMM opens it."""
    with contextlib.suppress(FileExistsError):
        os.link(staged, out)
    return out


def mount_disk(source: str, digest: str, cache: Path) -> Path:
    """A dataset mount as a read-only disk: an ext4 image (`mke2fs -d`, never mounted here) holding `data`, a copy
    of `source` (a directory or one file), cached in `cache` by the mount's signed `digest` so a second box reuses
    it. What the guest reads is what was signed: the image is made from a private copy whose digest, every file
    read again, must be `digest`; a source that changed since it was digested is refused in one line. Its file
    system's UUID is derived from `digest` (mount_disk_uuid) and it is published only where none is (publish_disk)."""
    from tkbox_nb.bundle import mount_digest as md
    algo_hex = digest.rsplit(":", 1)[-1]
    if not (len(algo_hex) == 64 and all(c in "0123456789abcdef" for c in algo_hex)):
        raise TkboxError(f"not a mount digest: {digest[:80]!r}")
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = cache / f"{algo_hex}.img"
    if out.is_file():
        return out
    work = scratch.fresh(".mount-disk-", cache)  # on the cache's file system: the image is linked into place
    try:
        tree = work / "tree"
        tree.mkdir()
        if os.path.isdir(source):
            shutil.copytree(source, tree / "data", symlinks=True)
        else:
            shutil.copy2(source, tree / "data")
        staged = md.digest(md.scan(str(tree / "data")), None)[0]  # no cache: every byte of the copy read again
        if staged != digest:
            raise TkboxError(f"the mount source {source} changed while its disk was made (its copy's digest "
                             f"{staged[:25]}... is not the signed {digest[:25]}...): start the box again")
        make_ext4(tree, work / "disk.img", MOUNT_LABEL, slack_mib=4, uuid=mount_disk_uuid(digest))
        os.chmod(work / "disk.img", 0o600)
        publish_disk(work / "disk.img", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def mount_disks(mounts: list, home: Path, vmm: str, limit: int, why: str) -> list[tuple[str, str]]:
    """Each dataset mount as a read-only disk (mount_disk, cached under $TKBOX_HOME/mount-cache/disks by its digest)
    with its target, for a `vmm` box that takes at most `limit` (`why`): more are refused in one line before any disk
    is made."""
    if len(mounts) > limit:
        raise TkboxError(f"[mounts]: a {vmm} box takes at most {limit} mounts ({why}), this policy has {len(mounts)}")
    return [(str(mount_disk(m.source, m.digest, home / "mount-cache" / "disks")), m.target) for m in mounts]


def accept_door(listener: socket.socket, proc: subprocess.Popen, timeout_s: float, vmm: str) -> socket.socket:
    """The one connection the VMM makes to the door listener, or a TkboxError naming why none came."""
    listener.settimeout(0.1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            door, _ = listener.accept()
            door.settimeout(None)
            return door
        except socket.timeout:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read1(4096).decode("utf-8", "replace").strip() if proc.poll() is not None \
                    else "no connection"
                last = out.splitlines()[-1][:300] if out else proc.poll()
                raise TkboxError(f"{vmm} did not connect its door ({last})")


def stop_process_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class ImageBackend(Backend):
    """A VM backend: it boots a guest image, the one given or else the current one (`tkbox image build`), and the
    run names that image by its digest."""

    _image: Image | None = None

    @property
    def image(self) -> Image:
        if self._image is None:
            self._image = current_image()
            if self._image is None:
                raise TkboxError(f"no guest image built for the {self.name} backend: run `tkbox image build` first")
        return self._image

    def image_digest(self) -> str:
        return f"tkbox-image:{self.image.digest}"  # sha256 of the inputs (image.py), first 128 bits

    def environment(self, cache_dir: Path) -> bytes:
        """The image's manifest, made when it was built (image.py keeps it beside the image); an image built before
        says so."""
        from tkbox_nb.bundle.environment import manifest
        try:
            env = json.loads((self.image.path / ENVIRONMENT).read_bytes())  # re-encoded canonically
        except (OSError, ValueError):
            env = None
        return manifest(env, self.name, self.image_digest(),
                        "an image built before tkbox recorded environments (tkbox image build --force records it)")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return sorted(out)


class VmRunning(RunningBox):
    """A VMM process with one door; its stdout is the guest's serial console."""

    CLEAN_EXIT = "the guest powered off"

    def __init__(self, proc: subprocess.Popen, door: socket.socket, workdir: Path, extra_dirs: list[Path] = (),
                 wrapped: bool = False):
        self.proc, self.door, self._workdir, self._extra_dirs = proc, door, workdir, list(extra_dirs)
        self._wrapped = wrapped  # run by reaped_with_us: 128 + N is signal N
        self._keep_tail(proc.stdout, "tkbox-vm-console")

    def vmm_pid(self) -> int | None:
        """The VMM's own process: under reaped_with_us, the child of the namespace's shell (None once gone)."""
        if not self._wrapped:
            return self.proc.pid
        pid = self.proc.pid
        for _ in range(2):  # unshare -> sh -> the VMM
            kids = _children(pid)
            if not kids:
                return None
            pid = kids[0]
        return pid

    def exit_reason(self) -> str:
        rc = self.proc.poll()
        if self._wrapped and rc is not None and 128 < rc < 128 + 65:
            return self.describe_exit(-(rc - 128))
        return super().exit_reason()

    def kill(self) -> None:
        stop_process_group(self.proc)
        with contextlib.suppress(OSError):
            self.door.close()
        for d in (self._workdir, *self._extra_dirs):
            shutil.rmtree(d, ignore_errors=True)
