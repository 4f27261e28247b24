"""The content digest of a dataset mount: the workspace digest's format (core/tree_digest.py, version 2), so one format.

A mount's digest is `tree2:sha256:HEX` over its entries exactly as a workspace's: each entry's relative path, kind
(d, f-, fx, l) and body (a file's SHA-256 in hex, a symbolic link's target), length-prefixed, in the order of the
paths' bytes (never the order the host's directory listing gives). That is a two-level Merkle tree: the leaves are
the files' digests, the root commits to every (path, kind, leaf). A mount of one file is the tree of one entry whose
path is empty. The bundle discloses the entries (`box/mounts/NAME.jsonl`), so `tkbox verify` recomputes the root
from them (`digest_of_entries`) and a rerun or audit names the first file that differs.

Datasets are large and mostly unchanged: each file's digest is cached under $TKBOX_HOME (host-only, never in a box)
by its (path, size, mtime_ns, inode, ctime_ns), so a warm start walks the metadata and reads no file data (the walk
is GNU find's, in its own process; a walk that prints what the cached tree's printed takes its digest unread); a
cold digest hashes several files at once on threads (hashlib releases the GIL while it hashes). The same walk,
metadata only, finds at the box's stop a file that changed under the mount while the box ran (`changes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.core.tree_digest import V2_PREFIX, entry_v2

KINDS = ("d", "f-", "fx", "l")
HASH_THREADS = 8
MAX_ENTRIES = 400_000  # a mount of more entries is refused at start: its disclosed list would pass a bundle entry


@dataclass
class Scan:
    """One walk of a mount's source, as `find` printed it (`raw`), read into entries (rel, kind, link target or "")
    and each entry's metadata key only when needed (`parse`): a warm start whose walk prints the bytes of the walk
    the cache was made from needs neither."""

    root: str
    raw: bytes = b""
    file_count: int = 0
    file_bytes: int = 0
    _entries: list[tuple[bytes, str, bytes]] | None = field(default=None, repr=False)
    _meta: dict[bytes, tuple[int, ...]] | None = field(default=None, repr=False)

    @property
    def entries(self) -> list[tuple[bytes, str, bytes]]:
        if self._entries is None:
            self.parse()
        return self._entries

    @property
    def meta(self) -> dict[bytes, tuple[int, ...]]:  # rel -> (kind mode, size, mtime, ino, ctime)
        if self._meta is None:
            self.parse()
        return self._meta

    @property
    def files(self) -> list[bytes]:
        return [rel for rel, kind, _ in self.entries if kind.startswith("f")]

    def parse(self) -> "Scan":
        """Read the walk, refusing what a box must not be given (a FIFO, socket or device; a symbolic link that
        points out of the source, which the box could not follow to the host anyway)."""
        if self._entries is None:
            self._entries, self._meta, self.file_count, self.file_bytes = _parse(self.root, self.raw)
        return self


def _show(rel: bytes) -> str:
    return rel.decode("utf-8", "replace")[:200] or "."


# one record per entry: "TYPE+MODE SIZE MTIME INODE CTIME" \0 path \0 link target \0 (neither holds a NUL); the
# times as seconds with nine or more decimals, so exact to the nanosecond
FIND_FORMAT = "%y%m %s %T@ %i %C@\\0%P\\0%l\\0"
KIND_BITS = {b"f": stat.S_IFREG, b"d": stat.S_IFDIR, b"l": stat.S_IFLNK}
MAX_WALK_BYTES = 512 << 20  # what find may print of one source: past it (or MAX_ENTRIES) the mount is refused


def scan(root: str, on_start: Callable[[subprocess.Popen], None] | None = None) -> Scan:
    """Walk `root` (a resolved path) without following a link: GNU find (findutils) lists every entry with its
    metadata in its own process, so a host that starts a box meanwhile is not slowed by the walk's thousands of
    stat calls holding this process's interpreter. Nothing is refused yet: `parse` (or a cache hit) says.
    `on_start` gets find's process (MountWalk.cancel kills it)."""
    try:
        st = os.lstat(root)
    except OSError as e:
        raise TkboxError(f"cannot read the mount source {root}: {e.strerror or e} ({e.filename})") from None
    if stat.S_ISREG(st.st_mode):  # a source of one file: one entry, its path empty, read now
        x = st.st_mode & 0o111
        m = (stat.S_IFREG | x, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        return Scan(root, b"%d %d %d %d %d" % m, 1, st.st_size, [(b"", "fx" if x else "f-", b"")], {b"": m})
    if not stat.S_ISDIR(st.st_mode):
        raise TkboxError(f"the mount source {root} is not a directory or regular file")
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: find's complaints can never fill it and stall it
        try:
            proc = subprocess.Popen(["find", root, "-mindepth", "1", "-printf", FIND_FORMAT], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=err, env={"LC_ALL": "C", "PATH": _PATH})
        except OSError as e:
            raise TkboxError(f"cannot walk the mount source {root}: find (findutils) did not start: {e.strerror}") \
                from None
        if on_start is not None:
            on_start(proc)
        with proc:
            raw = _read_walk(proc, root)
        err.seek(0)
        why = err.read(4096).decode("utf-8", "replace").strip().splitlines()
    if proc.returncode != 0:
        raise TkboxError(f"cannot read the mount source {root}: {(why or [f'find exited {proc.returncode}'])[0][:300]}")
    return Scan(root, raw)


def _read_walk(proc: subprocess.Popen, root: str) -> bytes:
    """find's output, read as it comes and refused (find killed) past MAX_ENTRIES records or MAX_WALK_BYTES: a
    source of millions of files costs the host no more than the limit before it is refused."""
    chunks, size, fields = [], 0, 0
    while chunk := proc.stdout.read1(1 << 20):
        chunks.append(chunk)
        size, fields = size + len(chunk), fields + chunk.count(b"\0")
        if fields > 3 * MAX_ENTRIES or size > MAX_WALK_BYTES:
            proc.kill()
            what = f"{MAX_ENTRIES} entries" if fields > 3 * MAX_ENTRIES else \
                f"a walk of {MAX_WALK_BYTES >> 20} MiB lists"
            raise TkboxError(f"the mount source {root} holds more than {what}")
    return b"".join(chunks)


_PATH = "/usr/bin:/bin"


def _ns(t: bytes) -> int:
    sec, _, frac = t.partition(b".")
    ns = int(frac[:9].ljust(9, b"0")) if frac else 0
    return int(sec) * 10**9 + (-ns if sec.startswith(b"-") else ns)


def _parse(root: str, raw: bytes) -> tuple[list, dict, int, int]:
    """The entries and metadata of a walk printed by `scan`, each checked; sorted by path bytes."""
    fields = raw.split(b"\0")
    if len(fields) % 3 != 1 or fields[-1]:
        raise TkboxError(f"cannot read the walk of the mount source {root}: it ends inside a record")
    if len(fields) // 3 > MAX_ENTRIES:
        raise TkboxError(f"the mount source {root} holds more than {MAX_ENTRIES} entries")
    entries, meta, count, size = [], {}, 0, 0
    for i in range(0, len(fields) - 1, 3):
        head, rel, target = fields[i], fields[i + 1], fields[i + 2]
        try:
            mode_s, size_s, mtime, ino, ctime = head[1:].split(b" ")
            kind, x, n = head[:1], int(mode_s, 8) & 0o111, int(size_s)
            bits = KIND_BITS.get(kind)
            m = ((bits or 0) | x, n, _ns(mtime), int(ino), _ns(ctime))
        except ValueError:
            raise TkboxError(f"cannot read the walk of the mount source {root}: a record {head[:80]!r}") from None
        if bits is None:
            raise TkboxError(f"the mount source {root} holds {_show(rel)}, which is not a file, directory or "
                             "symbolic link (a FIFO, socket or device is never mounted into a box)")
        meta[rel] = m
        if kind == b"f":
            entries.append((rel, "fx" if x else "f-", b""))
            count, size = count + 1, size + n
        elif kind == b"d":
            entries.append((rel, "d", b""))
        else:
            inside = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
            if target.startswith(b"/") or inside == b".." or inside.startswith(b"../"):
                raise TkboxError(f"the mount source {root} holds {_show(rel)}, a symbolic link pointing out of it "
                                 f"(to {target.decode('utf-8', 'replace')[:100]}): a mount shows nothing beyond its "
                                 "source; remove the link or mount its target")
            entries.append((rel, "l", target))
    entries.sort(key=lambda e: e[0])
    return entries, meta, count, size


def _cache_path(home: Path, root: str) -> Path:
    return home / "mount-cache" / (hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest() + ".json")


def _load_cache(path: Path) -> dict[str, list]:
    try:
        data = json.loads(path.read_bytes())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a cache that cannot be read is rebuilt: every file is hashed again


def _hash_file(path: bytes) -> bytes:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest().encode()


def _tree_key(s: Scan) -> str:
    """What the whole tree's metadata is: when it is the cached tree's, so are its digest, list and counts. The walk's
    bytes themselves: a walk that prints what the cached one printed (every path, kind, mode, size, time, inode and
    link target, in the same listing order) is of the same tree, which passed every check then."""
    return hashlib.sha256(s.raw).hexdigest()


def digest(s: Scan, home: Path | None, cancelled: threading.Event | None = None) -> tuple[str, bytes]:
    """The mount's digest and its disclosed list (`list_bytes`), reading only the files whose metadata the cache
    under `home` does not hold; then the cache holds every file of this scan (and only those). A tree whose walk is
    the cached tree's (the warm start of an unchanged dataset) takes the cached digest, list and counts without
    reading the walk again. A set `cancelled` stops the hashing at the next file (TkboxError)."""
    cache_file = _cache_path(home, s.root) if home is not None else None
    tree_key = _tree_key(s)
    if cache_file is not None:
        try:
            tree = json.loads(cache_file.with_suffix(".tree").read_bytes())
            if isinstance(tree, dict) and tree.get("key") == tree_key and isinstance(tree.get("digest"), str) \
                    and isinstance(tree.get("files"), int) and isinstance(tree.get("bytes"), int):
                listing = cache_file.with_suffix(".list").read_bytes()
                if hashlib.sha256(listing).hexdigest() == tree.get("list_sha256"):  # not another walk's list
                    s.file_count, s.file_bytes = tree["files"], tree["bytes"]
                    return tree["digest"], listing
        except (OSError, ValueError):
            pass  # no cached tree, or another: each file is looked up below
    s.parse()
    cache = _load_cache(cache_file) if cache_file is not None else {}
    root_b = s.root.encode("utf-8", "surrogateescape")
    bodies: dict[bytes, bytes] = {}
    todo = []
    for rel in s.files:
        key = rel.decode("utf-8", "surrogateescape")
        hit = cache.get(key)
        if isinstance(hit, list) and hit[:-1] == list(s.meta[rel]) and isinstance(hit[-1], str):
            bodies[rel] = hit[-1].encode()
        else:
            todo.append(rel)
    if todo:
        try:
            def one(r: bytes) -> bytes:
                if cancelled is not None and cancelled.is_set():
                    raise TkboxError(f"the digest of the mount source {s.root} was cancelled")
                return _hash_file(os.path.join(root_b, r) if r else root_b)
            with ThreadPoolExecutor(HASH_THREADS) as pool:
                for rel, body in zip(todo, pool.map(one, todo)):
                    bodies[rel] = body
        except OSError as e:
            raise TkboxError(f"cannot read the mount source {s.root}: {e.strerror or e} ({e.filename})") from None
    entries = [(rel, kind.encode(), bodies[rel] if kind.startswith("f") else target)
               for rel, kind, target in s.entries]
    root, listing = digest_of(entries), list_bytes(entries)
    if cache_file is not None:
        cache_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if todo or len(cache) != len(bodies):
            _write_private(cache_file, json.dumps({rel.decode("utf-8", "surrogateescape"): [*s.meta[rel], b.decode()]
                                                   for rel, b in bodies.items()}).encode())
        _write_private(cache_file.with_suffix(".list"), listing)
        _write_private(cache_file.with_suffix(".tree"), json.dumps(
            {"key": tree_key, "digest": root, "files": s.file_count, "bytes": s.file_bytes,
             "list_sha256": hashlib.sha256(listing).hexdigest()}).encode())
    return root, listing


def _write_private(path: Path, data: bytes) -> None:
    """A cache file, whole (beside it, then renamed), readable by this user only."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # two boxes' walks at once
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def digest_of(entries: list[tuple[bytes, bytes, bytes]]) -> str:
    """The root over entries already in path order: exactly tree_digest's version 2."""
    h = hashlib.sha256(b"tkbox-tree-2\0")
    for rel, kind, body in entries:
        h.update(entry_v2(rel, kind, body))
    return V2_PREFIX + h.hexdigest()


def changes(s: Scan) -> list[str]:
    """The paths (in order) whose metadata differs now from scan `s`, or that came or went: a file changed under the
    mount while the box ran. Reads metadata only; a source that cannot be walked now is itself the change."""
    try:
        now = scan(s.root)
        if now.raw == s.raw:  # the walk prints what it printed at the start: nothing changed
            return []
        now.parse()
    except TkboxError as e:
        return [f"(the source: {str(e)[:200]})"]
    keys = sorted(set(s.meta) | set(now.meta))
    return [_show(k) for k in keys if s.meta.get(k) != now.meta.get(k)]


# -- the disclosed list, read back (verify, rerun, audit: hostile input) ------------------------------------------
def list_bytes(entries: list[tuple[bytes, bytes, bytes]]) -> bytes:
    """`box/mounts/NAME.jsonl`: one JSON array [path, kind, body] a line, in order (bytes kept by surrogateescape)."""
    return b"".join(json.dumps([r.decode("utf-8", "surrogateescape"), k.decode(), b.decode("utf-8", "surrogateescape")]
                               ).encode() + b"\n" for r, k, b in entries)


def parse_list(data: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """A disclosed list, strictly: each line [path, kind, body] of strings, a known kind, a file's body 64 hex
    digits, paths strictly increasing by their bytes. Raises ValueError naming the first fault."""
    out: list[tuple[bytes, bytes, bytes]] = []
    for n, line in enumerate(data.split(b"\n")[:-1] if data.endswith(b"\n") or not data else [b"?"], 1):
        item = json.loads(line)
        if not (isinstance(item, list) and len(item) == 3 and all(isinstance(x, str) for x in item)):
            raise ValueError(f"line {n} is not [path, kind, body]")
        rel, kind, body = (x.encode("utf-8", "surrogateescape") for x in item)
        if item[1] not in KINDS or (item[1].startswith("f") and not _is_hex64(body)):
            raise ValueError(f"line {n}: kind {item[1][:4]!r} or its body is not one a mount holds")
        if out and rel <= out[-1][0]:
            raise ValueError(f"line {n}: paths are not in strictly increasing order")
        out.append((rel, kind, body))
    return out


def _is_hex64(b: bytes) -> bool:
    return len(b) == 64 and all(c in b"0123456789abcdef" for c in b)


def first_difference(a: list[tuple[bytes, bytes, bytes]], b: list[tuple[bytes, bytes, bytes]]) -> str | None:
    """The first path (by bytes) whose entry differs between two lists, or None when they are the same."""
    da, db = {e[0]: e[1:] for e in a}, {e[0]: e[1:] for e in b}
    return next((_show(k) for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)), None)


def differing(a: list, b: list, limit: int = 20) -> list[str]:
    da, db = {e[0]: e[1:] for e in a}, {e[0]: e[1:] for e in b}
    return [_show(k) for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)][:limit]


