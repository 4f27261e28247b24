"""TLS to a bound host: terminated with the box's CA, re-originated verified, and every request swapped and checked.

Only connections to hosts that a secret is bound to come here (egress.py tunnels every other one untouched). The
box's side of TLS runs over the door stream with `ssl.SSLObject` (memory BIOs, no socket); the upstream side is a
normal verified TLS socket (the host's trust store, or the policy's `egress.upstream_ca_file`). HTTP/1.1 on both sides
is h11. Per request: it must be for the CONNECT host alone (`bound_target`: one Host header naming it, an
origin-form target), else it is refused 400 before any swap; `secrets.rewrite_request` swaps the placeholder in the
bound header; each swap and each misuse is a signed crossing of the secrets door; a refused misuse is answered 403 and
nothing goes upstream. CONNECT or a switch of protocols inside is refused 501 (`read_request`), and hop-by-hop
headers, Range and If-Range do not go up (`end_to_end`). Each response is scrubbed of every value before the box sees
it, so it must come whole, in bytes the scrubber reads: every request goes upstream with `Accept-Encoding: identity`
whatever the box asked, and a response in any other content coding (or a transfer coding other than chunked), a
partial one (206, Content-Range) or a 101 ends the connection, refused, before any of it reaches the box: a gzipped
echo of the bound header would carry the value past a scrubber of raw bytes. The box gets HTTP's own reason phrase.
Each binding itself is a signed record at the box's start (`bind_secrets`, the egress door's `start`).
"""

from __future__ import annotations

import queue
import socket
import ssl
from typing import TYPE_CHECKING, Callable

import h11

from tkbox_nb.core.errors import DoorRefused
from tkbox_nb.guest import protocol as p
from tkbox_nb.stream.connection import Stream
from tkbox_nb.stream.events import Data
from tkbox_nb.rules.secrets import Binding, Rewrite, Scrubber, error_text, misuses_in, rewrite_request
from tkbox_nb.rules.door_table import SECRETS

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext

MAX_REQUEST_BODY = 16 << 20
IDLE_S = 300.0


class Closed(Exception):
    pass


class Refused(Exception):
    """What the secrets door refuses on a connection to a bound host; the connection ends with this reason, signed in
    its end. `status` is what the box is answered when nothing of a response has reached it yet."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


class Unscrubbable(Refused):
    """A response from a bound host that the scrubber cannot read; its connection ends with this reason."""


def _authority(text: str, default_port: int) -> tuple[str, int] | None:
    """(host as the egress door states it, port) of `host[:port]`, or None when it is no host the door accepts."""
    from tkbox_nb.rules.hostnames import HostError, check_host
    from tkbox_nb.rules.proxy_request import ProxyRequestError, split_authority
    try:
        name, port = split_authority(text, default_port)
        return str(check_host(name)[1]), port
    except (ProxyRequestError, HostError, ValueError):
        return None


def connect_authority(host: str, port: int) -> bytes:
    """The Host header for the CONNECT host: its one spelling (IPv6 in brackets), the port unless it is 443."""
    name = f"[{host}]" if ":" in host else host
    return (name if port == 443 else f"{name}:{port}").encode("ascii")


def bound_target(host: str, port: int, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The origin-form target of a request inside the TLS to a bound host `host:port` (as the egress door stated it),
    or Refused (400): the request must be for that host alone, or a swapped value would go to whatever virtual host
    the Host header or an absolute-form target names at the same server. Exactly one Host header, naming the CONNECT
    host (in any spelling check_host reads as it) with its port (none: 443); a target in origin-form (`*` for
    OPTIONS), or absolute-form `https://` with the CONNECT host's authority, sent on in origin-form. Pure."""
    hosts = [v for k, v in headers if k.lower() == b"host"]
    if len(hosts) != 1:
        raise Refused(f"a request with {len(hosts)} Host headers", 400)
    if _authority(hosts[0].decode("latin-1"), 443) != (host, port):
        raise Refused(f"a request whose Host {hosts[0][:80].decode('latin-1')!r} is not {host}:{port}", 400)
    if target.startswith(b"/") or (target == b"*" and method == b"OPTIONS"):
        return target
    text = target.decode("latin-1")
    if text[:8].lower() == "https://":
        from urllib.parse import urlsplit
        try:
            parts = urlsplit(text)
        except ValueError:
            parts = None
        if parts is not None and _authority(parts.netloc, 443) == (host, port):
            return ((parts.path or "/") + (f"?{parts.query}" if parts.query else "")).encode("latin-1")
        raise Refused(f"a request whose target {text[:80]!r} is not on {host}:{port}", 400)
    raise Refused(f"a request target {text[:80]!r} in neither origin-form nor https:// to {host}", 400)


