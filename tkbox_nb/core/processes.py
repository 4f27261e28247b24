"""Whether a process is alive: what sweeps of a dead box's or signer's leftovers ask before removing anything."""

from __future__ import annotations

import os


def pid_alive(pid: int, reap: bool = False) -> bool:
    """Whether `pid` is a live process: a zombie is not, a process we may not signal is. With `reap`, a child of
    ours that ended is reaped (only for children nobody else waits for)."""
    if reap:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
            if waited == pid:
                return False
        except ChildProcessError:
            pass
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except OSError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
