"""Host scratch directories named by the process that made them, so a process killed before it could clean up
(SIGKILL, a crash) leaves nothing for long: the next one of the same kind sweeps the directories of dead makers.

Every box leaves such a directory while it runs (bwrap's /etc copy and its pids cgroup; a VM's door socket and config
disk; a warm-start template), as does each batch task. Its name is PREFIX + the maker's pid + "-" + the rest.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path


def make(prefix: str, root: str | Path | None = None) -> Path:
    """A new private directory PREFIX<pid>-XXXX under `root` (the system's temporary directory by default)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root))


def made_by(directory: str | Path, pid: int, prefix: str = "tkbox-") -> bool:
    """Whether `directory` is one `make` made for process `pid` with a prefix starting `prefix`: one a `sweep` removes,
    with all in it, once that process is dead."""
    # the kind after `prefix` holds no digit (every prefix here is so), so the pid is the first number in the name
    return re.fullmatch(rf"{re.escape(prefix)}[A-Za-z._-]*{pid}-[A-Za-z0-9_]+", Path(directory).name) is not None


def sweep(prefix: str, root: str | Path | None = None, cgroups: bool = False) -> list[Path]:
    """Remove the directories of `prefix` whose maker is dead; returns them. Only this user's, only real
    directories, and only when the pid in the name is not a live process (a reused pid keeps one: a leak, never a
    live box's directory removed). With `cgroups`, they are cgroups: removed only when empty (rmdir)."""
    import contextlib
    from tkbox_nb.core.processes import pid_alive
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = d.name[len(prefix):].split("-", 1)[0]
        try:
            mine = d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            if not cgroups:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
                continue
            with contextlib.suppress(OSError):  # a cgroup with a process in it stays
                d.rmdir()
                removed.append(d)
    return removed


def fresh(prefix: str, root: str | Path | None = None) -> Path:
    """sweep, then make: what a box's start does."""
    sweep(prefix, root)
    return make(prefix, root)
