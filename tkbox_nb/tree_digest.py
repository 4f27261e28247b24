"""The digest of a workspace tree: what a box started from, so a rerun can tell whether it starts from the same.

One SHA-256 over every entry under the root in sorted order: its relative path, its type, whether it is executable,
and a file's content digest or a symlink's target (never followed). Times, owners and other mode bits are left out:
they do not change what a command in the box reads.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from .errors import TkboxError


def tree_digest(root: str | Path) -> str:
    root = Path(root)
    h = hashlib.sha256(b"tkbox-tree-1\0")
    try:
        entries = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_raise):
            dirnames.sort()
            for name in dirnames + filenames:
                entries.append(os.path.join(dirpath, name))
        for path in sorted(entries, key=lambda p: os.path.relpath(p, root).encode("utf-8", "surrogateescape")):
            rel = os.path.relpath(path, root).encode("utf-8", "surrogateescape")
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                kind, body = b"l", os.readlink(path).encode("utf-8", "surrogateescape")
            elif stat.S_ISDIR(st.st_mode):
                kind, body = b"d", b""
            elif stat.S_ISREG(st.st_mode):
                kind, body = b"f" + (b"x" if st.st_mode & 0o111 else b"-"), _file_digest(path)
            else:  # a pipe, socket or device cannot be copied into a box: said before the box starts, in one line
                raise TkboxError(f"the workspace {root} holds {rel.decode('utf-8', 'replace')[:200]}, which is not a "
                                 "file, directory or symbolic link")
            h.update(rel + b"\0" + kind + b"\0" + body + b"\n")
    except OSError as e:
        raise TkboxError(f"cannot read the workspace {root}: {e.strerror or e} ({e.filename})") from None
    return "sha256:" + h.hexdigest()


def _raise(e: OSError) -> None:
    raise e  # a directory the walk cannot list is an error, never hashed as empty


def _file_digest(path: str) -> bytes:
    f = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            f.update(chunk)
    return f.hexdigest().encode()
