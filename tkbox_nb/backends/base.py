"""The backend interface: start one box whose only way out is the door socket, and stop it.

Nothing above this interface knows which backend runs a box. A backend must give the guest agent exactly one
channel (the door stream) and no network, and must say honestly what isolation it gives (`isolation`).
"""

from __future__ import annotations

import abc
import socket
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
    env: dict[str, str] = field(default_factory=dict)
    agent_argv: list[str] | None = None  # another guest program than the agent (tests of a hostile guest)
    ca_bundle: bytes | None = None       # the certificates the box trusts, when a secrets door terminates TLS


class RunningBox(abc.ABC):
    """A started box. `door` is the host end of the door stream."""

    door: socket.socket

    @abc.abstractmethod
    def alive(self) -> bool: ...

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the box now and release everything it held (processes, cgroups, temporary files)."""

    @abc.abstractmethod
    def exit_reason(self) -> str:
        """Why the box ended, in a few words (exit status, signal, a limit)."""


class Backend(abc.ABC):
    name: str = ""
    isolation: str = ""

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """(can run here, why or why not)."""

    @abc.abstractmethod
    def start(self, spec: BoxSpec) -> RunningBox: ...

    def image_digest(self) -> str:
        return "none"


def get_backend(name: str) -> Backend:
    from .bwrap import BwrapBackend
    candidates = {"bwrap": BwrapBackend}
    if name == "auto":
        why = []
        for cls in candidates.values():
            b = cls()
            ok, reason = b.available()
            if ok:
                return b
            why.append(f"{b.name}: {reason}")
        from ..errors import TkboxError
        raise TkboxError(f"no box can start here ({'; '.join(why)}); bundles can still be read, verified, replayed "
                         "and audited")
    if name not in candidates:
        from ..errors import TkboxError
        raise TkboxError(f"backend {name!r} is not available in this version (built: {', '.join(candidates)})")
    return candidates[name]()


BACKENDS = ("bwrap", "qemu", "firecracker")
