"""Warm starts for the QEMU backend: boot the image once as a template, keep the stopped VM's state, and start every
later box by restoring that state instead of booting.

Under emulation (TCG) a cold boot costs seconds before the guest agent answers: the kernel's own start, the init,
and Python's imports. A template VM does all of that once, with no box in it: the agent opens the door, says
WARM_READY and waits (guest/vm.py); the host then migrates the VM's state into a file (QEMU's migration stream over
a file descriptor, so the sandboxed QEMU spawns nothing) and kills the template. A box started warm is a QEMU with
the same machine restored from that file (`-incoming fd:N`), its own door socket and its own config disk; the host's
first bytes on the door are the GO message, which gives the guest fresh entropy and the time before the agent reads
the box's config. No code of any box ever ran in a template, so no box's state is in it.

The state is a host file beside the image, named by everything the restore depends on (image, memory, vCPUs,
acceleration, QEMU binary, machine options: this format) and recorded in the run by its SHA-256 (the box's `boot`
fact). Its making is serialized by a lock; a box that cannot have one (the template failed) boots cold, and its run
says so. A restore reads the state through a pipe this process fills (StateFeed), hashing each byte QEMU gets: the GO
is sent only when what QEMU read is the state the run names, so the signed hash is of the bytes restored.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tkbox_nb.core import scratch
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.guest.vm import WARM_READY, encode_go, GO_ENTROPY
from tkbox_nb.backends.base import BoxSpec
from tkbox_nb.backends.image import Image
from tkbox_nb.backends.microvm import stop_process_group


class TemplateVm(Protocol):
    """What a warm start needs of its backend (QemuBackend has it): the image, the acceleration, and a way to launch
    a VM with a door. Named here, not imported from qemu.py, so warm_start sits below the backend that uses it."""

    image: Image
    accel: str

    def launch(self, spec: BoxSpec, workdir: Path, warm: bool, extra: list[str] = (), pass_fds: tuple = (),
               console: Path | None = None) -> tuple[Any, socket.socket, bool]: ...


FORMAT = 2  # 2: the microvm machine without its legacy PIC, option ROMs, USB and PCIe (qemu.py MACHINE)
CONFIG_DISK_BYTES = 64 << 30  # a warm guest found its config disk this size in the template: every box's is (sparse)
QMP_LINE_MAX = 1 << 20


@dataclass(frozen=True)
class WarmState:
    """A template's saved state: the migration stream's file and its SHA-256 (taken when it was written)."""

    path: Path
    sha256: str

    @property
    def boot_fact(self) -> str:
        return f"warm:sha256:{self.sha256}"


def state_key(image: Image, memory_mib: int, cpus: int, accel: str, qemu: str) -> str:
    """What a restore must match: the image, the machine's size, the acceleration, the QEMU binary, this format."""
    st = os.stat(qemu)
    return hashlib.sha256(json.dumps({
        "format": FORMAT, "image": image.digest, "memory_mib": memory_mib, "cpus": cpus, "accel": accel,
        "qemu": [os.path.realpath(qemu), st.st_size, st.st_mtime_ns]}, sort_keys=True).encode()).hexdigest()[:32]


def find_state(image: Image, key: str) -> WarmState | None:
    """The saved state for `key`, when its file is there, whole (its recorded size) and ours (root-owned, 0600)."""
    base = image.path / "warm"
    try:
        meta = json.loads((base / f"{key}.json").read_text())
        st = os.stat(base / f"{key}.vmstate")
    except (OSError, ValueError):
        return None
    if not (isinstance(meta, dict) and meta.get("size") == st.st_size and isinstance(meta.get("sha256"), str)
            and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0):
        return None
    return WarmState(base / f"{key}.vmstate", meta["sha256"])


class StateFeed:
    """A saved state given to QEMU through a pipe (`-incoming fd:N`, `fd` the read end), each byte hashed on its way:
    `wait` says whether QEMU got all of it, and its SHA-256."""

    CHUNK = 1 << 20

    def __init__(self, path: Path):
        self._src = open(path, "rb")
        self.fd, self._w = os.pipe()  # neither inherited but by pass_fds; the read end is QEMU's alone once it runs
        self.sha256: str | None = None
        self.broken = False  # QEMU stopped reading (it refused the stream, or ended)
        self._done = threading.Event()
        threading.Thread(target=self._pump, daemon=True, name="tkbox-warm-feed").start()

    def _pump(self) -> None:
        h = hashlib.sha256()
        try:
            while chunk := self._src.read(self.CHUNK):
                view = memoryview(chunk)
                while len(view):  # QEMU reads this chunk while it is hashed (hashlib lets go of the GIL)
                    view = view[os.write(self._w, view):]
                h.update(chunk)
            self.sha256 = h.hexdigest()
        except OSError:  # BrokenPipeError: QEMU closed its end
            self.broken = True
        finally:
            self._src.close()
            with contextlib.suppress(OSError):
                os.close(self._w)
            self._done.set()

    def close_read_end(self) -> None:
        """This process's copy of the read end, once QEMU has its own."""
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def wait(self, timeout_s: float) -> bool:
        """Whether the feed ended (whole, or QEMU stopped reading) within `timeout_s`."""
        return self._done.wait(timeout_s)


def console_tail(workdir: Path) -> str:
    with contextlib.suppress(OSError):
        lines = (workdir / "console").read_bytes()[-2000:].decode("utf-8", "replace").strip().splitlines()
        return lines[-1][:300] if lines else "no console output"
    return "no console output"


def discard_state(state: WarmState) -> None:
    """Set a state that failed to restore aside (`.bad`, kept for a look), so that the next box makes a new one."""
    with contextlib.suppress(OSError):
        os.rename(state.path.with_suffix(".json"), state.path.with_suffix(".json.bad"))
    with contextlib.suppress(OSError):
        os.rename(state.path, state.path.with_suffix(".vmstate.bad"))


