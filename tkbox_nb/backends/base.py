"""The backend interface: start one box whose only way out is the door socket, and stop it.

Nothing above this interface knows which backend runs a box. A backend must give the guest agent exactly one
channel (the door stream) and no network, and must say honestly what isolation it gives (`isolation`).
"""

from __future__ import annotations

import abc
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BoxSpec:
    """What a backend needs to start a box. `seed` is a host-side copy of the workspace (read-only in the box)."""

    box_id: str
    seed: Path | None
    memory_mib: int = 1024
    cpu_time_s: int = 3600
    max_processes: int = 256
    workspace_mib: int = 1024
    cpus: int = 1
    env: dict[str, str] = field(default_factory=dict)
    agent_argv: list[str] | None = None  # another guest program than the agent (tests of a hostile guest)
    ca_bundle: bytes | None = None       # the certificates the box trusts, when a secrets door terminates TLS
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (host source, box target), read-only (mounts.py)
    disks: list[tuple[str, str]] = field(default_factory=list)  # a VM's: (the mount's disk image, box target)
    devices: list[str] = field(default_factory=list)   # host device nodes given to the box ([box] gpus: gpus.py)
    ro_binds: list[str] = field(default_factory=list)  # host files the box sees read-only at the same path


class RunningBox(abc.ABC):
    """A started box. `door` is the host end of the door stream; `proc` the process that holds the box (bwrap, or
    a VMM), whose output stream (bwrap's stderr, a VM's serial console) is box output: only its tail is kept."""

    door: socket.socket
    proc: subprocess.Popen
    TAIL_BYTES = 8192
    CLEAN_EXIT = ""  # what an exit status of 0 means for this backend

    def _keep_tail(self, stream, name: str) -> None:
        """Drain `stream` on a thread, keeping only its last bytes in memory: a box that writes without end costs
        the host nothing. Only until the agent's hello (`ready`): the tail explains a box that did not come up, and
        after the hello box code runs, which may reach this stream (bubblewrap's init's stderr, a VM's serial
        port): what comes then is read and dropped, never shown as the host's."""
        self._tail = bytearray()

        def drain() -> None:
            while True:
                try:
                    chunk = stream.read1(65536)
                except (OSError, ValueError):
                    return
                if not chunk:
                    return
                if self._tail_closed:
                    continue
                self._tail += chunk
                del self._tail[:-self.TAIL_BYTES]
        threading.Thread(target=drain, daemon=True, name=name).start()

    _tail_closed = False

    def go(self) -> None:
        """Let the box's agent go on: its run's box.start is signed. A backend whose box starts after that (a VM's)
        has no GO to give."""

    def ready(self) -> None:
        """The agent said hello: from now on box code runs, and the tail keeps nothing more."""
        self._tail_closed = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        return bytes(getattr(self, "_tail", b"")).decode("utf-8", "replace")[-2000:]

    def exit_reason(self) -> str:
        """Why the box ended, in a few words (exit status, signal, a limit)."""
        return self.describe_exit(self.proc.poll())

    def memory_kills(self) -> int:
        """How many of the box's processes the host killed for its memory limit (a bwrap box's memory cgroup)."""
        return 0

    def describe_exit(self, rc: int | None) -> str:
        if rc is None:
            return "running"
        if rc < 0:
            name = signal.Signals(-rc).name
            return {"SIGXCPU": "CPU time limit", "SIGKILL": "killed"}.get(name, name)
        return f"exit status {rc}" + (f" ({self.CLEAN_EXIT})" if rc == 0 and self.CLEAN_EXIT else "")

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the box now and release everything it held (processes, cgroups, temporary files)."""


def end_note(running: RunningBox | None, reason: str) -> str:
    """The run's end reason, saying when the box's memory limit killed any of its processes (whatever ended it)."""
    kills = running.memory_kills() if running is not None else 0
    return f"{reason}; the memory limit killed {kills} process(es) of the box" if kills and "memory limit" not in \
        reason else reason


class Backend(abc.ABC):
    name: str = ""
    isolation: str = ""
    ready_timeout_s: float = 30.0  # start to the agent's hello
    kernel_ready_s: float = 90.0   # a kernel's start to its first answer

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """(can run here, why or why not)."""

    @abc.abstractmethod
    def start(self, spec: BoxSpec) -> RunningBox: ...

    def prepare(self, memory_mib: int, cpus: int) -> dict:
        """Work before a start that the run should name (a VM backend's warm-start state): the box facts it adds."""
        return {}

    def mount_disks(self, mounts: list, home: Path) -> list[tuple[str, str]]:
        """What a VM backend gives the guest for the dataset mounts (backends/mounts.py's `Mount`s, digested):
        (disk image, target) each; none for a backend that binds the sources themselves (bubblewrap)."""
        return []

    def image_digest(self) -> str:
        return "none"

    def environment(self, cache_dir: Path) -> bytes:
        """The manifest of what the box runs (bundle/environment.py) that its box.start commits to; `cache_dir`: where a
        backend keeps what it computed, keyed by what it read."""
        from tkbox_nb.bundle.environment import manifest
        return manifest(None, self.name, self.image_digest(), f"the {self.name} backend does not record it")


ISOLATION_LEVELS = {"none": 0, "namespace": 1, "vm-tcg": 2, "vm-kvm": 2, "vm": 2}
"""How strong each backend's isolation is: a policy's `box.isolation` minimum compares against these."""
