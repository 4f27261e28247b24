"""The host folder a box starts with, measured and copied in ([workspace], policy/workspace.py).

A box is given a copy of its workspace, never the folder itself. The copy leaves out what `[workspace] exclude`
names (the same paths the run's workspace digest leaves out, core/tree_digest.py), and a folder larger than
`[workspace] max_mib` stops the start with one line naming its largest entries and the settings that would let it
start: a kernel started in a home directory or beside a data set must not silently copy gigabytes. Only regular
files, directories and symbolic links (kept as links, never followed) are copied; anything else (a FIFO, a socket, a
device) stops the start with one line, as the digest does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from pathlib import Path

from tkbox_nb.core import scratch
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.core.tree_digest import digest_v2, excluded

MIB = 1 << 20
CHUNK = 1 << 20


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


def copy_seed(root: Path, dst: Path, exclude: list[str]) -> str | None:
    """Copy the workspace at `root` to `dst` (which must not exist), less what `exclude` names; returns the workspace
    digest (core/tree_digest.py, version 2) of exactly what was written, each file hashed from the bytes copied as
    they pass: one read of the folder, and a file changed while the box starts gives the digest of the copy the box
    got, never of a version it did not. None for a copy with no entry (a run states an empty workspace as none)."""
    dst.mkdir(mode=0o700)
    entries: list[tuple[bytes, bytes, bytes]] = []
    buf = memoryview(bytearray(CHUNK))
    for rel, st in _walk(root, exclude):
        src, out = root / rel, dst / rel
        name = rel.encode("utf-8", "surrogateescape")
        if stat.S_ISDIR(st.st_mode):
            out.mkdir()
            entries.append((name, b"d", b""))
        elif stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(src)
            except OSError as e:  # replaced since the listing, say
                raise TkboxError(f"cannot read the workspace link {rel[:200]!r}: {e.strerror or e}") from None
            os.symlink(target, out)
            entries.append((name, b"l", target.encode("utf-8", "surrogateescape")))
        elif stat.S_ISREG(st.st_mode):
            entries.append((name, *_copy_file(src, out, rel, buf)))
        else:
            raise TkboxError(f"the workspace {root} holds {rel[:200]}, which is not a file, directory or symbolic "
                             "link (leave it out with [workspace] exclude)")
    return digest_v2(entries) if entries else None


def _copy_file(src: Path, out: Path, rel: str, buf: memoryview) -> tuple[bytes, bytes]:
    """Copy one regular file, hashing the bytes as they are written; its kind (by the mode of the file opened, not
    of the listing) and the hex digest of what was written."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise TkboxError(f"cannot read the workspace file {rel[:200]!r}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb", buffering=0) as fin:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced by a FIFO or device since the listing: never read from one
            raise TkboxError(f"the workspace file {rel[:200]!r} is no longer a regular file")
        h = hashlib.sha256()
        with open(out, "wb", buffering=0) as fout:
            while n := fin.readinto(buf):
                h.update(buf[:n])
                fout.write(buf[:n])
    os.chmod(out, mode & 0o777)
    return (b"fx" if mode & 0o111 else b"f-"), h.hexdigest().encode()


class SeedCopy:
    """`copy_seed` into a private staging directory under `stage_root`, in a thread from construction on, so the
    copy overlaps the rest of a box's start; `digest` waits for it (and raises what it raised), `move_to` puts the
    copy where the box is given it, `discard` removes whatever is left. The staging directory is named by this
    process (core/scratch.py), so one a killed process left is swept by the next box's start."""

    def __init__(self, root: Path, stage_root: Path, exclude: list[str]) -> None:
        stage_root.mkdir(mode=0o700, exist_ok=True)
        self.stage = scratch.fresh("seed-", stage_root)
        self.copy = self.stage / "seed"
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(root, exclude), name="tkbox-seed", daemon=True)
        self._thread.start()

    def _run(self, root: Path, exclude: list[str]) -> None:
        try:
            self._digest = copy_seed(root, self.copy, exclude)
        except BaseException as e:  # raised again in the starting thread, by digest()
            self._error = e

    def digest(self) -> str | None:
        """The workspace digest of the copy, None when it has no entry (stated as none)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest

    def staged(self) -> Path:
        """The copy, complete, where it was made: the box takes it from here, before it is moved."""
        self.digest()
        return self.copy

    def move_to(self, dst: Path) -> Path:
        """The copy, renamed to `dst`. A bubblewrap box has it bound (its agent's patch compares the box's workspace
        with it), so it is never copied and removed instead: on another file system the box's copy would be emptied.
        $TKBOX_HOME's seeds and runs on two file systems end the start in one line."""
        self.digest()
        try:
            os.rename(self.copy, dst)
        except OSError as e:
            raise TkboxError(f"the workspace's copy cannot be moved into the run ({e.strerror}): {self.stage.parent} "
                             f"and {dst.parent.parent} must be on one file system") from None
        return dst

    def discard(self) -> None:
        self._thread.join()
        shutil.rmtree(self.stage, ignore_errors=True)