def go_message() -> bytes:
    """The host's first bytes on a warm box's door: fresh entropy for the guest's kernel, and the time."""
    return encode_go(os.urandom(GO_ENTROPY), time.time_ns())


def fit_config_disk(img: Path) -> None:
    """Make a box's config disk the template's size (sparse past its filesystem), or say why it cannot be."""
    size = img.stat().st_size
    if size > CONFIG_DISK_BYTES:
        raise TkboxError(f"the box's config disk ({size >> 20} MiB, mostly the workspace seed) is over the "
                         f"{CONFIG_DISK_BYTES >> 30} GiB a warm start takes")
    os.truncate(img, CONFIG_DISK_BYTES)


class Qmp:
    """A minimal QMP client: one command at a time, events skipped, replies bounded."""

    def __init__(self, path: Path, timeout_s: float):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TkboxError("QEMU's monitor socket did not come up") from None
                time.sleep(0.02)
        self.file = self.sock.makefile("rb")
        self._line()  # the greeting
        self.command("qmp_capabilities")

    def _line(self) -> dict:
        line = self.file.readline(QMP_LINE_MAX)
        if not line.endswith(b"\n"):
            raise TkboxError("QEMU's monitor closed or sent an over-long reply")
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise TkboxError("QEMU's monitor sent a reply that is not an object")
        return msg

    def command(self, name: str, fds: list[int] | None = None, **arguments: Any) -> Any:
        data = json.dumps({"execute": name, **({"arguments": arguments} if arguments else {})}).encode() + b"\n"
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)
        while True:
            msg = self._line()
            if "event" in msg:
                continue
            if "error" in msg:
                raise TkboxError(f"QEMU refused {name}: {str(msg['error'].get('desc', msg['error']))[:200]}")
            return msg.get("return")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def make_state(backend: TemplateVm, memory_mib: int, cpus: int, key: str, timeout_s: float) -> WarmState:
    """Boot the template, wait for its WARM_READY, migrate its state into the key's file (written whole, then named),
    and stop it. Serialized by a lock: a second caller waits and finds the first one's state."""
    image = backend.image
    base = image.path / "warm"
    base.mkdir(mode=0o700, exist_ok=True)
    with open(base / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_state(image, key)
        if found is not None:
            return found
        for stale in base.glob(".*.part"):  # left by a maker that was killed: none runs while we hold the lock
            stale.unlink(missing_ok=True)
        spec = BoxSpec(box_id="warm-template", seed=None, memory_mib=memory_mib, cpus=cpus)
        workdir = scratch.fresh("tkbox-tpl-", "/tmp")
        tmp = base / f".{key}.{os.getpid()}.part"
        proc = None
        try:
            qmp_path = workdir / "qmp.sock"
            proc, door, _ = backend.launch(spec, workdir, warm=True, console=workdir / "console",
                                            extra=["-qmp", f"unix:{qmp_path},server=on,wait=off"])
            door.settimeout(timeout_s)
            got = b""
            while len(got) < len(WARM_READY):
                chunk = door.recv(len(WARM_READY) - len(got))
                if not chunk:
                    raise TkboxError("the template VM ended before it was ready: " + console_tail(workdir))
                got += chunk
            if got != WARM_READY:
                raise TkboxError("the template VM said something else than WARM_READY")
            qmp = Qmp(qmp_path, timeout_s)
            try:
                # migrated while running (it is idle in its wait): the stream then says "running", and a restore
                # starts the guest by itself, with no monitor needed in a box's QEMU
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    qmp.command("getfd", fds=[fd], fdname="state")
                finally:
                    os.close(fd)
                qmp.command("migrate", uri="fd:state")
                deadline = time.monotonic() + timeout_s
                while True:
                    status = (qmp.command("query-migrate") or {}).get("status")
                    if status == "completed":
                        break
                    if status in ("failed", "cancelled") or time.monotonic() > deadline:
                        raise TkboxError(f"saving the template VM's state {status or 'timed out'}")
                    time.sleep(0.02)
            finally:
                qmp.close()
            door.close()
            h = hashlib.sha256()
            with open(tmp, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            os.rename(tmp, base / f"{key}.vmstate")
            meta = base / f".{key}.json.part"
            meta.write_text(json.dumps({"sha256": h.hexdigest(), "size": size, "memory_mib": memory_mib,
                                        "cpus": cpus, "accel": backend.accel, "made_at": int(time.time())}))
            os.rename(meta, base / f"{key}.json")
            return WarmState(base / f"{key}.vmstate", h.hexdigest())
        finally:
            if proc is not None:
                stop_process_group(proc)
            tmp.unlink(missing_ok=True)
            shutil.rmtree(workdir, ignore_errors=True)


def _key(backend: TemplateVm, memory_mib: int, cpus: int) -> str:
    exe = shutil.which("qemu-system-x86_64")
    if exe is None:
        raise TkboxError("qemu-system-x86_64 is not installed")
    return state_key(backend.image, memory_mib, cpus, backend.accel, exe)


def saved_state(backend: TemplateVm, memory_mib: int, cpus: int) -> WarmState | None:
    """The saved state for this machine, if there is one (`tkbox doctor` asks)."""
    return find_state(backend.image, _key(backend, memory_mib, cpus))


def warm_state(backend: TemplateVm, memory_mib: int, cpus: int, timeout_s: float) -> WarmState:
    """The saved state for this machine, made now when there is none."""
    key = _key(backend, memory_mib, cpus)
    return find_state(backend.image, key) or make_state(backend, memory_mib, cpus, key, timeout_s)
