"""One run's view of the machine signer's file store, at a cost that does not grow with the store's history.

Why: Tracekit's `FileReader` indexes the whole store on open (every line of records.jsonl parsed, every leaf hashed
into a tree in memory), so exporting a run through it costs time in proportion to every run the machine signer has
ever signed; polling for the checkpoint re-opened it each round (docs/bundle-format.md#export-cost). This view reads
only what `tracekit.bundle_v2.export` needs for one run, through the reader interface `FileReader` documents
(iter_run, iter_range, tree, anchors):

- the run's records: found by reading records.jsonl backwards from the checkpoint's end until the run's run_seq 0, so
  the cost follows the records written while the run was open (by every run), not the store's age;
- the key records (signer.epoch, key.retire): a small index beside the store, in the signer's own directory, that
  grows as the log grows (each export scans only the bytes written since the last one); `iter_range` yields only
  these, which is the one thing export reads a range for when it exports one run;
- the record tree at the checkpoint's size: the store's full hash tiles (tlog-tiles layout, written by the signer as
  each fills) plus the leaf hashes of the last unfinished tile, read from records.jsonl.

Nothing here is trusted more than the store itself: export checks the tree's root against the signed checkpoint note,
every record is parsed strictly and must be of the run (tenant and run_id) with run_seq 0..n-1 in order, and
`tracekit verify` checks the bundle. A store file that is a symlink, not the store owner's, or writable by group or
others is refused, as FileReader refuses it. Any mismatch raises SignerError: the export fails closed.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tkbox_nb.core.atomic_file import reserve_beside
from tkbox_nb.core.errors import SignerError

KEY_TYPES = ("signer.epoch", "key.retire")
KEY_MARKS = tuple(f'"type":"{t}"'.encode() for t in KEY_TYPES)  # how the signer writes a record's type (compact JSON)
CHUNK = 1 << 16
TILE_H, TILE_W = 8, 256  # tlog-tiles: 8 tree levels per tile, 256 hashes in a full tile
INDEX_VERSION = 2


def _raw(h: str) -> bytes:
    if not isinstance(h, str) or not h.startswith("sha256:") or len(h) != 71:
        raise SignerError(f"a record hash is malformed: {str(h)[:80]}")
    return bytes.fromhex(h[7:])


class _ReadOnlyTiles:
    """The store's tiles of one tree, read-only (a tlog-tiles store: get(level, index, width))."""

    def __init__(self, root: str, owner: int):
        self.root, self.owner = root, owner

    def get(self, level, index, width):
        try:
            return _read_checked(os.path.join(self.root, str(level), f"{index}.{width}"), self.owner)
        except FileNotFoundError:
            return None

    def put(self, level, index, width, data):  # pragma: no cover - export never writes
        raise SignerError("the store view is read-only")


def _read_checked(path: str, owner: int, at: int = 0, size: int = -1) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_uid != owner:
            raise SignerError(f"{path}: not a file of the store's owner, or writable by group or others")
        return os.pread(fd, st.st_size - at if size < 0 else size, at)
    finally:
        os.close(fd)


