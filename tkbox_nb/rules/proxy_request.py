"""The first request on an egress connection from the box, parsed by h11 (sans-IO): `CONNECT host:port` (a tunnel)
or an absolute-form request (`GET http://host[:port]/path`, forwarded with `Connection: close`, so every request,
a redirect's included, is a new connection and a new decision).

`ProxyRequestParser.feed(bytes)` returns None until the request head is complete, then a ProxyRequest; anything else
(origin-form, `https://` without CONNECT, a malformed head, a head over 64 KiB, a userinfo part, a bad port) raises
ProxyRequestError with the HTTP status to answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11

MAX_HEAD = 64 * 1024
HOP_BY_HOP = {b"connection", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate", b"keep-alive",
              b"te", b"trailer", b"upgrade"}


class ProxyRequestError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class ProxyRequest:
    method: str
    host: str           # as the box wrote it (validated later by hostnames.check_host)
    port: int
    tunnel: bool        # CONNECT
    target: str = "/"   # origin-form path for a forwarded request
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    rest: bytes = b""   # bytes after the head: a tunnel's first bytes, or the start of a request body
    upstream: bytes = b""  # the head as the origin server gets it (forwarded requests)
    framer: "ProxyRequestParser | None" = field(default=None, repr=False, compare=False)  # frames the body (body())


def _port(text: str, default: int | None) -> int:
    """A port: one to five ASCII digits, 1 to 65535, checked before int() (which raises past 4300 digits, and reads
    other scripts' digits too)."""
    if text == "" and default is not None:
        return default
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 0 < int(text) < 65536:
        raise ProxyRequestError(400, f"bad port {text[:20]!r}")
    return int(text)


def framing_problem(headers: list[tuple[bytes, bytes]]) -> str:
    """Why the request's body framing is ambiguous, or "": both Content-Length and Transfer-Encoding (the door and an
    upstream could each frame the body its own way and read a smuggled request in it), a Transfer-Encoding other than
    exactly `chunked`, or more than one Content-Length (even equal, or a comma-separated list)."""
    te = [v for k, v in headers if k.lower() == b"transfer-encoding"]
    cl = [v for k, v in headers if k.lower() == b"content-length"]
    if te and cl:
        return "a request with both Content-Length and Transfer-Encoding"
    if len(te) > 1 or (te and te[0].strip().lower() != b"chunked"):
        return "a Transfer-Encoding other than one `chunked`"
    if len(cl) > 1 or (cl and not re.fullmatch(rb"[0-9]{1,19}", cl[0].strip())):
        return "more than one Content-Length, or one that is not a number"
    return ""


def split_authority(authority: str, default_port: int | None = None) -> tuple[str, int]:
    """`host:port` (IPv6 in brackets) into (host, port)."""
    if "@" in authority:
        raise ProxyRequestError(400, "a user name in the target")
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0 or authority[end + 1:end + 2] not in ("", ":"):
            raise ProxyRequestError(400, f"bad target {authority[:80]!r}")
        return authority[:end + 1], _port(authority[end + 2:], default_port)
    host, sep, port = authority.rpartition(":")
    if not sep:
        return authority, _port("", default_port)
    return host, _port(port, default_port)


class ProxyRequestParser:
    def __init__(self):
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._size = 0
        self._client: h11.Connection | None = None   # the upstream side of a forwarded request (upstream_head)
        self.ended = False                           # the forwarded request's body is whole
        self.dropped = 0                             # bytes the box sent after it (never forwarded)

    def feed(self, data: bytes) -> ProxyRequest | None:
        self._size += len(data)
        try:
            self._conn.receive_data(data)
            event = self._conn.next_event()
        except h11.RemoteProtocolError as e:
            raise ProxyRequestError(400, f"not an HTTP/1.1 proxy request: {e}") from None
        if event is h11.NEED_DATA:
            if self._size > MAX_HEAD:
                raise ProxyRequestError(431, "a request head over 64 KiB")
            return None
        if not isinstance(event, h11.Request):
            raise ProxyRequestError(400, "not an HTTP/1.1 proxy request")
        method, target = event.method.decode("ascii", "replace"), event.target.decode("ascii", "replace")
        why = framing_problem(list(event.headers))
        if why:
            raise ProxyRequestError(400, why)
        trailing, _ = self._conn.trailing_data
        if method == "CONNECT":
            host, port = split_authority(target)
            return ProxyRequest(method, host, port, True, headers=list(event.headers), rest=bytes(trailing))
        if target.startswith("https://"):
            raise ProxyRequestError(400, "https:// needs CONNECT")
        if not target.startswith("http://"):
            raise ProxyRequestError(400, "only CONNECT and absolute-form http:// requests pass the door")
        try:
            parts = urlsplit(target)
        except ValueError:  # a bracketed host that is not an IPv6 address, such as http://[]/
            raise ProxyRequestError(400, f"bad target {target[:80]!r}") from None
        host, port = split_authority(parts.netloc, 80)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        headers = [(k, v) for k, v in event.headers if k.lower() not in HOP_BY_HOP]
        return ProxyRequest(method, host, port, False, path, headers, bytes(trailing))

    def upstream_head(self, req: ProxyRequest) -> bytes:
        """The request head as the origin server gets it: origin-form, hop-by-hop headers gone, Connection: close."""
        self._client = client = h11.Connection(h11.CLIENT)
        headers = [(k, v) for k, v in req.headers if k.lower() != b"host"]
        host = req.host if req.port == 80 else f"{req.host}:{req.port}"
        return client.send(h11.Request(method=req.method, target=req.target,
                                       headers=[(b"host", host.encode("ascii")), *headers,
                                                (b"connection", b"close")]))

    def body(self, data: bytes) -> bytes:
        """After upstream_head: the request's body as the origin server gets it, from the bytes the box sends after
        the head (its own buffered `rest` first), framed again by its Content-Length or chunks. Once the request has
        ended, nothing more: a request pipelined after it (to another Host, say) never goes upstream, as each
        connection is one decided request (`dropped` counts its bytes). ProxyRequestError for a body h11 cannot read."""
        if self.ended:
            self.dropped += len(data)
            return b""
        out = bytearray()
        try:
            if data:
                self._conn.receive_data(data)
            while True:
                event = self._conn.next_event()
                if event is h11.NEED_DATA:
                    return bytes(out)
                if isinstance(event, h11.Data):
                    out += self._client.send(event)
                    continue
                if isinstance(event, h11.EndOfMessage):
                    out += self._client.send(h11.EndOfMessage())
                self.ended = True  # the end, or PAUSED on an Upgrade (stripped as hop-by-hop): nothing more goes
                self.dropped += len(self._conn.trailing_data[0])
                return bytes(out)
        except h11.ProtocolError as e:
            raise ProxyRequestError(400, f"a request body the door cannot read: {e}"[:200]) from None
