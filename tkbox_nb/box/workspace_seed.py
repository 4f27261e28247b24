"""The host folder a box starts with, measured and copied in ([workspace], policy/workspace.py).

A box is given a copy of its workspace, never the folder itself. The copy leaves out what `[workspace] exclude`
names (the same paths the run's workspace digest leaves out, core/tree_digest.py), and a folder larger than
`[workspace] max_mib` stops the start with one line naming its largest entries and the settings that would let it
start: a kernel started in a home directory or beside a data set must not silently copy gigabytes. Only regular
files, directories and symbolic links (kept as links, never followed) are copied; anything else (a FIFO, a socket, a
device) stops the start with one line, as the digest does.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.core.tree_digest import excluded

MIB = 1 << 20


def _walk(root: Path, exclude: list[str]):
    """(relative path, lstat) of every entry under `root` that `exclude` keeps, parents before children."""
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            names = sorted(os.listdir(root / rel_dir if rel_dir else root))
        except OSError as e:
            raise TkboxError(f"cannot read the workspace {root}: {e.strerror or e} ({e.filename})") from None
        for name in names:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if excluded(exclude, rel):
                continue
            try:
                st = os.lstat(root / rel)
            except OSError as e:  # gone since the listing, say
                raise TkboxError(f"cannot read the workspace {root}: {e.strerror or e} ({rel[:200]})") from None
            yield rel, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(rel)


def check_size(root: Path, exclude: list[str], max_mib: int) -> int | None:
    """The bytes of the workspace's regular files (excludes left out), None when it has no entry at all (the box
    starts with an empty workspace, as with none); over `max_mib`, one line naming the largest top-level entries and
    what to change."""
    total, top, entries = 0, {}, 0
    for rel, st in _walk(root, exclude):
        entries += 1
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
            top[rel.split("/", 1)[0]] = top.get(rel.split("/", 1)[0], 0) + st.st_size
    if total > max_mib * MIB:
        largest = sorted(top.items(), key=lambda kv: -kv[1])[:3]
        names = ", ".join(f"{n[:80]!r} {size / MIB:.0f} MiB" for n, size in largest)
        raise TkboxError(
            f"the workspace {root} is {total / MIB:.0f} MiB, over [workspace] max_mib = {max_mib} (largest: {names}): "
            "leave them out with [workspace] exclude, raise max_mib, give data as a dataset mount ([mounts.NAME]), "
            "or start the kernel in another folder (TKBOX_WORKSPACE=DIR, or none)")
    return total if entries else None


def copy_seed(root: Path, dst: Path, exclude: list[str]) -> None:
    """Copy the workspace at `root` to `dst` (which must not exist), less what `exclude` names."""
    dst.mkdir(mode=0o700)
    for rel, st in _walk(root, exclude):
        src, out = root / rel, dst / rel
        if stat.S_ISDIR(st.st_mode):
            out.mkdir()
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), out)
        elif stat.S_ISREG(st.st_mode):
            try:
                fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as e:
                raise TkboxError(f"cannot read the workspace file {rel[:200]!r}: {e.strerror or e}") from None
            with os.fdopen(fd, "rb") as fin, open(out, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            os.chmod(out, st.st_mode & 0o777)
        else:
            raise TkboxError(f"the workspace {root} holds {rel[:200]}, which is not a file, directory or symbolic "
                             "link (leave it out with [workspace] exclude)")
