"""Files written whole or not at all, at a name no one else could have prepared.

Every output a user names (a bundle, a notebook, a report, a trust config) is written to a fresh temporary file
beside it, created with O_EXCL by `tempfile.mkstemp` (so a symlink planted at a predictable temporary name is never
followed), flushed to disk and renamed over the target; on any failure the temporary file goes and the target is as
it was.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """`data` (bytes, or a function that writes to the open file) at `path`. OSError propagates; the caller names
    the path in its one-line error."""
    path = Path(path)
    refuse_special(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def refuse_special(path: Path) -> None:
    """A name that holds a device, a pipe, a socket or a directory is never replaced: a rename over /dev/null (an
    output named so to throw it away, as root) would put a regular file in the device's place for every process."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OSError(errno.EEXIST, "it exists and is not a regular file")


def reserve_beside(path: str | Path) -> Path:
    """A new empty file beside `path`, made with O_EXCL, for a program that writes its output to a name it is given
    (then `os.replace` it over `path`, or unlink it)."""
    path = Path(path)
    refuse_special(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def read_capped(path: str | Path, cap: int) -> bytes:
    """A regular file's bytes, at most `cap` of them: opened without blocking (a FIFO or device never hangs the
    reader), refused unless it is a regular file, and read to at most cap + 1 bytes. OSError for what cannot be read
    (its strerror says why), ValueError naming what is wrong with the file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > cap:
        raise ValueError(f"larger than {cap} bytes")
    return b"".join(chunks)


def cut_torn_line(path: Path) -> None:
    """Truncate a spool file to its last newline: each line is written whole before its signer call, so a line
    without one was cut by its writer's death and no signed record discloses it."""
    with open(path, "r+b") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
