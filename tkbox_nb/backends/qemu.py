"""The QEMU backend: each box is a `microvm` with no network device at all, its own kernel, and one door.

Isolation is a virtual machine: the box's code runs on the guest kernel, and reaches the host only through the
devices QEMU gives it: a read-only root disk (the cached image), a read-only config disk made for this box (its
environment, CA bundle and workspace seed, written by the host with `mke2fs -d`), a read-only disk per dataset mount
(an ext4 image of a copy of its source, cached by its signed digest: microvm.mount_disk), and one virtio-serial port,
the door,
whose host end is a Unix socket this process listens on and QEMU connects to. `-nodefaults` means no NIC, no
display, no USB; the machine's own legacy devices are cut to those the guest needs (MACHINE); the workspace is a tmpfs
inside the guest that the host never mounts. KVM is used when it can run a stock kernel here, TCG (emulation)
otherwise; the choice is the box's recorded isolation ("vm-kvm" or "vm-tcg").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tkbox_nb.core import scratch
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.backends.base import BoxSpec
from tkbox_nb.backends.image import DOOR_NAME, MOUNT_SERIAL, Image, current_image
from tkbox_nb.backends.microvm import (ImageBackend, VmRunning, accept_door, config_disk, kvm_usable, mount_disks,
                                       reaped_with_us, stop_process_group, vmm_limits)
from tkbox_nb.backends.warm_start import StateFeed, WarmState, discard_state, fit_config_disk, go_message, warm_state

QEMU = "qemu-system-x86_64"
# The microvm machine without what the guest does not need: no legacy i8259 PIC (the IO-APIC routes every interrupt),
# no second IO-APIC, no option ROMs (qboot loads the kernel itself), no SMM, no USB, no PCIe. Kept, each for a reason
# (docs/backends.md, I35): the PIT (under TCG the kernel calibrates its clocks against it; no kvmclock there), the
# RTC (a cold boot's wall clock; its CMOS NVRAM is guest-writable memory of QEMU's, never a file), the ISA serial
# port (ttyS0, the console: its tail is the reason a box did not come up, kept only until the agent's hello), ACPI
# (its GED is the guest's power button and poweroff) and fw_cfg (microvm loads the kernel, initrd and command line
# through it; it cannot be turned off).
MACHINE = "microvm,pic=off,ioapic2=off,x-option-roms=off,smm=off,usb=off,pcie=off"
CONNECT_TIMEOUT_S = 15.0
# microvm has 8 virtio-mmio slots (no second IO-APIC): the root, the config disk and the door take three
MAX_MOUNT_DISKS = 5


class QemuBackend(ImageBackend):
    name = "qemu"
    ready_timeout_s = 120.0  # an emulated boot on a loaded host can take tens of seconds
    kernel_ready_s = 300.0   # and `import ipykernel` under TCG from 7 s (idle host) to a minute (loaded)

    def __init__(self, image: Image | None = None, accel: str | None = None, warm: bool = True):
        self._image = image
        self.warm = warm  # start from a saved template (warm_start.py), else boot
        self._warm: WarmState | None = None
        self._prepared = False
        if accel is None:
            accel = "kvm" if kvm_usable()[0] else "tcg"
        self.accel = accel
        self.isolation = f"vm-{accel}"

    def available(self) -> tuple[bool, str]:
        exe = shutil.which(QEMU)
        if not exe:
            return False, f"{QEMU} is not installed (apt-get install qemu-system-x86)"
        try:
            image = self._image or current_image()
        except TkboxError as e:
            return False, str(e)
        if image is None:
            return False, "no guest image built (tkbox image build)"
        kvm, why = kvm_usable()
        return True, f"{exe}, image {image.digest[:12]}, {'KVM' if self.accel == 'kvm' else 'TCG'} ({why})"

    def argv(self, spec: BoxSpec, door_path: Path, config_img: Path, cpus: int, warm: bool = False) -> list[str]:
        img = self.image
        accel = "kvm" if self.accel == "kvm" else "tcg"  # (-icount runs one TCG thread)
        # Under TCG on a loaded host the guest's timer calibration can fail and its clock stall; counting
        # instructions (-icount) gives the guest a time that host load cannot skew.
        # With more than one vCPU the delay-loop calibration of the second one never settles under -icount: preset it
        # (the guest sees a 1 GHz TSC there, and Debian's kernel ticks at 250 Hz).
        # (a warm start restores the template's kernel and command line: its workspace size comes from box.json)
        cmdline = "console=ttyS0 quiet panic=-1 " + ("tkbox.warm=1" if warm else f"tkbox.ws={spec.workspace_mib}")
        if spec.disks:  # a box with dataset mounts boots cold: the warm template has no disks for them
            if warm or len(spec.disks) > MAX_MOUNT_DISKS:
                raise TkboxError(f"a qemu box takes at most {MAX_MOUNT_DISKS} dataset mounts, and boots them cold")
            cmdline += f" tkbox.mounts={len(spec.disks)}"
        disks = []
        for i, (disk, _) in enumerate(spec.disks):  # read-only, each named by its serial (initramfs.py's init)
            disks += ["-drive", f"id=m{i},file={disk},format=raw,if=none,readonly=on",
                      "-device", f"virtio-blk-device,drive=m{i},serial={MOUNT_SERIAL}{i}"]
        timing = []
        if self.accel == "tcg":
            timing = ["-icount", "shift=auto,sleep=on"]
            cmdline += " lpj=4000000"
        return [shutil.which(QEMU) or QEMU, "-M", MACHINE, "-accel", accel, "-cpu", "max" if self.accel == "tcg"
                else "host", "-m", str(spec.memory_mib), "-smp", str(cpus),
                *timing, "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
                *self._confinement(),
                "-serial", "stdio", "-kernel", str(img.kernel), "-initrd", str(img.initrd), "-append", cmdline,
                "-drive", f"id=root,file={img.root},format=raw,if=none,readonly=on",
                "-device", "virtio-blk-device,drive=root",
                "-drive", f"id=cfg,file={config_img},format=raw,if=none,readonly=on",
                "-device", "virtio-blk-device,drive=cfg", *disks,
                "-device", "virtio-serial-device,max_ports=2",
                "-chardev", f"socket,id=door,path={door_path}",
                "-device", f"virtserialport,chardev=door,name={DOOR_NAME}"]

    @staticmethod
    def _confinement() -> list[str]:
        """QEMU under seccomp (no exec, no obsolete calls, no resource control); started as root, it opens its files
        and sockets and then drops to nobody (set*uid must stay allowed for that one drop, which nobody cannot undo)."""
        root = os.geteuid() == 0
        sandbox = f"on,obsolete=deny,elevateprivileges={'allow' if root else 'deny'},spawn=deny,resourcecontrol=deny"
        return ["-sandbox", sandbox, *(["-runas", "nobody"] if root else [])]

    def mount_disks(self, mounts: list, home: Path) -> list[tuple[str, str]]:
        """Each dataset mount as a read-only disk (microvm.mount_disks), at most MAX_MOUNT_DISKS; a box with mounts
        boots cold (its prepare() makes no warm state)."""
        if not mounts:
            return []
        disks = mount_disks(mounts, home, "qemu", MAX_MOUNT_DISKS, "microvm's virtio slots")
        self.warm = False
        return disks

    def prepare(self, memory_mib: int, cpus: int) -> dict:
        """Find or make the warm-start state for this machine size (warm_start.py); the run's `boot` fact."""
        self._warm, self._prepared = None, True
        if self.warm:
            try:
                self._warm = warm_state(self, memory_mib, max(1, cpus), self.ready_timeout_s)
            except (TkboxError, OSError) as e:  # a cold boot still works; the run says which it was
                import warnings
                warnings.warn(f"tkbox: no warm start for this box ({' '.join(str(e).split())[:300]}); booting cold",
                              stacklevel=2)
        return {"boot": self._warm.boot_fact if self._warm else "cold"}

    def launch(self, spec: BoxSpec, workdir: Path, warm: bool, extra: list[str] = (), pass_fds: tuple = (),
               console: Path | None = None) -> tuple[subprocess.Popen, socket.socket, bool]:
        """Start QEMU for `spec` in `workdir` and take its door connection: (process, door, wrapped)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        door_path = workdir / "door.sock"
        proc = None
        try:
            listener.bind(str(door_path))
            listener.listen(1)
            config_img = config_disk(spec, workdir, self.kernel_ready_s)
            if warm:
                fit_config_disk(config_img)
            argv, wrapped = self.argv(spec, door_path, config_img, max(1, spec.cpus), warm=warm) + list(extra), False
            if "-runas" in argv:
                argv, wrapped = reaped_with_us(argv)
            out = open(console, "wb") if console is not None else subprocess.PIPE
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env={"PATH": "/usr/bin:/bin"}, pass_fds=pass_fds,
                                        preexec_fn=vmm_limits(spec.cpu_time_s), start_new_session=True)
            finally:
                if console is not None:
                    out.close()
            return proc, accept_door(listener, proc, CONNECT_TIMEOUT_S, "QEMU"), wrapped
        except BaseException:
            if proc is not None:
                stop_process_group(proc)
            raise
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                door_path.unlink()

    def start(self, spec: BoxSpec) -> VmRunning:
        if spec.agent_argv is not None:
            raise TkboxError("the qemu backend runs only the image's guest agent (agent_argv is for bwrap tests)")
        if len(spec.disks) != len(spec.mounts):  # fail closed: a mount the guest would not be given
            raise TkboxError("a qemu box's mounts must each be given as a disk (Backend.mount_disks)")
        self.image  # noqa: B018 -- fail before making anything when there is no image
        if not self._prepared:  # start() without prepare(): a direct use of the backend
            self.prepare(spec.memory_mib, spec.cpus)
        warm, self._prepared = self._warm, False
        workdir = scratch.fresh("tkbox-vm-", "/tmp")  # short: a Unix socket path lives here
        feed = None
        try:
            if warm is not None:
                feed = StateFeed(warm.path)  # its read end inherited by QEMU only (pass_fds)
            proc, door, wrapped = self.launch(spec, workdir, warm is not None,
                                              extra=["-incoming", f"fd:{feed.fd}"] if feed else [],
                                              pass_fds=(feed.fd,) if feed else ())
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            if feed is not None:
                feed.close_read_end()  # a QEMU that failed to start closes the pipe: the feed ends
        running = VmRunning(proc, door, workdir, wrapped=wrapped)
        if warm is not None:
            self._go(running, warm, feed)
        return running

    def _go(self, running: VmRunning, warm: WarmState, feed: StateFeed) -> None:
        """Check that QEMU read the state the run names, send the GO and wait (without reading it) for the guest's
        first byte. A state whose bytes are not those recorded, or one that does not restore (QEMU ends before that
        byte), is set aside (the next box makes a new one) and this box fails, since its run already names it."""
        door = running.door
        if not feed.wait(self.ready_timeout_s):
            running.kill()
            raise TkboxError("the warm-started VM did not read its saved state in time")
        if feed.sha256 is not None and feed.sha256 != warm.sha256:
            running.kill()
            discard_state(warm)
            raise TkboxError(f"the saved state's bytes are not those recorded (sha256 {feed.sha256[:16]}..., "
                             f"recorded {warm.sha256[:16]}...); it is set aside (the next box makes a new one)")
        try:
            door.sendall(go_message())
            door.settimeout(self.ready_timeout_s)
            first = door.recv(1, socket.MSG_PEEK)
        except socket.timeout:
            first = None  # a slow guest: the box's own wait for the hello decides
        except OSError:
            first = b""
        finally:
            with contextlib.suppress(OSError):
                door.settimeout(None)
        if first == b"" or feed.broken:
            time.sleep(0.2)  # the console's last lines (QEMU's reason) are drained on a thread
            reason = running.log_tail() or running.exit_reason()
            running.kill()
            discard_state(warm)
            raise TkboxError(f"the warm-started VM ended before its agent spoke; its saved state is set aside (the "
                             f"next box makes a new one): {' '.join(reason.split())[-300:]}")