def for_the_connect_host(host: str, port: int, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers with its (checked) Host header in the CONNECT host's own spelling."""
    return [(k, connect_authority(host, port) if k.lower() == b"host" else v) for k, v in headers]


def identity_only(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers with whatever Accept-Encoding the box sent replaced by `identity`."""
    return [(k, v) for k, v in headers if k.lower() != b"accept-encoding"] + [(b"accept-encoding", b"identity")]


def unscrubbable_coding(headers) -> str:
    """What in a response's headers keeps its body from being scrubbed as sent ("" when nothing does): a
    Content-Encoding other than identity, or a Transfer-Encoding other than chunked."""
    for name, readable in ((b"content-encoding", (b"", b"identity")), (b"transfer-encoding", (b"chunked",))):
        codings = [t.strip().lower() for k, v in headers if k.lower() == name for t in v.split(b",")]
        if any(c not in readable for c in codings):
            return f"{name.decode().title()}: {b', '.join(codings).decode('latin-1')[:80]}"
    return ""


class BoxTLS:
    """The TLS server end facing the box, over one door stream."""

    def __init__(self, box: "DoorContext", stream: Stream, context: ssl.SSLContext, first: bytes):
        self.box, self.stream = box, stream
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        if first:
            self.incoming.write(first)

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.box.conn.send_data(self.stream.sid, p.CH_BYTES, data)

    def _fill(self) -> None:
        try:
            event = self.stream.get(timeout=IDLE_S)
        except queue.Empty:
            raise Closed("idle") from None
        if not isinstance(event, Data):
            self.incoming.write_eof()
            raise Closed("the box closed the connection")
        if event.channel != p.CH_BYTES:
            raise p.ProtocolError(f"egress data on channel {event.channel}")
        self.incoming.write(event.payload)

    def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()

    def recv(self) -> bytes:
        while True:
            try:
                return self.tls.read(65536)
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    def send(self, data: bytes) -> None:
        if data:
            self.tls.write(data)
            self._flush()


def relay_bound(box: "DoorContext", stream: Stream, host: str, port: int, address: str, first: bytes,
                bindings: list[Binding], counts: dict) -> None:
    """Serve one CONNECT to a bound host until either side closes."""
    policy = box.policy
    context = ssl.create_default_context(cafile=policy.get("egress", "upstream_ca_file") or None)
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection((address, port), timeout=policy.get("egress", "connect_timeout_s"))
    upstream = context.wrap_socket(raw, server_hostname=host)  # verified: a bound host must prove who it is
    upstream.settimeout(IDLE_S)
    try:
        box.conn.send_data(stream.sid, p.CH_BYTES, b"HTTP/1.1 200 Connection established\r\n\r\n")
        tls = BoxTLS(box, stream, box.ca.server_context(host), first)
        tls.handshake()
        scrubber_values = [b.value for b in bindings]
        from_box, to_up = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
        while True:
            try:
                request, body = read_request(tls.recv, from_box)
            except Refused as e:  # CONNECT or a switch of protocols (nothing to scrub), or ambiguous framing
                tls.send(_answer(from_box, e.status, f"tkbox secrets door: refused: {e}\n"))
                raise
            if request is None:
                return
            headers = list(request.headers.raw_items())
            try:  # before any swap: a value goes only to the host the door dialled and verified
                target = bound_target(host, port, request.method, request.target, headers)
            except Refused as e:
                sent = b"\n".join([request.target, *(k + b":" + v for k, v in headers), body])
                record_secret_crossings(box, host, bindings, Rewrite(headers=[], misuses=misuses_in(
                    sent, bindings, f"a request for another host ({str(e)[:120]})")), tls=True)
                tls.send(_answer(from_box, e.status, f"tkbox secrets door: refused: {e}\n"))
                raise
            rw = rewrite_request(host, request.target, for_the_connect_host(host, port, headers), bindings, tls=True)
            rw.misuses += misuses_in(body, bindings, "body")
            refused = record_secret_crossings(box, host, bindings, rw, tls=True)
            if refused:
                tls.send(_answer(from_box, 403, f"tkbox secrets door: refused: {refused}\n"))
                return
            upstream.sendall(to_up.send(h11.Request(method=request.method, target=target,
                                                    headers=identity_only(end_to_end(rw.headers)))))
            if body:
                upstream.sendall(to_up.send(h11.Data(data=body)))
            upstream.sendall(to_up.send(h11.EndOfMessage()))
            counts["bytes_up"] += len(body)
            try:
                if not _relay_response(upstream, to_up, tls, from_box, Scrubber(scrubber_values), counts):
                    return
            except Unscrubbable as e:
                if from_box.our_state is h11.SEND_RESPONSE:  # nothing of the response has reached the box
                    why = error_text(e, scrubber_values).partition(": ")[2]  # an upstream's words may echo a value
                    tls.send(_answer(from_box, 502, f"tkbox secrets door: refused the response from {host}: {why}\n"))
                raise
            if from_box.our_state is h11.DONE and from_box.their_state is h11.DONE and \
                    to_up.our_state is h11.DONE and to_up.their_state is h11.DONE:
                from_box.start_next_cycle()
                to_up.start_next_cycle()
            else:
                return
    finally:
        upstream.close()


def end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers without the hop-by-hop ones (those proxy_request.HOP_BY_HOP names, HTTP2-Settings, and
    any the Connection header lists): they are this hop's, and the door speaks its own HTTP/1.1 upstream. Nor Range
    or If-Range: a reflected value read a few bytes at a time is never a whole spelling the scrubber finds."""
    from tkbox_nb.rules.proxy_request import HOP_BY_HOP
    named = {t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")}
    drop = HOP_BY_HOP | {b"http2-settings", b"range", b"if-range"} | named
    return [(k, v) for k, v in headers if k.lower() not in drop]


def switches_protocol(request: h11.Request) -> str:
    """Why the request asks to leave HTTP/1.1 (CONNECT, an Upgrade such as websocket or h2c), or ""."""
    if request.method == b"CONNECT":
        return "CONNECT inside the TLS to a bound host"
    connection = {t.strip().lower() for k, v in request.headers if k == b"connection" for t in v.split(b",")}
    upgrade = [v for k, v in request.headers if k == b"upgrade"]
    if upgrade or b"upgrade" in connection or any(k == b"http2-settings" for k, _ in request.headers):
        return f"a switch of protocols (Upgrade: {(upgrade or [b''])[0][:40].decode('latin-1')})"
    return ""


def read_request(recv: Callable[[], bytes], conn: h11.Connection) -> tuple[h11.Request | None, bytes]:
    """The box's next request and its body (sans-IO but for `recv`, which gives the next bytes, b"" at the end, or
    raises Closed); None at the end. A malformed request raises h11.RemoteProtocolError; CONNECT or an Upgrade
    (websocket, h2c) Refused (501), as its bytes after the switch could not be scrubbed, and h11 pauses on it; a body
    framed ambiguously (proxy_request.framing_problem) Refused (400), as an upstream might read it otherwise.
    Fuzzed."""
    request, body = None, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(recv())
            except Closed:
                return None, b""
            continue
        if isinstance(event, h11.Request):
            if not any(name == b"host" for name, _ in event.headers):  # h11 asks it of HTTP/1.1 only; upstream needs it
                raise h11.RemoteProtocolError("a request to a bound host without a Host header")
            why = switches_protocol(event)
            if why:
                raise Refused(why, 501)
            from tkbox_nb.rules.proxy_request import framing_problem
            why = framing_problem(list(event.headers))
            if why:  # before any byte of it goes upstream: no smuggled request behind an ambiguous length
                raise Refused(why, 400)
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_REQUEST_BODY:
                raise h11.RemoteProtocolError("a request body over 16 MiB to a bound host")
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        else:  # ConnectionClosed, or PAUSED (which h11 would give again and again): the end
            return None, b""


def bind_secrets(box: "DoorContext") -> None:
    """At the box's start, before any connection: each binding is a signed record (its hosts, header, misuse rule,
    source and the placeholder's digest), never its value or its placeholder; a refused one stops the start."""
    for b in box.bindings:
        c = box.recorder.decide(SECRETS, "bind", {
            "name": b.name, "binding_hosts": b.hosts, "binding_header": b.header, "binding_misuse": b.misuse,
            "source": b.source, "placeholder": b.placeholder_digest})
        if not c.allowed:
            raise DoorRefused(f"the secret binding {b.name} was refused", c.rule_ids)
        box.recorder.complete(c, "ok", {})


def record_secret_crossings(box: "DoorContext", host: str, bindings: list[Binding], rw, tls: bool) -> str:
    """Sign each swap and misuse (`tls`: whether the request came over the intercepted TLS); the reason of the first
    refusal, or ""."""
    by_name = {b.name: b for b in bindings}
    for kind, items in (("misuse", rw.misuses), ("swap", rw.swaps)):
        for name, detail in items:
            b = by_name[name]
            facts = {"name": name, "binding_hosts": b.hosts, "binding_header": b.header,
                     "binding_misuse": b.misuse, "host": host, "tls": tls}
            facts.update({"where": detail} if kind == "misuse" else {"header": detail})
            crossing = box.recorder.decide(SECRETS, kind, facts)
            if not crossing.allowed:
                return f"{crossing.verdict.rule}: {crossing.verdict.reason or crossing.reason}"
            box.recorder.complete(crossing, "ok", {})
    return ""


def _relay_response(upstream, to_up: h11.Connection, tls: BoxTLS, from_box: h11.Connection, scrubber: Scrubber,
                    counts: dict) -> bool:
    while True:
        try:
            event = to_up.next_event()
        except h11.RemoteProtocolError as e:  # h11 reads no transfer coding but chunked: gzip is refused here too
            if from_box.our_state is not h11.SEND_RESPONSE:
                raise  # broken or cut short after its head: the connection ends on it
            raise Unscrubbable(f"a response head the door cannot read to scrub ({e})") from None
        if event is h11.NEED_DATA:
            data = upstream.recv(65536)
            to_up.receive_data(data)
            continue
        if isinstance(event, (h11.Response, h11.InformationalResponse)):
            if event.status_code == 101:  # what follows is no HTTP the scrubber reads (h11 only pauses on it)
                raise Unscrubbable("a switch of protocols (101) cannot be scrubbed of secret values")
            coding = unscrubbable_coding(event.headers)
            if coding:
                raise Unscrubbable(f"{coding} cannot be scrubbed of secret values (the door asked for identity)")
            if event.status_code == 206 or any(k.lower() == b"content-range" for k, _ in event.headers):
                # pieces of an echo, each too short to be a spelling the scrubber finds (the door sent no Range)
                raise Unscrubbable("a partial response (206, Content-Range) cannot be scrubbed of secret values")
            headers = [(k, scrubber.scrub(v)) for k, v in event.headers]
            cls = type(event)  # the standard reason phrase: the upstream's own could echo a value in any spelling
            tls.send(from_box.send(cls(status_code=event.status_code, headers=headers,
                                       reason=standard_reason(event.status_code))))
        elif isinstance(event, h11.Data):
            counts["bytes_down"] += len(event.data)
            clean = scrubber.feed(bytes(event.data))
            if clean:
                tls.send(from_box.send(h11.Data(data=clean)))
        elif isinstance(event, h11.EndOfMessage):
            rest = scrubber.flush()
            if rest:
                tls.send(from_box.send(h11.Data(data=rest)))
            tls.send(from_box.send(h11.EndOfMessage()))
            return True
        else:  # ConnectionClosed, PAUSED (given again and again, never more data: a spin) or anything else
            return False


def standard_reason(status: int) -> bytes:
    """The reason phrase HTTP gives a status ("" for one it does not name)."""
    from http import HTTPStatus
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def _answer(conn: h11.Connection, status: int, text: str) -> bytes:
    body = text.encode()
    return conn.send(h11.Response(status_code=status, headers=[("content-type", "text/plain"),
                                                               ("content-length", str(len(body))),
                                                               ("connection", "close")])) + conn.send(
        h11.Data(data=body)) + conn.send(h11.EndOfMessage())
