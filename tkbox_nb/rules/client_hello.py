"""The server name (SNI) a box's TLS client asks for, read sans-IO from the first bytes of a CONNECT tunnel.

The egress door decides a tunnel by its CONNECT host, then relays it untouched; the TLS inside names the site it wants
in its ClientHello, and a front end serving many sites (a CDN) routes by that name, not by the address the door
dialled. So the door reads the ClientHello before any byte of the tunnel goes upstream, and a server name that is
not the CONNECT host (in any spelling `hostnames.check_host` reads as it) is refused. `ClientHelloReader.feed`
takes the box's bytes as they come and returns, once the ClientHello is whole, the name it asks for (None: no
server_name extension, as for an IP address); bytes that start like no TLS handshake give NOT_TLS (the door lets
them through, documented: docs/policy.md); a handshake it cannot read within its limits raises HelloError. Fuzzed.
"""

from __future__ import annotations

MAX_HELLO = 16 * 1024       # the ClientHello message, across records (a post-quantum one is about 2 KiB)
MAX_RECORD = 16 * 1024 + 256
MAX_RECORDS = 32


class _NotTLS:
    def __repr__(self) -> str:
        return "NOT_TLS"


NOT_TLS = _NotTLS()   # what feed gives for bytes that start like no TLS record (never a name a box could send)


class HelloError(ValueError):
    """A TLS handshake from the box that the door cannot read to check its server name."""


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise HelloError("a ClientHello cut short inside a field")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def number(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def vector(self, size: int) -> bytes:
        return self.take(self.number(size))

    def left(self) -> int:
        return len(self.data) - self.pos


def server_name(hello: bytes) -> str | None:
    """The host_name in a whole ClientHello message body (after its 4-byte header), None when it names none."""
    c = _Cursor(hello)
    c.take(2 + 32)                                  # legacy_version, random
    if len(c.vector(1)) > 32:                       # legacy_session_id
        raise HelloError("a session id over 32 bytes")
    suites = c.vector(2)
    if not suites or len(suites) % 2:
        raise HelloError("no cipher suites")
    if not c.vector(1):                             # legacy_compression_methods
        raise HelloError("no compression methods")
    if not c.left():
        return None                                 # no extensions at all
    extensions = _Cursor(c.vector(2))
    if c.left():
        raise HelloError("bytes after the extensions")
    seen, name = set(), None
    while extensions.left():
        kind, body = extensions.number(2), extensions.vector(2)
        if kind in seen:
            raise HelloError(f"extension {kind} twice")
        seen.add(kind)
        if kind == 0:
            name = _host_name(body)
    return name


def _host_name(body: bytes) -> str:
    names = _Cursor(_Cursor(body).vector(2))
    if len(body) != names.left() + 2 or not names.left():
        raise HelloError("a server_name extension that is not one list")
    found = []
    while names.left():
        kind, value = names.number(1), names.vector(2)
        if kind == 0:
            found.append(value)
    if len(found) != 1 or not found[0] or not found[0].isascii():
        raise HelloError("a server_name extension without exactly one ASCII host_name")
    return found[0].decode("ascii")


class ClientHelloReader:
    """Reads the box's first bytes in a tunnel until its ClientHello is whole: its records reassembled as they come
    (each byte looked at once), at most MAX_RECORDS of them and MAX_HELLO bytes of message."""

    def __init__(self):
        self._buffer = bytearray()       # what the box sent so far (all of it goes upstream once the name passes)
        self._pos = 0                    # where the next record starts
        self._handshake = bytearray()    # the handshake messages' bytes from the records so far
        self._records = 0

    def feed(self, data: bytes) -> "str | None | bool | _NotTLS":
        """False while more bytes are needed; then the server name (a str), None when the ClientHello names none, or
        NOT_TLS when the bytes start like no TLS handshake record. HelloError when it cannot be read."""
        self._buffer += data
        buf = self._buffer
        if buf[:1] not in (b"", b"\x16") or buf[1:2] not in (b"", b"\x03"):
            return NOT_TLS  # a TLS record starts 0x16 0x03
        while len(buf) - self._pos >= 5:
            pos = self._pos
            kind, major, length = buf[pos], buf[pos + 1], int.from_bytes(buf[pos + 3:pos + 5], "big")
            if kind != 0x16 or major != 3:
                raise HelloError("a record that is not the handshake's inside a ClientHello")
            if not 0 < length <= MAX_RECORD:
                raise HelloError(f"a TLS record of {length} bytes")
            if len(buf) - pos - 5 < length:
                return False
            self._records += 1
            if self._records > MAX_RECORDS:
                raise HelloError(f"a ClientHello in more than {MAX_RECORDS} records")
            self._handshake += buf[pos + 5:pos + 5 + length]
            self._pos = pos + 5 + length
            hs = self._handshake
            if len(hs) >= 4:
                if hs[0] != 1:
                    raise HelloError("a first handshake message that is not a ClientHello")
                size = int.from_bytes(hs[1:4], "big")
                if size > MAX_HELLO:
                    raise HelloError(f"a ClientHello of {size} bytes (at most {MAX_HELLO})")
                if len(hs) >= 4 + size:
                    if len(hs) > 4 + size:
                        raise HelloError("bytes after the ClientHello in its records")
                    return server_name(bytes(hs[4:]))
        return False

    @property
    def buffered(self) -> bytes:
        return bytes(self._buffer)


class TunnelGate:
    """The box's bytes in a tunnel to `host` (as the egress door stated it): held until its ClientHello is whole,
    then all let through when it names `host` in any spelling check_host reads as it (or names none, or the bytes are
    no TLS); HelloError when it names another host or cannot be read. Nothing goes upstream before that."""

    def __init__(self, host: str):
        self.host, self.reader, self.open = host, ClientHelloReader(), False

    def feed(self, data: bytes) -> bytes:
        """What of the box's bytes may go upstream now."""
        if self.open:
            return data
        name = self.reader.feed(data)
        if name is False:
            return b""
        if isinstance(name, str):
            from tkbox_nb.rules.hostnames import HostError, check_host
            try:
                named = str(check_host(name)[1])
            except HostError:
                named = None
            if named != self.host:
                raise HelloError(f"the TLS server name {name[:80]!r} is not the CONNECT host {self.host}")
        self.open = True
        return self.reader.buffered
