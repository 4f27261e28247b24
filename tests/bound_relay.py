"""The secrets door's relay to a bound host, driven without a box or a network namespace: the egress door's
`_relay_bound` (intercept.relay_bound under it) with an in-memory door stream, a recorder that decides with the real
policy, and a TLS upstream on 127.0.0.1 whose certificate comes from a CA of its own (the policy's
`egress.upstream_ca_file`). The box's side is a real TLS client over the in-memory stream."""

from __future__ import annotations

import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tkbox_nb.guest import protocol as p
from tkbox_nb.rules.box_ca import BoxCA
from tkbox_nb.doors.egress import EgressDoor
from tkbox_nb.rules.proxy_request import ProxyRequest
from tkbox_nb.rules.secrets import Binding
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import Crossing, sha256_digest
from tkbox_nb.stream.events import EVENTS, Close, Data

HOST = "api.tkb.test"
VALUE = "sk-live-REALSECRETVALUE-0123456789abcdef"


class _Events(queue.Queue):
    """As a real stream's queue (stream/connection.py), it takes only the door stream's typed events."""

    def _put(self, item) -> None:
        if type(item) not in EVENTS:
            raise TypeError(f"{type(item).__name__} is no door stream event")
        super()._put(item)


class FakeStream:
    def __init__(self):
        self.sid, self.events = 1, _Events()

    def get(self, timeout=None):
        return self.events.get(timeout=timeout)


class FakeConn:
    def __init__(self):
        self.out = queue.Queue()

    def send_data(self, sid, channel, data):
        self.out.put(bytes(data))

    def close(self, sid, body=None):
        self.out.put(None)

    def can_splice(self):
        return False


class FakeRecorder:
    """Decides with the box policy and keeps (kind, door, what, facts or result, verdict) for each call."""

    def __init__(self, policy: Policy):
        self.policy, self.log, self.broken = policy, [], None

    def decide(self, door, kind, facts, content=None):
        v = self.policy.decide(dict(facts, door=door, kind=kind))
        self.log.append(("decide", door, kind, facts, v.verdict))
        args = dict(facts, rule=v.rule, **{k: sha256_digest(c) for k, c in (content or {}).items()})
        return Crossing(f"{door}-{len(self.log)}", door, args, v, decision=v.verdict,
                        decision_id="d" if v.verdict == "allow" else None)

    def complete(self, crossing, status, result, content=None):
        self.log.append(("complete", crossing.tool, status, result, None))

    def model_event(self, *args, **kwargs):
        pass


@dataclass
class FakeBox:
    policy: Policy
    bindings: list
    box_id: str = "test"
    workspace: None = None
    ended: str | None = None
    ca: BoxCA = field(default_factory=lambda: BoxCA("test"))
    conn: FakeConn = field(default_factory=FakeConn)
    recorder: FakeRecorder = None

    def __post_init__(self):
        self.recorder = FakeRecorder(self.policy)

    def fail_closed(self, reason):
        self.ended = reason


