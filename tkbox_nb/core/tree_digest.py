"""The digest of a workspace tree: what a box started from, so a rerun can tell whether it starts from the same.

One SHA-256 over every entry under the root in the order of their relative paths' bytes (never the order a walk
met them): its relative path, its type, whether it is executable, and a file's content digest or a symlink's target
(never followed). Times, owners and other mode bits are left out: they do not change what a command in the box reads.

Version 2 (`tree2:sha256:HEX`, what boxes state) frames every field with its length, so no two trees share the
bytes hashed. Version 1 (`sha256:HEX`, bundles before it) ended each entry with a newline, which a file name or a
symlink's target may hold, so two different trees could share a digest: it is kept only to compare a workspace with
a run that stated one (`tree_digest(root, 1)`). docs/bundle-format.md ("The workspace digest") specifies both, for
dataset mounts and third-party verifiers.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import stat
from pathlib import Path

from tkbox_nb.core.errors import TkboxError

V2_PREFIX = "tree2:sha256:"


def digest_version(digest: object) -> int | None:
    """2 for `tree2:sha256:HEX`, 1 for the older `sha256:HEX`, None for anything else."""
    for version, prefix in ((2, V2_PREFIX), (1, "sha256:")):
        if isinstance(digest, str) and digest.startswith(prefix):
            return version if re.fullmatch(r"[0-9a-f]{64}", digest[len(prefix):]) else None
    return None


def tree_digest(root: str | Path, version: int = 2, exclude: list[str] | None = None) -> str:
    """The tree under `root` in `version` 2 (the default) or 1 (to compare with a run that stated one), less the
    paths `exclude` leaves out ([workspace] exclude: the digest is of what the box is given)."""
    root = Path(root)
    h = hashlib.sha256(b"tkbox-tree-2\0" if version == 2 else b"tkbox-tree-1\0")
    try:
        entries = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_raise):
            if exclude:
                rel_dir = os.path.relpath(dirpath, root)
                keep = [n for n in dirnames + filenames
                        if not excluded(exclude, n if rel_dir == "." else f"{rel_dir}/{n}")]
                dirnames[:] = [n for n in dirnames if n in keep]
                filenames = [n for n in filenames if n in keep]
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
            h.update(entry_v2(rel, kind, body) if version == 2 else rel + b"\0" + kind + b"\0" + body + b"\n")
    except OSError as e:
        raise TkboxError(f"cannot read the workspace {root}: {e.strerror or e} ({e.filename})") from None
    return (V2_PREFIX if version == 2 else "sha256:") + h.hexdigest()


def digest_v2(entries: list[tuple[bytes, bytes, bytes]]) -> str:
    """Version 2 of a tree given as its entries (relative path, kind, body as `tree_digest` makes them), in any order:
    what a copy states of the bytes it wrote (box/workspace_seed.py), so it never reads the tree a second time."""
    h = hashlib.sha256(b"tkbox-tree-2\0")
    for rel, kind, body in sorted(entries, key=lambda e: e[0]):
        h.update(entry_v2(rel, kind, body))
    return V2_PREFIX + h.hexdigest()


def entry_v2(rel: bytes, kind: bytes, body: bytes) -> bytes:
    """One entry of version 2: each field (path, kind, then the hex content digest, the target or nothing) as its
    length in 8 bytes big-endian and its bytes."""
    return b"".join(len(part).to_bytes(8, "big") + part for part in (rel, kind, body))


def _raise(e: OSError) -> None:
    raise e  # a directory the walk cannot list is an error, never hashed as empty


def _file_digest(path: str) -> bytes:
    f = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            f.update(chunk)
    return f.hexdigest().encode()


def excluded(patterns: list[str], rel: str) -> str | None:
    """The first pattern that leaves the workspace path `rel` (relative, '/'-separated) out, or None. A pattern
    without '/' matches any one component (so `.git` leaves out every .git and all under it); one with '/' matches
    the path from the root, or any leading part of it (a directory and all under it)."""
    parts = rel.split("/")
    for pattern in patterns:
        if "/" not in pattern:
            if any(fnmatch.fnmatchcase(p, pattern) for p in parts):
                return pattern
        else:
            pat = pattern.strip("/")
            if any(fnmatch.fnmatchcase("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
                return pattern
    return None
