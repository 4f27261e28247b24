"""The package door's host cache (`$TKBOX_HOME/packages/`), shared by the boxes of one home: files by their sha256
(`files/ab/abcd...`), index pages sealed by rules/package_cache.py (`pages/<key>.page`, named by index URL, project
and the asking policy's nameservers, under the key `page.key`).

Every write is whole or absent: a file is moved into place from `tmp/` once its bytes were decided, a page is written
beside its name and renamed over it. Neither is synced to disk (an fsync per page would cost a cold install more than
the page): an entry a crash cut short does not unseal, and a file is hashed whenever it is served. A page entry that
does not unseal (cut short, changed, another key's, another index's) is removed and answered as absent, so the door
asks the index again; the pages together stay under `max_page_bytes` (rules/package_cache.MAX_CACHE_BYTES), the
oldest written going first. A kept file is checked against its name when it is opened (`open_file`): one whose bytes
are not its sha256 is removed, never served.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
from pathlib import Path

from tkbox_nb.rules.package_cache import MAX_CACHE_BYTES, MAX_ENTRY_BYTES, KeptPage, evictions, page_key, seal, unseal

KEY_BYTES = 32


class Cache:
    """The host's package cache at `root`."""

    def __init__(self, root: Path, max_page_bytes: int = MAX_CACHE_BYTES):
        self.root = root
        self.max_page_bytes = max_page_bytes
        self._key: bytes | None = None

    # -- files ---------------------------------------------------------------------------------------------------
    def file_path(self, sha: str) -> Path:
        return self.root / "files" / sha[:2] / sha

    def _tmp(self) -> Path:
        d = self.root / "tmp"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def new_file(self):
        return tempfile.NamedTemporaryFile(dir=self._tmp(), delete=False)

    def keep_file(self, tmp: str, sha: str) -> None:
        path = self.file_path(sha)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.replace(tmp, path)

    def open_file(self, sha: str):
        """The kept file with that sha256, open at its start, or None (a kept file whose bytes are not that is
        removed)."""
        path = self.file_path(sha)
        try:
            handle = open(path, "rb")
        except OSError:
            return None
        if digest(handle, 1 << 62)[0] != sha:
            handle.close()
            path.unlink(missing_ok=True)
            return None
        return handle

    # -- pages ---------------------------------------------------------------------------------------------------
    def page_path(self, index: str, project: str, nameservers=()) -> Path:
        return self.root / "pages" / f"{page_key(index, project, nameservers)}.page"

    def key(self) -> bytes:
        """The cache's own MAC key (made once, 0600; a key file of another size is replaced, which only makes every
        kept page absent)."""
        if self._key is not None:
            return self._key
        path = self.root / "page.key"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = b""
        if len(key) != KEY_BYTES:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".page.key.")  # 0600, O_EXCL
            new = secrets.token_bytes(KEY_BYTES)
            try:
                os.write(fd, new)
                os.fsync(fd)
                os.close(fd)
                if key:  # there, but not a key: replaced
                    os.replace(tmp, path)
                else:    # a second door making it at once keeps the first one made
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        pass
            finally:
                Path(tmp).unlink(missing_ok=True)
            key = path.read_bytes()
        self._key = key
        return key

    def keep_page(self, page: KeptPage) -> None:
        path = self.page_path(page.index, page.project, page.nameservers)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")  # whole or absent; not synced: an
        try:                                                                   # entry a crash cut short does not
            with os.fdopen(fd, "wb") as f:                                     # unseal, and the index is asked
                f.write(seal(self.key(), page))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        entries = []
        for p in path.parent.glob("*.page"):
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((p.name, st.st_size, st.st_mtime))
        for name in evictions(entries, self.max_page_bytes):
            (path.parent / name).unlink(missing_ok=True)

    def page(self, index: str, project: str, nameservers=()) -> KeptPage | None:
        """The page kept for `project` from `index` under `nameservers` (the asking policy's), or None (none, or one
        that does not unseal: removed)."""
        path = self.page_path(index, project, nameservers)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_ENTRY_BYTES + 1)
        except OSError:
            return None
        kept = unseal(self.key(), data, index, project, nameservers)
        if kept is None:
            path.unlink(missing_ok=True)
        return kept


def digest(handle, limit: int) -> tuple[str, int]:
    """(sha256, size) of an open file from its start, reading at most `limit` + 1 bytes."""
    handle.seek(0)
    h, n = hashlib.sha256(), 0
    while n <= limit:
        chunk = handle.read(min(1 << 20, limit + 1 - n))
        if not chunk:
            break
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n
