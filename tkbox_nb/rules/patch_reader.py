"""The host's reader of a patch stream from the box (wire format in tkbox_nb/guest/patch.py). Sans-IO: bytes in,
entries out, so it can be fuzzed.

The box is hostile: every header is checked for shape and bounded; a file's content is kept only up to the
largest file the policy could accept, and the bytes of a larger one are counted and dropped, never buffered. A
malformed stream (a header that is not a JSON object of the known fields, a size that is not a count, more entries
or bytes than any patch may hold) is a protocol violation that ends the box.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from tkbox_nb.guest.protocol import ProtocolError

HEADER = struct.Struct(">I")
MAX_HEADER = 64 * 1024
MAX_ENTRIES = 100_000
FIELDS = {"path": str, "op": str, "type": str, "mode": int, "size": int, "from": str, "target": str}
REQUIRED = ("path", "op", "type", "mode", "size")


@dataclass
class Entry:
    """One change as the box stated it. `content` is None when its size was over what is kept (then `dropped`)."""

    path: str
    op: str
    type: str
    mode: int
    size: int
    content: bytes | None
    source: str | None = None   # a rename's `from`
    target: str | None = None   # a symlink's target, as stated (never applied)
    not_utf8: bool = False      # a name that was not UTF-8 (kept with its bad parts escaped, so it can be recorded)

    @property
    def dropped(self) -> bool:
        return self.content is None and self.op != "delete"


class PatchReader:
    """Feed the bytes of a patch stream; get whole entries. `keep_bytes` bounds one file's kept content,
    `max_stream_bytes` the whole stream (a box past it is flooding the door)."""

    def __init__(self, keep_bytes: int, max_stream_bytes: int, max_entries: int = MAX_ENTRIES):
        self.keep_bytes = keep_bytes
        self.max_stream_bytes = max_stream_bytes
        self.max_entries = max_entries
        self.entries = 0
        self.received = 0
        self._buf = bytearray()
        self._header: dict | None = None
        self._left = 0            # content bytes of the current entry still to come
        self._keep: bytearray | None = None

    def feed(self, data: bytes) -> list[Entry]:
        self.received += len(data)
        if self.received > self.max_stream_bytes:
            raise ProtocolError(f"a patch stream over {self.max_stream_bytes} bytes")
        if self._buf:  # a header cut by the last feed: joined once with these bytes (it is at most 64 KiB)
            data = bytes(self._buf) + bytes(data)
            self._buf.clear()
        view = memoryview(data)
        pos, end = 0, len(view)  # one pass with an offset: no copy of what is left after each entry
        out: list[Entry] = []
        while True:
            if self._header is not None:  # inside an entry's content
                take = min(self._left, end - pos)
                if self._keep is not None:
                    self._keep += view[pos:pos + take]
                pos += take
                self._left -= take
                if self._left:
                    return out
                out.append(self._finish())
                continue
            if end - pos < HEADER.size:
                self._buf += view[pos:]
                return out
            (length,) = HEADER.unpack_from(view, pos)
            if not 0 < length <= MAX_HEADER:
                raise ProtocolError(f"a patch entry header of {length} bytes (at most {MAX_HEADER})")
            if end - pos < HEADER.size + length:
                self._buf += view[pos:]
                return out
            head = bytes(view[pos + HEADER.size:pos + HEADER.size + length])
            pos += HEADER.size + length
            self._start(parse_header(head))

    def _start(self, header: dict) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise ProtocolError(f"a patch of more than {self.max_entries} entries")
        self._header = header
        self._left = header["size"]
        self._keep = bytearray() if header["size"] <= self.keep_bytes else None

    def _finish(self) -> Entry:
        h, keep = self._header, self._keep
        self._header, self._keep = None, None
        bad = False
        for key in ("path", "op", "type", "from", "target"):
            if isinstance(h.get(key), str) and not _utf8(h[key]):
                h[key], bad = h[key].encode("utf-8", "backslashreplace").decode("utf-8"), True
        return Entry(h["path"], h["op"], h["type"], h["mode"], h["size"],
                     bytes(keep) if keep is not None else None, h.get("from"), h.get("target"), bad)

    def finish(self) -> None:
        """The box said the patch is over: nothing may be left half-sent."""
        if self._header is not None or self._buf:
            raise ProtocolError("the patch stream ended inside an entry")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_header(raw: bytes) -> dict:
    """One entry header: a JSON object of exactly the known fields, each of its type; a size that is a count."""
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("a patch entry header that is not JSON") from None
    if not isinstance(h, dict):
        raise ProtocolError("a patch entry header that is not an object")
    for key, value in h.items():
        want = FIELDS.get(key)
        if want is None:
            raise ProtocolError(f"a patch entry header with the unknown field {key[:40]!r}")
        if not isinstance(value, want) or isinstance(value, bool):
            raise ProtocolError(f"a patch entry header whose {key} is not {want.__name__}")
        if isinstance(value, str) and len(value) > 16384:
            raise ProtocolError(f"a patch entry header whose {key} is over 16384 characters")
    for key in REQUIRED:
        if key not in h:
            raise ProtocolError(f"a patch entry header without {key}")
    if not 0 <= h["size"] < 1 << 53 or not 0 <= h["mode"] <= 0o177777:  # signed: within what the signer takes
        raise ProtocolError("a patch entry header with an impossible size or mode")
    return h