class StoreView:
    """What `bundle_v2.export` reads for run (`tenant`, `run_id`) of the file store at `root`, up to the checkpoint
    `note` (its text). `index_path`: the key-record index, a file this view may rewrite (never inside the store)."""

    def __init__(self, root: str | Path, tenant: str, run_id: str, index_path: str | Path):
        from tracekit.merkle import leaf_hash
        from tracekit.merkle.tiles import Tree

        self.root, self.tenant, self.run_id = str(root), tenant, run_id
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
            raise SignerError(f"{self.root}: not the signer's store directory, or writable by group or others")
        self.owner = st.st_uid
        self.log_path = os.path.join(self.root, "records.jsonl")
        self.index_path = Path(index_path)
        self._leaf_hash, self._Tree = leaf_hash, Tree
        self.tree = None
        self.records: list[dict] = []

    # -- the checkpoint ------------------------------------------------------------------------------------------
    def checkpoint_latest(self):
        """(size, note) of the store's latest record-tree note, or None: one small file, read again on each call."""
        try:
            data = _read_checked(os.path.join(self.root, "checkpoint.note"), self.owner)
        except FileNotFoundError:
            return None
        note = data.decode("utf-8", "strict")
        try:
            return int(note.split("\n", 2)[1]), note
        except (IndexError, ValueError):
            raise SignerError("the store's checkpoint note is malformed") from None

    # -- the log -------------------------------------------------------------------------------------------------
    def _log(self) -> tuple[int, int]:
        fd = os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_uid != self.owner:
            os.close(fd)
            raise SignerError(f"{self.log_path}: not a file of the store's owner, or writable by group or others")
        return fd, st.st_size

    @staticmethod
    def _parse(line: bytes) -> dict:
        try:
            r = json.loads(line)
            r["event"]["seq"], r["event"]["run_id"], r["event"]["type"]  # noqa: B018 - the fields export reads
        except (ValueError, KeyError, TypeError):
            raise SignerError(f"records.jsonl holds a line that is no record: {line[:80]!r}") from None
        return r

    def _lines_back(self, fd: int, end: int):
        """(offset, line) of the complete lines before byte `end` of the log, last first (a torn last line, the writer
        mid-append, is skipped)."""
        tail, at, first = b"", end, True
        while at > 0:
            start = max(0, at - CHUNK)
            buf = os.pread(fd, at - start, start) + tail
            at = start
            lines = buf.split(b"\n")
            if first:
                lines.pop()  # after the last newline: empty, or the writer's torn line
                if not lines:  # no newline yet: all of it is that torn line
                    continue
                first = False
            tail = lines.pop(0) if at > 0 and lines else b""
            pos = at + (len(tail) + 1 if at > 0 else 0)
            found = []
            for line in lines:
                found.append((pos, line))
                pos += len(line) + 1
            for off, line in reversed(found):
                if line:
                    yield off, line

    def _scan(self, fd: int, file_end: int, size: int | None) -> tuple[list[dict], list[bytes]]:
        """The run's records below tree size `size` (None: all the log holds), and the leaf hashes of the records of
        the last unfinished tile below `size`, both in log order. Reads back from the end until the run's run_seq 0."""
        run, tail_leaves, end_found = [], [], size is None
        first_tile = 0 if size is None else size - size % TILE_W
        want_leaves = 0 if size is None else size - first_tile
        mark = self.run_id.encode()
        for _, line in self._lines_back(fd, file_end):
            if end_found and len(tail_leaves) >= want_leaves and mark not in line:
                continue  # most lines: neither past the checkpoint, in its last tile, nor the run's
            r = self._parse(line)
            e = r["event"]
            if size is not None and e["seq"] >= size:
                continue
            end_found = True
            if size is not None and e["seq"] >= first_tile:
                tail_leaves.append(self._leaf_hash(_raw(r["hash"])))
            if e["run_id"] == self.run_id and e.get("tenant") == self.tenant:
                run.append(r)
            if run and run[-1]["event"]["run_seq"] == 0 and len(tail_leaves) >= want_leaves:
                break
        run.reverse()
        if not run or [r["event"]["run_seq"] for r in run] != list(range(len(run))):
            where = "" if size is None else f" below tree size {size}"
            raise SignerError(f"the signer has no run {self.run_id}{where}" if not run else
                              f"the signer's store holds run {self.run_id} incomplete{where}")
        if len(tail_leaves) != want_leaves:
            raise SignerError(f"the signer's store ends before tree size {size}")
        return run, tail_leaves[::-1]

    def run_records(self) -> list[dict]:
        """The run's records the log holds now, checkpointed or not (to learn which record a checkpoint must cover).
        `more_records` then reads only what the log gains."""
        fd, file_end = self._log()
        try:
            self._followed = self._complete_end(fd, file_end)
            self._run_now = self._scan(fd, self._followed, None)[0]
            return self._run_now
        finally:
            os.close(fd)

    def more_records(self) -> list[dict]:
        """The run's records, those written since the last call read too (from where that call stopped)."""
        fd, file_end = self._log()
        try:
            end = self._complete_end(fd, file_end)
            if end > self._followed:
                data = os.pread(fd, end - self._followed, self._followed)
                mark = self.run_id.encode()
                for line in data.split(b"\n")[:-1]:
                    if mark in line:
                        r = self._parse(line)
                        if r["event"]["run_id"] == self.run_id and r["event"].get("tenant") == self.tenant:
                            if r["event"]["run_seq"] != len(self._run_now):
                                raise SignerError(f"the signer's store holds run {self.run_id} out of order")
                            self._run_now.append(r)
                self._followed = end
            return self._run_now
        finally:
            os.close(fd)

    @staticmethod
    def _complete_end(fd: int, file_end: int) -> int:
        """Where the log's last complete line ends (a torn last line is the writer mid-append)."""
        at = file_end
        while at > 0:
            start = max(0, at - CHUNK)
            cut = os.pread(fd, at - start, start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            at = start
        return 0

    def load(self, size: int) -> None:
        """Read what an export up to tree size `size` needs: the run's records below it, the key records, the tree."""
        fd, file_end = self._log()
        try:
            self.records, tail_leaves = self._scan(fd, file_end, size)
            self.keys = self._key_records(fd, file_end, size)
            self.tree = self._tree(size, tail_leaves)
        finally:
            os.close(fd)

    # -- key records ---------------------------------------------------------------------------------------------
    def _key_records(self, fd: int, file_end: int, size: int) -> list[dict]:
        """The key records below tree size `size`, from the index, brought up to the log's end first."""
        st = os.fstat(fd)
        index = {"v": INDEX_VERSION, "ino": st.st_ino, "upto": 0, "keys": [], "up": {}}
        try:
            old = json.loads(self.index_path.read_bytes())
            if old.get("v") == INDEX_VERSION and old.get("ino") == st.st_ino and 0 <= old.get("upto", -1) <= file_end:
                index = old
        except (OSError, ValueError, AttributeError):
            pass
        at, grew = index["upto"], False
        while at < file_end:
            buf = os.pread(fd, min(file_end - at, 1 << 24), at)
            cut = buf.rfind(b"\n") + 1
            if not cut:
                break
            buf = buf[:cut]
            for mark in KEY_MARKS:
                i = buf.find(mark)
                while i >= 0:
                    s = buf.rfind(b"\n", 0, i) + 1
                    e = buf.index(b"\n", i)
                    if self._parse(buf[s:e])["event"]["type"] in KEY_TYPES:
                        index["keys"].append([at + s, e - s])
                    i = buf.find(mark, e)
            at, grew = at + cut, True
        index["keys"] = sorted({tuple(k) for k in index["keys"]})
        index["upto"] = at
        out = []
        for off, n in index["keys"]:
            r = self._parse(os.pread(fd, n, off))
            if r["event"]["type"] not in KEY_TYPES:
                raise SignerError("the key-record index does not match the store; delete it to rebuild it")
            if r["event"]["seq"] < size:
                out.append(r)
        self._index, self._index_grew = index, grew
        return sorted(out, key=lambda r: r["event"]["seq"])

    def _save_index(self) -> None:
        if not self._index_grew:
            return
        self._index["keys"] = [list(k) for k in self._index["keys"]]
        tmp = reserve_beside(self.index_path)
        try:
            tmp.write_text(json.dumps(self._index, separators=(",", ":")))
            os.replace(tmp, self.index_path)
        except OSError:  # the index is a cache: the next export rebuilds what is missing
            tmp.unlink(missing_ok=True)

    # -- the record tree -----------------------------------------------------------------------------------------
    def _tree(self, size: int, tail_leaves: list[bytes]):
        """The record tree of `size` leaves: full tiles from the store, the unfinished edge rebuilt. The edge of level
        L>0 is the reduced hashes of the full tiles of level L-1 it is made of (fewer than 256), kept in the index."""
        from tracekit.merkle.tiles import _reduce  # noqa: PLC2701 - the RFC 6962 subtree hash tiles use

        tiles = _ReadOnlyTiles(os.path.join(self.root, "tiles", "records"), self.owner)
        up = self._index.setdefault("up", {})
        edge = [tail_leaves]
        while size >> (TILE_H * len(edge)):
            level = len(edge)
            c = size >> (TILE_H * level)
            lo = c - c % TILE_W  # the edge of this level: the hashes of tiles lo..c-1 of the level below
            kept = up.get(str(level)) or {"base": lo, "hashes": []}
            if not lo <= kept["base"] + len(kept["hashes"]) or kept["base"] > lo:
                kept = {"base": lo, "hashes": []}  # a block behind, or a tree older than the index: start afresh
            kept = {"base": lo, "hashes": kept["hashes"][lo - kept["base"]:]}  # only this block: the index stays small
            for i in range(lo + len(kept["hashes"]), c):  # the reduced hash of each full tile below, once
                data = tiles.get(level - 1, i, TILE_W)
                if data is None or len(data) != 32 * TILE_W:
                    raise SignerError(f"the store's tile {level - 1}/{i}.{TILE_W} is missing or damaged")
                kept["hashes"].append(_reduce([data[j:j + 32] for j in range(0, len(data), 32)]).hex())
                self._index_grew = True
            up[str(level)] = kept
            edge.append([bytes.fromhex(h) for h in kept["hashes"][:c - lo]])
        self._save_index()
        return self._Tree(tiles, size, edge)

    # -- what bundle_v2.export reads -------------------------------------------------------------------------------
    def iter_run(self, tenant, run_id):
        return iter(self.records if (tenant, run_id) == (self.tenant, self.run_id) else [])

    def iter_range(self, lo, hi):
        """The key records in [lo, hi): the only records export reads from a range when it exports one run."""
        return (r for r in self.keys if lo <= r["event"]["seq"] < hi)

    def anchors(self):
        try:
            data = _read_checked(os.path.join(self.root, "anchors.jsonl"), self.owner)
        except FileNotFoundError:
            return []
        lines = data[:data.rfind(b"\n") + 1].split(b"\n")[:-1]
        return list({a["size"]: a for a in map(json.loads, lines)}.values())

    def close(self):
        """Nothing to release: the view holds no file open."""