class Upstream:
    """A TLS server for HOST on 127.0.0.1: each connection's request head (and what follows it in the first reads)
    is kept in `seen`, and answered with `answer(head)`."""

    def __init__(self, tmp: Path, answer: Callable[[bytes], bytes]):
        self.ca = BoxCA("upstream")
        self.cafile = tmp / "upstream-ca.pem"
        self.cafile.write_bytes(self.ca.pem())
        self.answer, self.seen = answer, []
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        context = self.ca.server_context(HOST)
        while True:
            try:
                raw, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(context, raw), daemon=True).start()

    def _one(self, context, raw):
        raw.settimeout(5)
        try:
            tls = context.wrap_socket(raw, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                more = tls.recv(65536)
                if not more:
                    break
                data += more
            self.seen.append(data)
            if data:
                tls.sendall(self.answer(data))
            tls.close()
        except (OSError, ssl.SSLError):
            pass

    def policy(self) -> Policy:
        return Policy.from_toml(f'[egress]\nallow = ["{HOST}:*"]\nupstream_ca_file = "{self.cafile}"\n')


@dataclass
class Relayed:
    read: bytes            # what the box read, decrypted
    box: FakeBox
    thread: threading.Thread

    @property
    def signed_end(self) -> dict:
        return [e for e in self.box.recorder.log if e[0] == "complete" and e[1] == "egress"][-1][3]

    def secrets_records(self) -> list:
        return [e[2:] for e in self.box.recorder.log if e[0] == "decide" and e[1] == "secrets"]


def binding(**kw) -> Binding:
    return Binding("API_KEY", [HOST], "Authorization", "Bearer {value}", "env:X", value=VALUE, **kw)


def relay(upstream: Upstream, request: bytes | Callable[[Binding], bytes], bindings: list | None = None,
          timeout: float = 5.0, door: EgressDoor | None = None) -> Relayed:
    """One CONNECT to HOST (bound) through the egress door (a new one for a new box, or `door`): the box sends
    `request` over TLS and reads until the door closes the stream (or `timeout`); the box's stream is then closed."""
    bindings = bindings if bindings is not None else [binding()]
    box = door.box if door else FakeBox(upstream.policy(), bindings)
    stream = FakeStream()
    crossing = Crossing("egress-1", "egress", {"host": HOST}, None, decision="allow", decision_id="d")
    req = ProxyRequest("CONNECT", HOST, upstream.port, True)
    thread = threading.Thread(target=(door or EgressDoor(box))._relay_bound,
                              args=(stream, req, crossing, "127.0.0.1", bindings), daemon=True)
    thread.start()
    data = request(bindings[0]) if callable(request) else request
    read = _box_client(box, stream, data, timeout)
    stream.events.put(Close({}))
    return Relayed(read, box, thread)


def _box_client(box: FakeBox, stream: FakeStream, request: bytes, timeout: float) -> bytes:
    context = ssl.create_default_context(cadata=box.ca.pem().decode())
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=HOST)
    deadline = time.monotonic() + timeout
    first = box.conn.out.get(timeout=timeout)
    assert first is not None and first.startswith(b"HTTP/1.1 200"), first

    def pump():
        data = outgoing.read()
        if data:
            stream.events.put(Data(p.CH_BYTES, data))

    def fill() -> bool:
        data = box.conn.out.get(timeout=max(0.01, deadline - time.monotonic()))
        if data is None:
            incoming.write_eof()
            return False
        incoming.write(data)
        return True

    while True:
        try:
            tls.do_handshake()
            pump()
            break
        except ssl.SSLWantReadError:
            pump()
            fill()
    tls.write(request)
    pump()
    got = b""
    while time.monotonic() < deadline:
        try:
            data = tls.read(65536)
            if not data:
                break
            got += data
        except ssl.SSLWantReadError:
            try:
                if not fill():
                    break
            except queue.Empty:
                break
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            break
    return got


@dataclass
class HeldTunnel:
    door: EgressDoor
    box: FakeBox
    relay: threading.Thread
    held: list             # the upstream's accepted (connection, address), once accepted
    server: socket.socket

    def wait_accepted(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.held and time.monotonic() < deadline:
            time.sleep(0.05)


def held_tunnel(door_setup: Callable[[EgressDoor], None] | None = None) -> HeldTunnel:
    """A tunnel relayed by the real EgressDoor (on a new FakeBox, `door_setup` applied to the door before the relay
    starts) to an upstream on 127.0.0.1 that accepts and then neither sends nor closes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    box = FakeBox(Policy.from_toml('[egress]\nallow = ["allowed.example:*"]\n'), [])
    door = EgressDoor(box)
    if door_setup:
        door_setup(door)
    crossing = Crossing("egress-1", "egress", {"host": "allowed.example"}, None, decision="allow", decision_id="d")
    req = ProxyRequest("CONNECT", "allowed.example", server.getsockname()[1], True)
    relay = threading.Thread(target=door._relay, args=(FakeStream(), req, crossing, "127.0.0.1"), daemon=True)
    relay.start()
    return HeldTunnel(door, box, relay, held, server)