def summary(s: Scan) -> dict[str, Any]:
    return {"files": s.file_count, "bytes": s.file_bytes}


def check_disclosed(signed: Any, files: dict[str, bytes]) -> str:
    """Why the bundle's mount lists (`box/mounts/NAME.jsonl` in `files`) do not open the digests box.start signed
    (`signed`: its `mounts`), or "": each signed mount has its list, each list a signed mount, and each list's root
    and file count are the signed ones."""
    lists = {n[len("box/mounts/"):-len(".jsonl")]: b for n, b in files.items() if n.startswith("box/mounts/")}
    signed = signed if isinstance(signed, dict) else {}
    stray = sorted(set(lists) - set(signed))
    if stray:
        return f"box/mounts/{stray[0][:60]}.jsonl is a list no signed mount names"
    for name, fact in sorted(signed.items()):
        if name not in lists:
            return f"mount {name[:60]}: its file list (box/mounts/{name[:60]}.jsonl) is missing"
        try:
            entries = parse_list(lists[name])
        except (ValueError, UnicodeError, RecursionError) as e:
            return f"mount {name[:60]}: its file list is not one: {str(e)[:120]}"
        got = digest_of(entries)
        want = fact.get("digest") if isinstance(fact, dict) else None
        if got != want:
            return f"mount {name[:60]}: its file list hashes to {got[:25]}..., not the signed {str(want)[:25]}..."
        if fact.get("files") != sum(1 for e in entries if e[1].startswith(b"f")):
            return f"mount {name[:60]}: its file list holds another number of files than the {fact.get('files')} signed"
    return ""
