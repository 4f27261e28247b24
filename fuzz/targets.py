"""The fuzz targets: one function of bytes per parser of box or bundle input, each asserting that parser's contract.

A target returns normally when the input was handled as documented (parsed, or refused with the parser's own error
type) and raises anything else: an AssertionError when a contract does not hold, or the unexpected exception itself.
The same functions run under hypothesis in CI (tests/test_fuzz_targets.py) and under atheris (`python -m fuzz`).

Structured targets read their choices from the input with `Input` (like libFuzzer's FuzzedDataProvider), so a
coverage-guided fuzzer and hypothesis drive them alike.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import hashlib
import io
import ipaddress
import json
import re
import ssl
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import h11
from cryptography import x509
from cryptography.x509.oid import NameOID

from tkbox_nb.guest import protocol as p
from tkbox_nb.backends.linux_kernel import ElfInfo, KernelImageError, elf_info, extract_vmlinux
from tkbox_nb.rules.jupyter_messages import check_box_message, names_host_magic
from tkbox_nb.rules.output_sanitiser import ALLOWED as ALLOWED_MIME
from tkbox_nb.rules.output_sanitiser import BOX_PROMPT
from tkbox_nb.rules.widget_state import HTML_WIDGETS, LINK_MODELS, OUTPUT_WIDGETS, model_keys, widget_kind
from tkbox_nb.bundle.archive import MAX_ENTRY, MAX_TOTAL, check_name, parse, read_entries
from tkbox_nb.rules.addresses import classify, embedded_ipv4, parse_ip_literal, refused_name
from tkbox_nb.rules.box_ca import BoxCA
from tkbox_nb.rules.client_hello import ClientHelloReader, HelloError, TunnelGate
from tkbox_nb.doors.egress import MAX_ADDRESSES, REASONS, stated_facts
from tkbox_nb.rules.hostnames import MAX_NAME, HostError, check_host
from tkbox_nb.doors.intercept import Refused, bound_target, end_to_end, for_the_connect_host, read_request
from tkbox_nb.guest import vm
from tkbox_nb.rules.proxy_request import HOP_BY_HOP, ProxyRequestError, ProxyRequestParser
from tkbox_nb.rules.secrets import Binding, Scrubber, encoded_forms, host_matches, misuses_in, rewrite_request
from tkbox_nb.core.errors import BundleError, PolicyError, TkboxError
from tkbox_nb.guest.agent import command_request
from tkbox_nb.policy import _SCHEMA, Policy, Verdict, policy_hash
from tkbox_nb.audit.compare import _facts, parse_sanitizers
from tkbox_nb.audit.door_items import _sanitize
from tkbox_nb.rules.door_table import names
from tkbox_nb.audit.replay import to_notebook
from tkbox_nb.bundle.read_back import Run
from tkbox_nb.bundle.verify import verify_bytes
from tkbox_nb.bundle.verify_report import EXIT_INVALID, EXIT_UNREADABLE, EXIT_VALID, VerifyReport

from . import seeds


@dataclass(frozen=True)
class Target:
    name: str
    fn: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]
    doc: str


TARGETS: dict[str, Target] = {}


def target(name: str, seed_fn: Callable[[], list[bytes]]):
    def register(fn):
        TARGETS[name] = Target(name, fn, seed_fn, " ".join((fn.__doc__ or "").split()))
        return fn
    return register


class Input:
    """Choices read from the fuzzer's bytes, front to back; past the end every read gives zeros or nothing."""

    def __init__(self, data: bytes):
        self.data, self.pos = bytes(data), 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int(self, n: int) -> int:
        return int.from_bytes(self.take(n).ljust(n, b"\0"), "big")

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def rest(self) -> bytes:
        return self.take(len(self.data))

    def value(self, depth: int = 0) -> Any:
        """A JSON value (the shapes hostile facts and messages take)."""
        kind = self.byte() % (9 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return bool(self.byte() & 1)
        if kind == 2:
            return self.int(2) - 1024
        if kind == 3:
            return [1e308 * 10, -0.0, 0.5, float("nan"), 2 ** 70][self.byte() % 5]
        if kind in (4, 5):
            return self.take(self.byte() % 24).decode("utf-8", "surrogateescape")
        if kind in (6, 7):
            return [self.value(depth + 1) for _ in range(self.byte() % 4)]
        return {self.take(self.byte() % 8).decode("utf-8", "replace"): self.value(depth + 1)
                for _ in range(self.byte() % 4)}


def _step(b: int) -> int:
    """How a byte stream is cut into reads: 1 to 64 bytes at a time, or all at once."""
    return b % 64 + 1 if b < 192 else 1 << 30


def _split(data: bytes, step: int) -> list[bytes]:
    return [data[i:i + step] for i in range(0, len(data), step)] or [b""]


def _with_step(items: list[bytes]) -> list[bytes]:
    return [bytes([s]) + x for x in items for s in (0, 7, 200)]


def _utf8(obj: Any) -> bytes:
    """What the host does with a checked message or stated facts: JSON, then UTF-8 (no lone surrogates)."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True).encode("utf-8")


# -- the door stream ---------------------------------------------------------------------------------------------
@target("frame-decoder", lambda: _with_step(seeds.frames()))
def frame_decoder(data: bytes) -> None:
    """Decoder: any bytes in any split give frames or ProtocolError; the frames it gives re-encode to exactly the
    bytes it consumed, and it never holds more than one frame."""
    inp = Input(data)
    step, body = _step(inp.byte()), inp.rest()
    d, frames = p.Decoder(), []
    try:
        for chunk in _split(body, step):
            frames += [(t, s, bytes(pl)) for t, s, pl in d.feed(chunk)]
    except p.ProtocolError:
        return
    assert d.buffered <= p.HEADER.size + p.MAX_PAYLOAD
    assert all(t in p.TYPES and len(pl) <= p.MAX_PAYLOAD for t, _, pl in frames)
    assert b"".join(p.encode(t, s, pl) for t, s, pl in frames) == body[:len(body) - d.buffered]


@target("codec-roundtrip", lambda: [b"\x00\x02\x00\x00\x00\x02\x00\x05\x01hello", b"\xc8" + b"\x01" * 40])
def codec_roundtrip(data: bytes) -> None:
    """encode, encode_data and encode_json then Decoder, across any split: exactly the frames, bytes and objects
    that went in."""
    inp = Input(data)
    flags = inp.byte()
    step = _step(flags)
    frames = []
    while inp.pos < len(inp.data) and len(frames) < 64:
        t, sid, n = inp.byte() % 4 + 1, inp.int(4), inp.int(2) % 700
        frames.append((t, sid, inp.take(n)))
    wire = b"".join(p.encode(t, s, pl) for t, s, pl in frames)
    d, got = p.Decoder(), []
    for chunk in _split(wire, step):
        got += [(t, s, bytes(pl)) for t, s, pl in d.feed(chunk)]
    assert got == frames and d.buffered == 0
    bulk = b"".join(pl for _, _, pl in frames)
    if flags & 1:  # past one frame's payload: split into several DATA frames, joined back
        bulk = bulk * (p.MAX_PAYLOAD // max(len(bulk), 1) + 1)
    out = p.Decoder().feed(p.encode_data(5, p.CH_BYTES, bulk))
    assert all(t == p.DATA and s == 5 and pl[0] == p.CH_BYTES for t, s, pl in out)
    assert b"".join(bytes(pl[1:]) for _, _, pl in out) == bulk
    try:
        obj = json.loads(bulk[:p.MAX_JSON].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return
    if isinstance(obj, dict):
        try:
            frame = p.encode_json(p.OPEN, 2, obj)
        except ValueError:  # over MAX_PAYLOAD once re-encoded
            return
        (_, _, payload), = p.Decoder().feed(frame)
        again = p.decode_json(payload, "open") if len(payload) <= p.MAX_JSON else None
        assert again is None or json.dumps(again, sort_keys=True) == json.dumps(obj, sort_keys=True)


def _check_session(s: p.Session) -> None:
    assert len(s.streams) <= s.max_streams
    for st in s.streams.values():
        assert 0 <= st["recv_left"] <= s.window and 0 <= st["send_left"] <= p.MAX_WINDOW
        assert not (st["recv_closed"] and st["sent_closed"])


@target("session", lambda: _with_step([b"\x00" + f for f in seeds.frames()] + [b"\x03" + f for f in seeds.frames()]))
def session(data: bytes) -> None:
    """Session, host or guest side: any frames give events or ProtocolError; a stream is opened only by its side,
    never past the stream limit or a window, and the credit granted back is what was consumed."""
    inp = Input(data)
    flags, step = inp.byte(), _step(inp.byte())
    is_host = bool(flags & 1)
    s, d = p.Session(is_host=is_host, max_streams=8), p.Decoder()
    for _ in range(flags >> 1 & 3):
        s.open()
    try:
        for chunk in _split(inp.rest(), step):
            for ftype, sid, payload in d.feed(chunk):
                event = s.receive(ftype, sid, bytes(payload))
                assert event[0] in ("open", "data", "window", "close") and event[1] == sid
                if event[0] == "open":
                    assert isinstance(event[2], dict) and sid % 2 == (0 if is_host else 1)
                elif event[0] == "data":
                    frame = s.consumed(sid, len(event[3]))
                    if frame:
                        (t, fsid, credit), = p.Decoder().feed(frame)
                        assert t == p.WINDOW and fsid == sid and int.from_bytes(credit, "big") >= s.window // 4
                elif event[0] == "close":
                    assert isinstance(event[2], dict)
                    s.close(sid)
                _check_session(s)
    except p.ProtocolError:
        pass
    _check_session(s)


@target("message-reader", lambda: _with_step(seeds.messages()))
def message_reader(data: bytes) -> None:
    """MessageReader: any bytes in any split give JSON objects or ProtocolError, never more than its limit
    buffered; each object it gives reads back the same once re-encoded."""
    inp = Input(data)
    step, body = _step(inp.byte()), inp.rest()
    r, out = p.MessageReader(max_message=1 << 12), []
    try:
        for chunk in _split(body, step):
            out += r.feed(chunk)
    except p.ProtocolError:
        return
    assert r.buffered < p.MSG_HEADER.size + (1 << 12)
    for obj in out:
        assert isinstance(obj, dict)
        text = json.dumps(obj).encode()
        (again,) = p.MessageReader().feed(p.MSG_HEADER.pack(len(text)) + text)
        assert json.dumps(again) == json.dumps(obj)


MESSAGE_FIELDS = [("content",), ("content", "data"), ("content", "text"), ("content", "name"), ("header",),
                  ("header", "msg_type"), ("header", "msg_id"), ("parent_header",), ("parent_header", "msg_id"),
                  ("metadata",), ("buffers",), ("channel",), ("content", "payload"), ("content", "execution_count"),
                  ("content", "transient"), ("content", "traceback"), ("content", "matches"), ("content", "wait"),
                  ("content", "data", "text/plain"), ("content", "data", "application/javascript"),
                  ("content", "prompt"), ("content", "password"), ("content", "comm_id"), ("content", "status"),
                  ("content", "payload", 1), ("content", "payload", 1, "data"), ("content", "execution_state")]


def _set_path(obj: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        if isinstance(obj, dict):
            obj = obj.setdefault(key, {})
        elif isinstance(obj, list) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            return
    if isinstance(obj, dict):
        obj[path[-1]] = value
    elif isinstance(obj, list) and isinstance(path[-1], int) and path[-1] < len(obj):
        obj[path[-1]] = value


@target("box-message", lambda: [b"\x00" + json.dumps(m).encode() for m in seeds.KERNEL_MESSAGES]
        + [bytes([1 + 2 * i, f]) + b"\x04\x05hello" for i in range(len(seeds.KERNEL_MESSAGES)) for f in (0, 1, 5)])
def box_message(data: bytes) -> None:
    """check_box_message: a message passes, is dropped whole, or raises ProtocolError; what passes holds no MIME
    type outside the allowlist and no script in its HTML or Markdown, no execute_reply payload but the pager's text,
    a set_next_input that names no host magic and ask_exit, a prompt the host's cannot be taken for, gives its notebook
    output, and can be sent on as UTF-8 JSON."""
    inp = Input(data)
    mode = inp.byte()
    if mode & 1:  # a real message with one field replaced
        msg = copy.deepcopy(seeds.KERNEL_MESSAGES[(mode >> 1) % len(seeds.KERNEL_MESSAGES)])
        _set_path(msg, MESSAGE_FIELDS[inp.byte() % len(MESSAGE_FIELDS)], inp.value())
        body = json.dumps(msg).encode()
    else:
        body = inp.rest()
    try:  # as the host reads it: MessageReader's strict JSON, then the checker
        m = check_box_message(p.loads_strict(body, "a message"))
    except p.ProtocolError:
        return
    if m is None or m.refused is not None:  # dropped whole, or refused (a link's comm): never forwarded
        return
    bundles = [m.content.get("data")] if m.msg_type in ("display_data", "update_display_data", "execute_result",
                                                       "inspect_reply") else []
    state = (m.content.get("data") or {}).get("state") if m.msg_type in ("comm_open", "comm_msg") else None
    texts = []
    if isinstance(state, dict):
        assert state.get("description_allow_html", False) is False
        names = set(widget_kind("", state).split())
        assert not (LINK_MODELS & names), names  # no link ever passes
        allowed = model_keys(widget_kind("", state))
        assert allowed is None or set(state) <= allowed, sorted(state)  # nor a key its model lacks
        if names & OUTPUT_WIDGETS and "outputs" in state:
            bundles += [o.get("data") for o in state["outputs"] if o["output_type"] not in ("stream", "error")]
            assert all(set(o) <= {"output_type", "name", "text", "ename", "evalue", "traceback"}
                       for o in state["outputs"] if o["output_type"] in ("stream", "error"))
        if names & HTML_WIDGETS and "value" in state:
            texts.append(state["value"].lower())
    for b in bundles:
        assert b is None or set(b) <= ALLOWED_MIME, sorted(b)
        texts += [(b or {}).get(key, "").lower() for key in ("text/html", "text/markdown")]
    for text in texts:
        assert "<script" not in text and not re.search(r"<[^>]*\son[a-z]*\s*=", text), text
        assert "javascript:" not in text, text
    if m.msg_type == "execute_reply":
        for x in m.content["payload"]:
            if x["source"] == "set_next_input":
                assert set(x) == {"source", "text", "replace"} and not names_host_magic(x["text"])
            elif x["source"] == "ask_exit":
                assert set(x) == {"source", "keepkernel"}
            else:
                assert set(x) == {"source", "data", "start"} and x["source"] == "page" \
                    and set(x["data"]) == {"text/plain"}
    if m.msg_type == "input_request":
        assert m.content["prompt"].startswith(BOX_PROMPT)
    out = m.as_output()
    _utf8(m.wire())
    if out is not None:
        _utf8(out)


# -- the egress door ---------------------------------------------------------------------------------------------
@target("proxy-request", lambda: _with_step(seeds.PROXY_REQUESTS))
def proxy_request(data: bytes) -> None:
    """ProxyRequestParser: any bytes in any split give a CONNECT or absolute-form request, or ProxyRequestError with
    a status the door answers; the head sent upstream is origin-form, hop-by-hop headers gone, Connection: close."""
    inp = Input(data)
    step = _step(inp.byte())
    parser, req = ProxyRequestParser(), None
    try:
        for chunk in _split(inp.rest(), step):
            req = parser.feed(chunk)
            if req is not None:
                break
    except ProxyRequestError as e:
        assert e.status in REASONS, e.status
        return
    if req is None:
        return
    assert 0 < req.port < 65536 and "@" not in req.host and req.tunnel == (req.method == "CONNECT")
    if not req.tunnel:
        assert req.target.startswith("/")
        assert all(k.lower() not in HOP_BY_HOP for k, _ in req.headers)
        head = parser.upstream_head(req)
        assert head.startswith(req.method.encode() + b" /") and b"\r\nconnection: close\r\n" in head.lower()
        try:  # the body as it goes upstream, and nothing after the request's end
            parser.body(b"")
            ended = parser.ended
            assert parser.body(b"GET / HTTP/1.1\r\nHost: other\r\n\r\n") == b"" or not ended
        except ProxyRequestError as e:
            assert e.status == 400


WIDE = Policy.from_toml('[egress]\nallow = ["*:*"]\nallow_cidrs = ["0.0.0.0/0", "::/0"]\n')


@target("egress-request", lambda: [bytes([0]) + r for r in seeds.PROXY_REQUESTS]
        + [b"\x02\x00\x5d\xb8\xd8\x22\x00\xa9\xfe\xa9\xfe" + r for r in seeds.PROXY_REQUESTS[:3]])
def egress_request(data: bytes) -> None:
    """A proxy request through the door's own statement of it (`stated_facts`, the resolver answering from the
    input) to Policy.decide under a policy that allows every host and range: never an exception, JSON facts, and no
    allow for an always-refused name or any always-refused address in the answer."""
    inp = Input(data)
    answers = []
    for _ in range(inp.byte() % 5):
        answers.append(str(ipaddress.IPv6Address(inp.take(16).ljust(16, b"\0")) if inp.byte() & 1
                           else ipaddress.IPv4Address(inp.take(4).ljust(4, b"\0"))))
    try:
        req = ProxyRequestParser().feed(inp.rest())
    except ProxyRequestError:
        return
    if req is None:
        return
    calls = []

    def lookup(name: str, port: int) -> list[str]:
        calls.append(name)
        if not answers:
            raise OSError("no such name")
        return answers

    facts, address = stated_facts(req, WIDE, lookup)
    assert len(calls) <= 1 and len(facts["addresses"]) <= MAX_ADDRESSES
    assert address == (facts["addresses"][0] if facts["addresses"] else "")
    _utf8(facts)
    v = WIDE.decide(dict(facts, door="egress", kind="connect"))
    _check_verdict(v)
    if v.allowed:
        assert "host_error" not in facts and address and facts["address_class"] != "always"
        assert refused_name(facts["host"]) is None
        assert all(classify(ipaddress.ip_address(a))[0] != "always" for a in facts["addresses"])
        if calls:  # the whole answer was judged, not only what was stated of it
            assert all(classify(ipaddress.ip_address(a))[0] != "always" for a in answers)


def _client_hellos() -> list[bytes]:
    import ssl
    out = []
    for name in ("api.example.org", None):
        context = ssl.create_default_context()
        context.check_hostname = name is not None
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        try:
            context.wrap_bio(incoming, outgoing, server_hostname=name).do_handshake()
        except ssl.SSLWantReadError:
            pass
        out.append(b"\x00" + outgoing.read())
    return out + [b"\x05GET / HTTP/1.1\r\n"]


@target("client-hello", _client_hellos)
def client_hello(data: bytes) -> None:
    """ClientHelloReader and TunnelGate: any bytes in any split give the one same answer (a name, None, NOT_TLS) or
    HelloError; nothing passes the gate before the answer, all of it after; a name passes only as the CONNECT host."""
    inp = Input(data)
    step, stream = _step(inp.byte()), inp.rest()
    try:
        whole = ClientHelloReader().feed(stream)
    except HelloError:
        whole = HelloError
    reader, answer = ClientHelloReader(), False
    try:
        for chunk in _split(stream, step):
            answer = reader.feed(chunk)
            if answer is not False:
                break
    except HelloError:
        answer = HelloError
    if answer is not False:
        assert answer is whole or answer == whole, (answer, whole)
    gate, passed = TunnelGate("api.example.org"), b""
    try:
        for chunk in _split(stream, step):
            passed += gate.feed(chunk)
    except HelloError:
        assert passed == b""
        return
    assert passed in (b"", stream)
    if passed and isinstance(whole, str):
        assert check_host(whole)[1] == "api.example.org"


def _hostname_seeds() -> list[bytes]:
    return list(seeds.HOSTS)


@target("hostname", _hostname_seeds)
def hostname(data: bytes) -> None:
    """check_host: ("ip", an address), ("name", one lower-case ASCII spelling) or HostError; the spelling it gives
    is not an IP literal and passes again unchanged."""
    text = data.decode("utf-8", "surrogateescape")
    try:
        kind, value = check_host(text)
    except HostError:
        return
    if kind == "ip":
        assert isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address))
        classify(value)
        return
    assert kind == "name" and isinstance(value, str) and value.isascii() and value == value.lower()
    assert 0 < len(value) <= MAX_NAME and parse_ip_literal(value) is None
    assert check_host(value) == ("name", value)


_ANY = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))


@target("address", lambda: [b"\x00\x7f\x00\x00\x01", b"\x01" + bytes(15) + b"\x01", b"\x02::ffff:169.254.169.254",
                            b"\x02" + b"0x7f.1",
                            b"\x01\x20\x01\x00\x00\x41\x36\xe3\x78\x80\x00\x63\xbf\x3f\xff\xfd\xd2",
                            b"\x00\xc6\x12\x00\x01"])
def address(data: bytes) -> None:
    """parse_ip_literal and classify: an address, None or ValueError; every address gets a class, no allow_cidrs
    lifts an always-refused one, an embedded IPv4 address is judged as itself, and whatever the standard library
    calls loopback, private, link-local, multicast or unspecified is never "ok"."""
    inp = Input(data)
    mode = inp.byte() % 3
    if mode == 0:
        addr = ipaddress.IPv4Address(inp.take(4).ljust(4, b"\0"))
    elif mode == 1:
        addr = ipaddress.IPv6Address(inp.take(16).ljust(16, b"\0"))
    else:
        try:
            addr = parse_ip_literal(inp.rest().decode("utf-8", "replace"))
        except ValueError:
            return
        if addr is None:
            return
    cls, _ = classify(addr)
    wide, _ = classify(addr, _ANY)
    assert cls in ("ok", "always", "special") and (cls == "always") == (wide == "always")
    assert wide in ("ok", "always")
    for v4 in embedded_ipv4(addr):
        if classify(v4)[0] == "always":
            assert cls == "always", (addr, v4)
    mapped = isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None
    flagged = addr.is_loopback or addr.is_link_local or addr.is_multicast or addr.is_unspecified or addr.is_private
    if isinstance(addr, ipaddress.IPv4Address):
        flagged = flagged or addr.is_reserved
    else:
        flagged = flagged or addr.is_site_local
    if flagged and not mapped:
        assert cls != "ok", addr


# -- the secrets door --------------------------------------------------------------------------------------------
BINDINGS = [Binding("API_KEY", ["api.example.org", "*.svc.example"], "Authorization", "Bearer {value}",
                    "env:API_KEY", "flag", value="s3cr3t-value-A", placeholder=seeds.PH_A),
            Binding("TOKEN", ["tok.example"], "X-Token", "{value}", "env:TOKEN", "refuse", value="välue-B✓",
                    placeholder=seeds.PH_B)]
BOUND_HOSTS = ["api.example.org", "x.svc.example", "tok.example", "other.example"]


def _expand(data: bytes) -> bytes:
    return data.replace(seeds.TOKEN_A, seeds.PH_A.encode()).replace(seeds.TOKEN_B, seeds.PH_B.encode())


@target("secrets-rewrite", lambda: [b"\x01/path\nAuthorization:\xfe\nX-Token: tok \xfd\nAccept: */*",
                                    b"\x02/q?k=\xfd\nX-Token:\xfd\nX-Other: \xfe", b"\x05/\nAuthorization: Basic \xfe",
                                    b"\x07/\nAuthorization: \xe9t\xe9 \xfe\nX-Latin: caf\xe9"])
def secrets_rewrite(data: bytes) -> None:
    """rewrite_request: never raises; a placeholder becomes its value only in the bound header of a TLS request to a
    bound host, every other placeholder is named a misuse, and a header holding no placeholder passes byte for byte."""
    inp = Input(data)
    flags = inp.byte()
    tls, host = bool(flags & 1), BOUND_HOSTS[(flags >> 1) % len(BOUND_HOSTS)]
    lines = _expand(inp.rest()).split(b"\n")
    target_, headers = lines[0], [tuple(line.partition(b":")[::2]) for line in lines[1:]]
    rw = rewrite_request(host, target_, headers, BINDINGS, tls)
    assert [k for k, _ in rw.headers] == [k for k, _ in headers]
    for b in BINDINGS:
        if b.placeholder.encode() in target_:
            assert (b.name, "path or query") in rw.misuses
    for (key, sent), (_, out) in zip(headers, rw.headers):
        if not any(b.placeholder.encode() in sent for b in BINDINGS):
            assert out == sent, (sent, out)
            continue
        for b in BINDINGS:
            bound = tls and key.decode("latin-1").lower() == b.header.lower() and host_matches(host, b.hosts)
            if b.placeholder.encode() in sent:
                assert ((b.name, b.header) in rw.swaps) if bound else any(n == b.name for n, _ in rw.misuses)
            if b.value.encode() in out and b.value.encode() not in sent:
                assert bound, (key, b.name, host, tls)


@target("secrets-scrubber", lambda: [b"\x01\x06secret\x07xx secret yy", b"\x02\x03abc\x02bc\x00abcabc",
                                     b"\x00\x04v\xc3\xa4l\x03" + b"v\xc3\xa4l" * 5])
def secrets_scrubber(data: bytes) -> None:
    """Scrubber: however a response is cut into reads, no secret value reaches the box and the stream keeps its
    length (so Content-Length stays right)."""
    inp = Input(data)
    values = []
    for _ in range(inp.byte() % 3 + 1):
        v = inp.take(inp.byte() % 12 + 1).decode("utf-8", "replace").replace("*", "")
        if v:
            values.append(v)
    step, stream = _step(inp.byte()), inp.rest()
    s = Scrubber(values)
    out = b"".join(s.feed(c) for c in _split(stream, step)) + s.flush()
    assert len(out) == len(stream)
    for v in values:
        for form in encoded_forms(v):
            assert form not in out, (v, form)


ECHO_ALPHABET = "abcXYZ019-_.:/=?+&<>\"'\\%;# \u00e9\u00fc\u00df\u4e2d\U0001f600\u2028"


def _echo_text(inp: Input, n: int) -> str:
    return "".join(ECHO_ALPHABET[inp.byte() % len(ECHO_ALPHABET)] for _ in range(n))


@target("secrets-echo", lambda: [bytes([n, k, 3, 2, 5]) + bytes(range(40)) for n in (0, 9, 17) for k in range(16)])
def secrets_echo(data: bytes) -> None:
    """Scrubber on a value escaped as a common server writes it (Go, .NET or Python JSON, an HTML template or
    character references, percent or form encoding, UTF-8 read as latin-1, two of these mixed character by
    character),
    with text around it escaped the same way, in any chunking: every byte of the echoed value is starred, and the
    stream keeps its length."""
    from fuzz.echoes import ECHOES, PAIRS, mixed
    from tkbox_nb.rules.secrets import value_problem
    inp = Input(data)
    value = _echo_text(inp, inp.byte() % 18 + 7).strip() or "x"
    if value_problem(value):
        return
    names = sorted(ECHOES) + list(PAIRS)
    name = names[inp.byte() % len(names)]
    before, after = _echo_text(inp, inp.byte() % 6), _echo_text(inp, inp.byte() % 6)
    step = _step(inp.byte())
    picks = inp.take(32)
    spell = (lambda t: mixed(t, picks, name)) if name in PAIRS else ECHOES[name]
    head, echoed, tail = spell(before), spell(value), spell(after)
    stream = b"{" + head + echoed + tail + b"}"
    s = Scrubber([value])
    out = b"".join(s.feed(c) for c in _split(stream, step)) + s.flush()
    assert len(out) == len(stream)
    at = 1 + len(head)
    assert out[at:at + len(echoed)] == b"*" * len(echoed), (name, value, stream, out)


MODEL_FETCH_SEEDS = [
    b'{"model":"m","tools":[{"type":"web_fetch_20250910","allowed_domains":["a.example"]},{"type":"mcp",'
    b'"server_url":"https://169.254.169.254/"}],"mcp_servers":[{"url":"http://127.0.0.1/"}]}',
    b'{"model":"m","input":[{"type":"input_image","image_url":"https://[::1]:8/x"}],"web_search_options":{}}',
    b'{"model":"m","messages":[{"content":[{"image_url":{"url":"http://0x7f.1/"}},{"source":{"url":"//x"}}]}]}']


@target("model-fetches", lambda: [bytes([k]) + s for s in MODEL_FETCH_SEEDS for k in (0, 1)])
def model_fetches(data: bytes) -> None:
    """doors/model_fetches.provider_fetches on any JSON object a model request may carry, then Policy.decide on the
    call's facts: never an exception; at most MAX_FETCHES entries and the cut; each entry JSON; a `data:` URL never
    listed; under `server_tools = "refuse"` any entry refuses the call, and under `"egress"` with `allow = ["*:*"]`
    no URL naming an always-refused name or address passes."""
    from tkbox_nb.rules.addresses import refused_name
    from tkbox_nb.rules.hostnames import HostError
    from tkbox_nb.rules.model_fetches import MAX_FETCHES, provider_fetches
    from tkbox_nb.guest.protocol import loads_one_reading
    mode, text = (data[:1] or b"\0")[0] % 2, data[1:]
    try:
        doc = loads_one_reading(text)
    except (ValueError, RecursionError):
        return
    if not isinstance(doc, dict):
        return
    fetches = provider_fetches(doc)
    assert len(fetches) <= MAX_FETCHES + 1 and json.loads(json.dumps(fetches)) == fetches
    assert all(not str(f.get("url", "")).lower().startswith("data:") for f in fetches)
    policy = _model_fetch_policy("egress" if mode else "refuse")
    facts = {"door": "model", "kind": "call", "provider": "openai", "model": "m", "mode": "live", "run_calls": 0,
             "run_input_tokens": 0, "run_output_tokens": 0, "request_size": 1, "max_output": 1, "fetches": fetches}
    v = policy.decide(facts)
    if fetches and not mode:
        assert v.verdict == "deny" and v.rule == "models.server_tools"
    if v.verdict == "allow":
        from urllib.parse import urlsplit
        for f in fetches:
            if isinstance(f.get("url"), str):
                host = urlsplit(f["url"] if "://" in f["url"] else "https://" + f["url"]).hostname or ""
                try:
                    kind, value = check_host(host)
                except HostError:
                    raise AssertionError(("allowed a URL with no host", f)) from None
                assert not refused_name(str(value)), f
                if kind == "ip":
                    assert classify(value)[0] == "ok", f


@lru_cache(maxsize=2)
def _model_fetch_policy(mode: str) -> Policy:
    return Policy.from_toml(f'[egress]\nallow = ["*:*"]\n[models]\nallow = ["openai:*"]\nserver_tools = "{mode}"\n'
                            '[models.openai]\nkey = "env:TKB_FUZZ_NO_KEY"\n')


@target("intercept-request", lambda: [bytes([f, 200]) + b"GET /v1?x=1 HTTP/1.1\r\nHost: " + h + b"\r\n"
                                      b"Authorization: \xfe\r\nContent-Length: 3\r\n\r\nab\xfd"
                                      for f, h in ((0, b"api.example.org"), (2, b"tok.example:443"),
                                                   (6, b"TOK.example."), (1, b"x.svc.example"))]
        + [b"\x00\x03GET https://api.example.org/p HTTP/1.1\r\nHost: API.example.org\r\n\r\n"]
        + [b"\x00\x03POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"]
        + [b"\x00\x00GET / HTTP/1.1\r\nHost: api.example.org\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
           b"\x00\x00CONNECT api.example.org:443 HTTP/1.1\r\nHost: api.example.org\r\n\r\n"])
def intercept_request(data: bytes) -> None:
    """The request path to a bound host: h11 reads the box's request (or raises h11.RemoteProtocolError), a request
    not for the CONNECT host (its one Host header, an absolute-form target) is refused 400, the rewrite swaps or
    flags each placeholder, and the rewritten request is one h11 sends upstream without error; CONNECT and a switch
    of protocols are refused (501) as they are read, since h11 only pauses on them."""
    inp = Input(data)
    flags, step = inp.byte(), _step(inp.byte())
    chunks = iter(_split(_expand(inp.rest()), step))
    from_box = h11.Connection(h11.SERVER)
    try:
        request, body = read_request(lambda: next(chunks, b""), from_box)
    except h11.RemoteProtocolError:
        return
    except Refused as e:  # CONNECT or a switch of protocols
        assert e.status == 501
        return
    if request is not None:
        assert request.method != b"CONNECT" and not any(k in (b"upgrade", b"http2-settings") for k, _ in
                                                         request.headers)
    if request is None:
        return
    host = BOUND_HOSTS[flags % len(BOUND_HOSTS)]
    headers = list(request.headers.raw_items())
    try:  # a request for another host than the CONNECT's never reaches the rewrite
        target = bound_target(host, 443, request.method, request.target, headers)
    except Refused as e:
        assert e.status == 400
        return
    hosts = [v for k, v in headers if k.lower() == b"host"]
    assert len(hosts) == 1 and str(check_host(re.sub(r":0*443$|:$", "", hosts[0].decode("latin-1")))[1]) == host
    assert target.startswith(b"/") or target == b"*" and request.method == b"OPTIONS"
    headers = for_the_connect_host(host, 443, headers)
    assert [v for k, v in headers if k.lower() == b"host"] == [host.encode()]
    rw = rewrite_request(host, request.target, headers, BINDINGS, tls=True)
    rw.headers = end_to_end(rw.headers)
    rw.misuses += misuses_in(body, BINDINGS, "body")
    for b in BINDINGS:
        if b.placeholder.encode() in body:
            assert (b.name, "body") in rw.misuses
    to_up = h11.Connection(h11.CLIENT)
    to_up.send(h11.Request(method=request.method, target=target, headers=rw.headers))
    if body:
        to_up.send(h11.Data(data=body))
    to_up.send(h11.EndOfMessage())


def tls_accepts(server: ssl.SSLContext, ca_pem: bytes, hostname: str) -> bool:
    """Whether a client that trusts only `ca_pem` and checks `hostname` as Python's ssl does (an address against
    IP address SANs, a name against DNS names; strict X.509 checks, Python 3.13's default) completes a handshake
    with `server`, over memory BIOs."""
    client = ssl.create_default_context(cadata=ca_pem.decode("ascii"))
    client.verify_flags |= ssl.VERIFY_X509_STRICT
    bios = [ssl.MemoryBIO() for _ in range(4)]
    c = client.wrap_bio(bios[0], bios[1], server_hostname=hostname)
    s = server.wrap_bio(bios[2], bios[3], server_side=True)
    done = [False, False]
    for _ in range(8):
        for i, end in enumerate((c, s)):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError:
                    assert i == 0
                    return False
        bios[2].write(bios[1].read())
        bios[0].write(bios[3].read())
        if all(done):
            return True
    raise AssertionError("the handshake neither completed nor failed")


def _other_host(kind: str, value: Any) -> str:
    """A host the leaf must not be good for: the next address, or another name."""
    if kind == "ip":
        return str(type(value)(int(value) ^ 1))
    return "x" + value if len(value) < MAX_NAME and not value.startswith(("-", "x")) else "other.example"


@target("box-ca-leaf", lambda: list(seeds.HOSTS) + list(seeds.BOUND_HOST_SPELLINGS))
def box_ca_leaf(data: bytes) -> None:
    """Any host the egress door lets through (a CONNECT through ProxyRequestParser, `stated_facts` and a policy that
    allows every host and range) gets from the box's CA a leaf whose one SAN names it (an IP address SAN for an
    address, in whatever spelling the box wrote it; a DNS name SAN for a name), with no common name, that a client
    checking that host accepts, also in the standard spelling of an address the box wrote; and that the same client
    refuses for another host."""
    text = data.decode("utf-8", "surrogateescape")
    try:
        req = ProxyRequestParser().feed(f"CONNECT {text}:443 HTTP/1.1\r\nHost: x\r\n\r\n".encode(
            "utf-8", "surrogateescape"))
    except ProxyRequestError:
        return
    if req is None:
        return
    facts, _ = stated_facts(req, WIDE, lambda name, port: ["93.184.215.14"])
    if not WIDE.decide(dict(facts, door="egress", kind="connect")).allowed:
        return
    ca = BoxCA("fuzz-box-ca-leaf")
    host = facts["host"]  # what the door hands the secrets door (crossing.args["host"])
    kind, value = check_host(host)
    assert check_host(req.host) == (kind, value) and host == str(value)
    _, leaf = ca.leaf(req.host)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(sans) == [x509.IPAddress(value) if kind == "ip" else x509.DNSName(value)], (req.host, list(sans))
    assert not leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    server = ca.server_context(req.host)
    assert tls_accepts(server, ca.pem(), host), host
    standard = req.host[1:-1] if req.host.startswith("[") else req.host
    try:
        spelled = ipaddress.ip_address(standard.split("%", 1)[0])
    except ValueError:
        spelled = None
    if spelled is not None:  # the box's client wrote the address in a form OpenSSL reads too: the same address
        assert spelled == value and tls_accepts(server, ca.pem(), standard.split("%", 1)[0]), req.host
    assert not tls_accepts(server, ca.pem(), _other_host(kind, value)), host
    assert not tls_accepts(server, ca.pem(), "ip.example" if kind == "ip" else "198.18.7.2"), host


# -- bundles -----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def seed_files() -> dict[str, bytes]:
    return read_entries(seeds.SEED_BUNDLE.read_bytes())


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, body in files.items():
            z.writestr(name, body)
    return buf.getvalue()


@target("bundle-reader", lambda: [seeds.SEED_BUNDLE.read_bytes(), _zip({"manifest.json": b"{}"}), b"PK\x05\x06"
                                  + bytes(18)])
def bundle_reader(data: bytes) -> None:
    """read_entries then parse on any bytes: the entries or BundleError; every name it gives is a safe relative
    path and every entry within the limits."""
    try:
        files = read_entries(data)
    except BundleError:
        return
    total = 0
    for name, body in files.items():
        check_name(name)
        assert len(body) <= MAX_ENTRY
        total += len(body)
    assert total <= MAX_TOTAL
    try:
        parse(files)
    except BundleError:
        pass


def _json_edit(body: bytes, inp: Input) -> bytes:
    """One JSON line of `body` with one value (up to three keys deep) replaced by one from the input."""
    lines = body.split(b"\n")
    i = inp.byte() % len(lines)
    try:
        obj = json.loads(lines[i])
    except ValueError:
        return body
    node, key = obj, None
    for _ in range(inp.byte() % 4):
        if isinstance(node, dict) and node:
            key = sorted(node)[inp.byte() % len(node)]
            if isinstance(node[key], (dict, list)):
                node = node[key]
                key = None
                continue
            break
        if isinstance(node, list) and node:
            key = inp.byte() % len(node)
            if isinstance(node[key], (dict, list)):
                node, key = node[key], None
                continue
            break
    if key is None:
        key = sorted(node)[0] if isinstance(node, dict) and node else 0
    value = inp.value()
    if isinstance(node, dict):
        node[key] = value
    elif isinstance(node, list) and node:
        node[key % len(node)] = value
    lines[i] = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogateescape")
    return b"\n".join(lines)


def mutated_bundle(data: bytes) -> tuple[dict[str, bytes], bytes]:
    """The seed bundle's entries with one change read from the input (a JSON value replaced, bytes spliced in, an
    entry replaced, removed or added), the manifest recomputed when the input says so (a forger's best)."""
    inp = Input(data)
    files = dict(seed_files())
    op, pick = inp.byte(), inp.byte()
    names = sorted(files)
    name = names[pick % len(names)]
    kind = op % 5
    if kind == 0:
        files[name] = _json_edit(files[name], inp)
    elif kind == 1:
        at = inp.int(2) % (len(files[name]) + 1)
        cut = inp.byte() % 8
        files[name] = files[name][:at] + inp.rest() + files[name][at + cut:]
    elif kind == 2:
        files[name] = inp.rest()
    elif kind == 3:
        del files[name]
    else:
        files[inp.take(inp.byte() % 40).decode("ascii", "replace") or "box/extra"] = inp.rest()
    if op & 0x80 and "manifest.json" in files and name != "manifest.json":
        try:
            m = json.loads(files["manifest.json"])
            m["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in files.items() if n != "manifest.json"}
            files["manifest.json"] = json.dumps(m, indent=1).encode()
        except (ValueError, TypeError):
            pass
    return files, _zip(files)


def _signed_meaning(files: dict[str, bytes]) -> Any:
    """What a valid bundle vouches for: its records, disclosures, content and policies, as parsed values."""
    def lines(body: bytes | None) -> list:
        return [json.loads(x) for x in (body or b"").split(b"\n") if x.strip()]
    try:
        return json.dumps([[lines(b) for n, b in sorted(files.items()) if n.startswith("runs/")],
                           lines(files.get("box/disclosures.jsonl")),
                           [lines(b) for n, b in sorted(files.items()) if n.startswith("box/content-")],
                           {n: b.decode("utf-8", "replace") for n, b in files.items()
                            if n.startswith("box/policies/")}],
                          sort_keys=True)
    except ValueError:
        return None


@target("bundle-verify", lambda: [bytes([op, pick]) + b"\x00\x02\x05hello" for op in (0, 128, 1, 129, 2, 130, 4)
                                  for pick in range(0, 14, 3)])
def bundle_verify(data: bytes) -> None:
    """The whole of `tkbox verify` (Tracekit's verifier, then the box layer) on a changed copy of a real signed
    bundle: a report, never an exception; and VALID only when what the bundle vouches for is unchanged."""
    files, raw = mutated_bundle(data)
    report = VerifyReport(path="fuzz", trust_path=str(seeds.SEED_TRUST), trust_source="given")
    verify_bytes(raw, report)
    assert report.exit_code in (EXIT_VALID, EXIT_INVALID, EXIT_UNREADABLE)
    report.summary()
    json.dumps(report.as_dict())
    if report.valid:
        assert _signed_meaning(files) == _signed_meaning(seed_files()), "a changed bundle verified"


@target("bundle-view", lambda: [bytes([op, pick]) + b"\x00\x02\x05hello" for op in (0, 2, 4) for pick in range(14)])
def bundle_view(data: bytes) -> None:
    """Reading a (changed, unverified) bundle as a run: its crossings, DataFrame, replay notebook and audit facts,
    or BundleError; nothing else."""
    files, _ = mutated_bundle(data)
    try:
        run = Run("fuzz.tkb", parse(files))
        for c in run.crossings():
            run.summary_of(c)
        run.to_dataframe()
        to_notebook(run)
        _facts(run, [])
    except TkboxError:
        pass


# -- the policy and the exec door --------------------------------------------------------------------------------
PROBE_FACTS = [
    {"door": "box", "kind": "start"}, {"door": "exec", "kind": "cell"}, {"door": "exec", "kind": "comm"},
    {"door": "exec", "kind": "command", "argv": ["/usr/bin/python3", "-c", "1"]},
    {"door": "exec", "kind": "command", "argv": ["rm", "-rf", "/"]},
    {"door": "egress", "kind": "connect", "host": "api.example.org", "port": 443, "addresses": ["93.184.216.34"]},
    {"door": "egress", "kind": "connect", "host": "x.test", "port": 80, "addresses": ["198.18.0.10"]},
    {"door": "secrets", "kind": "swap", "name": "API_KEY", "binding_hosts": ["api.example.org"],
     "binding_header": "Authorization", "host": "api.example.org", "header": "authorization", "tls": True},
    {"door": "host", "kind": "magic", "magic": "box_status"}, {"door": "model", "kind": "call"},
]


def _check_verdict(v: Verdict) -> None:
    assert isinstance(v, Verdict) and v.verdict in ("allow", "deny")
    assert isinstance(v.rule, str) and v.rule and isinstance(v.reason, str)


@target("policy-parse", lambda: [b"\x00" + x for x in seeds.POLICIES] + [bytes([1 + 2 * i]) + b"\x00\x10\n#"
                                                                          for i in range(len(seeds.POLICIES))])
def policy_parse(data: bytes) -> None:
    """Policy.from_toml: a policy or PolicyError; a policy it gives reads back the same from its source, has values
    of the schema's types, and decides every probe crossing without raising."""
    inp = Input(data)
    mode = inp.byte()
    if mode & 1:  # a real policy with bytes spliced in
        base = seeds.POLICIES[(mode >> 1) % len(seeds.POLICIES)]
        at = inp.int(2) % (len(base) + 1)
        raw = base[:at] + inp.rest() + base[at:]
    else:
        raw = inp.rest()
    text = raw.decode("utf-8", "replace")
    try:
        pol = Policy.from_toml(text, "fuzz.toml")
    except PolicyError:
        return
    assert pol.hash == policy_hash(text) and Policy.from_toml(pol.source).data == pol.data
    for section, keys in _SCHEMA.items():
        for key, want in keys.items():
            value = pol.get(section, key)  # None only for a setting whose absence means none ([box] gpus)
            assert isinstance(value, want) or (value is None and key not in pol.data.get(section, {}))
    pol.allow_cidrs()
    for facts in PROBE_FACTS:
        _check_verdict(pol.decide(facts))


DOORS = [*names(), "other"]  # every door of the table, and one it does not have
KINDS = ["start", "stop", "cell", "comm", "command", "connect", "bind", "swap", "misuse", "magic", "other"]
FACT_KEYS = ["argv", "host", "port", "addresses", "address", "host_error", "resolve_error", "name", "binding_hosts",
             "binding_header", "binding_misuse", "header", "tls", "where", "magic", "line", "door", "kind"]
DECIDE_POLICIES = [Policy.from_toml(x.decode()) for x in seeds.POLICIES] + [WIDE]


@target("policy-decide",
        lambda: [bytes([i, d, k, 0]) for i in range(6) for d in range(len(DOORS)) for k in (0, 4, 5, 7, 8)])
def policy_decide(data: bytes) -> None:
    """Policy.decide on any facts (as a verifier reads them from a hostile bundle): a verdict, the same every time,
    never an exception."""
    inp = Input(data)
    pol = DECIDE_POLICIES[inp.byte() % len(DECIDE_POLICIES)]
    door, kind = DOORS[inp.byte() % len(DOORS)], KINDS[inp.byte() % len(KINDS)]
    facts: dict[str, Any] = {"door": door, "kind": kind}
    for _ in range(inp.byte() % 6):
        facts[FACT_KEYS[inp.byte() % len(FACT_KEYS)]] = inp.value()
    v = pol.decide(facts)
    _check_verdict(v)
    assert pol.decide(facts) == v


@target("exec-command", lambda: [b"\x01\x01*\x01\x02rm" + b"ls\x00-l", b"\x02\x03py*\x02ls\x00" + b"/usr/bin/python3",
                                 b"\x00\x00", b"\x01\x01[\x00sh\x00-c"])
def exec_command(data: bytes) -> None:
    """The exec door's command: the box policy allows an argv only when its program matches `commands` and no
    `deny_commands` pattern (deny wins), and the host's argv check and the guest's reading of the request agree."""
    inp = Input(data)
    allow = [inp.take(inp.byte() % 8).decode("utf-8", "replace") for _ in range(inp.byte() % 4)]
    deny = [inp.take(inp.byte() % 8).decode("utf-8", "replace") for _ in range(inp.byte() % 3)]
    argv = [a.decode("utf-8", "surrogateescape") for a in inp.rest().split(b"\0")] if inp.pos < len(data) else []
    try:
        pol = Policy.from_toml(f"[exec]\ncommands = {json.dumps(allow)}\ndeny_commands = {json.dumps(deny)}\n")
    except PolicyError:
        return
    v = pol.decide({"door": "exec", "kind": "command", "argv": argv})
    _check_verdict(v)
    host_ok = isinstance(argv, list) and bool(argv) and all(isinstance(a, str) for a in argv)
    if v.allowed:
        program = argv[0].rsplit("/", 1)[-1]
        assert any(fnmatch.fnmatchcase(program, x) for x in allow)
        assert not any(fnmatch.fnmatchcase(program, x) for x in deny)
    try:
        got, env, cwd = command_request({"argv": argv})
    except ValueError:
        assert not host_ok
        return
    assert host_ok and got == argv and env == {} and cwd == "/workspace"


@target("agent-request", lambda: [json.dumps(x).encode() for x in (
        {"kind": "command", "argv": ["ls"], "env": {"A": "1"}, "cwd": "/tmp"}, {"argv": "ls"}, {"env": [1]})])
def agent_request(data: bytes) -> None:
    """The guest agent's reading of a command request (any JSON object in an OPEN body): (argv, env, cwd) of
    strings, or ValueError."""
    try:
        req = p.decode_json(data, "open")
    except p.ProtocolError:
        return
    try:
        argv, env, cwd = command_request(req)
    except ValueError:
        return
    assert argv and all(isinstance(a, str) for a in argv) and isinstance(cwd, str)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


# -- replay and audit --------------------------------------------------------------------------------------------
@target("audit-sanitizers", lambda: list(seeds.SANITIZER_FILES))
def audit_sanitizers(data: bytes) -> None:
    """A sanitizer file for `tkbox audit`: (regex, replacement) pairs or one TkboxError; sanitizing text with the
    pairs it gives never raises."""
    text = data.decode("utf-8", "replace")
    try:
        extra = parse_sanitizers(text)
    except TkboxError:
        return
    _sanitize("run-123 took 5 ms at 2026-12-01T00:00:00Z, 0xdeadbeef " + text[:200], extra)


# -- the patch door --------------------------------------------------------------------------------------------------
def _patch_seeds() -> list[bytes]:
    from tkbox_nb.guest.patch import encode

    def e(path, content=b"x", **kw):
        return encode(dict({"path": path, "op": "add", "type": "file", "mode": 0o644}, **kw), content)

    good = e("a.txt", b"one\n") + e("d/b.py", b"\x00bin") + e("gone", b"", op="delete")
    bad = (e("../x") + e(".GIT/config") + e("l", b"", type="symlink", target="/etc") + e("big", b"y" * 300)
           + e("m", b"", op="rename", **{"from": "/etc/shadow"}) + e("A") + e("a"))
    return _with_step([good, bad, good[:-3], b"\x00\x00\x00\x05{}{}{"])


@target("patch-stream", _patch_seeds)
def patch_stream(data: bytes) -> None:
    """The patch door's reader, then Policy.decide on each entry as the door states it: entries or ProtocolError,
    content kept only up to the limit, bytes counted against the stream cap; every entry gets a verdict (never an
    exception), and a path the always-rules refuse is never allowed."""
    from tkbox_nb.rules import patch_rules
    from tkbox_nb.rules.patch_reader import PatchReader
    from tkbox_nb.policy import Policy
    inp = Input(data)
    step, body = _step(inp.byte()), inp.rest()
    reader, entries = PatchReader(keep_bytes=256, max_stream_bytes=1 << 14, max_entries=64), []
    try:
        for chunk in _split(body, step):
            entries += reader.feed(chunk)
    except p.ProtocolError:
        return
    policy, total = Policy.default(), 0
    for i, e in enumerate(entries):
        assert e.content is None or len(e.content) == e.size <= 256
        facts = {"door": "patch", "kind": "file", "path": e.path, "op": e.op, "type": e.type, "mode": e.mode,
                 "size": e.size, "index": i, "total_before": total, "from": e.source, "not_utf8": e.not_utf8,
                 "rules": patch_rules.RULES, "base": None, "from_base": "sha256:" + "0" * 64 if e.source else None}
        if e.content is not None:
            facts["binary"] = patch_rules.is_binary(e.content)
        v = policy.decide(facts)
        _utf8({"facts": facts, "rule": v.rule, "reason": v.reason})  # what the door records: always writable
        if v.allowed:
            total += e.size
            assert not patch_rules.path_problem(e.path) and not patch_rules.is_git(e.path) and e.type == "file" \
                or e.op == "delete" and e.type == "symlink"
            if e.op == "rename":  # a rename deletes its source: never one the default deny list protects, nor itself
                src = patch_rules.fold(e.source)
                assert src != patch_rules.fold(e.path) and not patch_rules.is_git(e.source) and not any(
                    patch_rules.glob_match(g.casefold(), src) for g in patch_rules.DEFAULT_DENY)


# -- the guest kernel (Firecracker's vmlinux, taken out of the image's bzImage) ------------------------------------
def _kernel_seeds() -> list[bytes]:
    elf = seeds.tiny_vmlinux()
    return ([b"\x00" + bz for bz in seeds.bzimages()]
            + [bytes([1, i, 0]) + elf for i in range(len(seeds.COMPRESSIONS))] + [b"\x04\x03\x06" + elf]
            + [bytes([2, 6]) + seeds.kernel_compress(k, elf) for k in seeds.COMPRESSIONS])


@target("kernel-image", _kernel_seeds)
def kernel_image(data: bytes) -> None:
    """extract_vmlinux on a whole bzImage, on any payload behind a valid setup header, or on any bytes compressed
    each way as the kernel build does: an ELF that elf_info accepts, within max_out, or one KernelImageError (one
    line); bytes that went in compressed come back exactly, or are refused as elf_info or the bound refuses them."""
    inp = Input(data)
    mode, kind, bound = inp.byte(), inp.byte(), inp.byte()
    max_out = 1 << (8 + bound % 12)  # 256 bytes to 512 KiB
    elf = None
    if mode % 3 == 0:
        bz = inp.rest()
    elif mode % 3 == 1:
        elf = inp.rest()
        bz = seeds.bzimage(seeds.kernel_compress(seeds.COMPRESSIONS[kind % len(seeds.COMPRESSIONS)], elf,
                                                 trailer=not mode & 4, lz4_block=1 << (6 + kind % 8)),
                           setup_sects=mode >> 3 & 7)
    else:
        bz = seeds.bzimage(inp.rest(), setup_sects=mode >> 3 & 7)
    try:
        out = extract_vmlinux(bz, max_out=max_out)
    except KernelImageError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        if elf is not None and len(elf) <= max_out:  # refused only as elf_info refuses the vmlinux itself
            try:
                elf_info(elf)
            except KernelImageError as again:
                assert str(again) == str(e), (str(again), str(e))
                return
            raise AssertionError(f"a valid vmlinux, compressed as the kernel build does, was refused: {e}")
        assert elf is None or "past the limit" in str(e), str(e)
        return
    assert isinstance(out, bytes) and len(out) <= max_out
    assert isinstance(elf_info(out), ElfInfo)
    if elf is not None:
        assert out == elf


ELF_FIELDS = [(4, 1), (5, 1), (6, 1), (16, 2), (18, 2), (20, 4), (24, 8), (32, 8), (52, 2), (54, 2), (56, 2)] + [
    (64 + 56 * i + o, w) for i in range(2) for o, w in ((0, 4), (8, 8), (24, 8), (32, 8), (40, 8))] + [
    (176 + o, 4) for o in range(0, 64, 4)]  # the notes: GNU's, then Xen's PVH entry


def _elf_seeds() -> list[bytes]:
    note = seeds.elf_note
    elfs = [seeds.tiny_vmlinux(), seeds.tiny_vmlinux(notes=note(b"Xen", 18, bytes(8)) + note(b"", 1, b"")),
            seeds.tiny_vmlinux(notes=note(b"GNU", 3, b"x" * 5)), seeds.tiny_vmlinux(notes=b"")]
    return [b"\x00" + e for e in elfs] + [b"\x80\x00\x12\x00\x3f", b"\x81\x00\x48\x03" + bytes(8)]


@target("elf-info", _elf_seeds)
def elf_info_target(data: bytes) -> None:
    """elf_info on any bytes, or on the tiny vmlinux with fields overwritten: an ElfInfo or one KernelImageError;
    what it accepts is an ELF64 little-endian x86-64 ET_EXEC whose program headers and PT_LOAD segments lie within
    it, and gets the same answer as a buffer (vmlinux_for maps the file) and with bytes appended."""
    import struct
    inp = Input(data)
    mode = inp.byte()
    if mode < 0x80:
        elf = inp.rest()
    else:
        b = bytearray(seeds.tiny_vmlinux())
        for _ in range(mode % 4 + 1):
            at, width = ELF_FIELDS[inp.byte() % len(ELF_FIELDS)]
            b[at:at + width] = inp.take(width).ljust(width, b"\0")
        elf = bytes(b)
    try:
        info = elf_info(elf)
    except KernelImageError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        with_buffer = None
        try:
            elf_info(bytearray(elf))
        except KernelImageError as again:
            with_buffer = str(again)
        assert with_buffer == str(e)
        return
    assert elf_info(bytearray(elf)) == info == elf_info(elf + b"\0" * 64)
    ident, e_type, machine, _v, entry, phoff = struct.unpack_from("<16sHHIQQ", elf, 0)
    assert ident[:7] == b"\x7fELF\x02\x01\x01" and e_type == 2 and machine == 62 and entry == info.entry
    phnum, loads = struct.unpack_from("<H", elf, 56)[0], []
    assert phoff + 56 * phnum <= len(elf)
    for i in range(phnum):
        p_type, _f, off, _va, paddr, filesz, memsz, _a = struct.unpack_from("<IIQQQQQQ", elf, phoff + 56 * i)
        if p_type == 1:
            assert off + filesz <= len(elf) and filesz <= memsz
            loads.append((paddr, memsz))
    assert len(loads) == info.load_segments >= 1 and info.mem_size == sum(m for _, m in loads)
    assert info.phys_start == min(a for a, _ in loads) and info.phys_end == max(a + m for a, m in loads)
    assert info.pvh_note == (info.pvh_entry is not None) and (info.pvh_entry or 0) < 1 << 32


# -- a warm VM's GO message (tkbox_nb/guest/vm.py) ----------------------------------------------------------------
@target("go-message", lambda: [vm.encode_go(bytes(range(64)), 1_796_000_000_000_000_000), b"TKBOXGO1" + b"\0" * 72,
                               b"TKBOXGO1"])
def go_message(data: bytes) -> None:
    """parse_go: any bytes give (64 bytes of entropy, a settable time) or ValueError, and what it takes
    re-encodes to exactly the bytes it was given."""
    try:
        entropy, ns = vm.parse_go(data)
    except ValueError:
        return
    assert len(entropy) == vm.GO_ENTROPY and 10 ** 18 < ns < 2 ** 63
    assert vm.encode_go(entropy, ns) == data


def _environment_seeds() -> list[bytes]:
    from tkbox_nb.bundle import environment as env
    part = {"interpreter": {"implementation": "cpython", "version": "3.11.7", "platform": "linux-x86_64",
                            "executable": "/usr/bin/python3"}, "paths": ["/usr/lib/python3/dist-packages"],
            "distributions": [{"name": "pandas", "version": "1.5.3", "location": "/usr/lib/python3/dist-packages",
                               "dist_info": "pandas-1.5.3.dist-info", "files": 2, "hashed": 1,
                               **env.record_digests(b"pandas/__init__.py,sha256=AAAA,1\nRECORD,,\n")},
                              {"name": "old", "version": "1", "location": "/x", "dist_info": "old-1.egg-info",
                               "record_digest": None}],
            "debian": {"packages": [{"name": "libc6", "version": "2.36-9", "architecture": "amd64"}]}}
    return [env.manifest(part, "bwrap", "none"), env.manifest(None, "qemu", "tkbox-image:ab", "an old image")]


@target("environment-manifest", _environment_seeds)
def environment_manifest(data: bytes) -> None:
    """environment.parse on any bytes (a bundle's disclosed manifest): a manifest or ValueError; what it accepts,
    rows() and summary() read without raising, every row's fields strings."""
    from tkbox_nb.bundle import environment as env
    try:
        m = env.parse(data)
    except ValueError:
        return
    assert isinstance(env.summary(m), str)
    for row in env.rows(m):
        assert set(row) == set(env.COLUMNS) and all(isinstance(v, str) for v in row.values())


# -- a package index's project page (tkbox_nb/rules/package_index.py) ---------------------------------------------
_PAGE_URL = "https://index.example/simple/tinypkg/"
_SHA = "ab" * 32


def _package_page_seeds() -> list[bytes]:
    html_page = (f'<!DOCTYPE html><a href="../../files/tinypkg-1.0-py3-none-any.whl#sha256={_SHA}" '
                 f'data-requires-python="&gt;=3.8">w</a><a href="https://files.example/t/tinypkg-1.0.tar.gz#sha256='
                 f'{_SHA.upper()}" data-yanked="">s</a><a href="tinypkg-1.0.exe#md5=00">x</a>').encode()
    json_page = json.dumps({"meta": {"api-version": "1.0"}, "name": "TinyPkg", "files": [
        {"filename": "tinypkg-1.0.tar.gz", "url": "tinypkg-1.0.tar.gz", "hashes": {"sha256": _SHA},
         "yanked": "bad"}]}).encode()
    bad = f'<a href="http://other.example/tinypkg-1.0.tar.gz#sha256={_SHA}">'.encode()
    return [b"\x00" + html_page, b"\x01" + json_page, b"\x00" + bad, b"\x00<a href='..%2Ftinypkg-1.0.tar.gz'>"]


@target("package-page", _package_page_seeds)
def package_page(data: bytes) -> None:
    """rules/package_index.parse_page on any page (first byte: HTML or PEP 691 JSON), `file_hosts` naming one other
    host: the files or IndexPageError; each file's name a wheel's or sdist's of the project with no `/`, `\\` or
    `..`, its URL on the page's host or that one, its sha256 64 lower-case hex digits; the door's own page for them
    reads back as the same files, every link on the door."""
    from urllib.parse import urlsplit

    from tkbox_nb.rules import package_index as pi
    ctype = "application/vnd.pypi.simple.v1+json" if data[:1] == b"\x01" else "text/html"
    try:
        files = pi.parse_page(data[1:], ctype, "tinypkg", _PAGE_URL, ["files.example"])
    except pi.IndexPageError as e:
        assert "\n" not in str(e)
        return
    for f in files:
        assert pi.FILE_NAME.fullmatch(f.filename) and ".." not in f.filename and "/" not in f.filename
        assert pi.file_version("tinypkg", f.filename) is not None
        assert urlsplit(f.url).hostname in ("index.example", "files.example") and "#" not in f.url
        assert len(f.sha256) == 64 and f.sha256 == f.sha256.lower()
    served = pi.render_page("tinypkg", files)
    again = pi.parse_html(served, "tinypkg", "http://127.0.0.1:3130/simple/tinypkg/")
    assert [(f.filename, f.sha256, f.requires_python, f.yanked) for f in again] == \
        [(f.filename, f.sha256, f.requires_python, f.yanked) for f in files]
    assert all(urlsplit(f.url).path == f"/files/{f.sha256}/{f.filename}" for f in again)


# -- the package door's kept index pages (tkbox_nb/rules/package_cache.py) ----------------------------------------
_CACHE_KEY, _INDEX = b"\x07" * 32, "https://index.example/simple/"


def _package_cache_seeds() -> list[bytes]:
    from tkbox_nb.rules.package_cache import KeptPage, seal
    pages = [KeptPage(_INDEX, "tinypkg", _PAGE_URL, "text/html", 1.7e9, b'<a href="x">x</a>',
                      {"host": "index.example", "addresses": ["93.184.216.34"], "address": "93.184.216.34"}, 600.0),
             KeptPage(_INDEX, "tinypkg", _PAGE_URL, "application/vnd.pypi.simple.v1+json", 0.0, b"", {}, 0.0)]
    return [bytes([k]) + seal(_CACHE_KEY, page) for page in pages for k in (0, 1, 77)]


@target("package-cache-entry", _package_cache_seeds)
def package_cache_entry(data: bytes) -> None:
    """rules/package_cache.unseal of an entry on the host's disk (the first byte: as kept, or one byte of it
    changed): None, or a page of exactly that index and project whose every field has its shape and whose seal reads
    back the same; a changed entry, one under another key or asked for as another project's, never reads."""
    import math

    from tkbox_nb.rules import package_cache as pc
    data = data or b"\x00"
    entry = bytearray(data[1:])
    if data[0] and entry:
        entry[data[0] % len(entry)] ^= 0x01 if data[0] & 1 else 0x80
    entry = bytes(entry)
    kept = pc.unseal(_CACHE_KEY, entry, _INDEX, "tinypkg")
    assert pc.unseal(b"\x08" * 32, entry, _INDEX, "tinypkg") is None
    assert pc.unseal(_CACHE_KEY, entry, _INDEX, "otherpkg") is None
    if kept is None:
        return
    assert not (data[0] and data[1:]), "a changed entry was read"
    assert kept.sha256 == hashlib.sha256(kept.body).hexdigest() and len(kept.body) <= pc.MAX_ENTRY_BYTES
    assert isinstance(kept.fetched_at, float) and math.isfinite(kept.fetched_at)
    assert 0 <= kept.index_max_age <= pc.MAX_STATED_AGE_S and set(kept.dialled) <= set(pc.DIALLED)
    assert pc.unseal(_CACHE_KEY, pc.seal(_CACHE_KEY, kept), _INDEX, "tinypkg") == kept


# -- values of %box_pull -----------------------------------------------------------------------------------------
def _value_codec_seeds() -> list[bytes]:
    """Real encodings (rules/value_codec.encode) of what a notebook pulls: arrays of each kind, a DataFrame with a
    named index and str, category, datetime and object columns, a Series, plain JSON."""
    import numpy as np
    import pandas as pd

    from tkbox_nb.rules.value_codec import encode
    frame = pd.DataFrame({"i": np.arange(3), "f": np.array([1.5, 2, np.nan], "float32"), "b": [True, False, True],
                          "s": ["a", None, "c"], "c": pd.Categorical(["u", "v", "u"]),
                          "t": pd.to_datetime(["2020-01-01", "2021-01-01", None]).astype("M8[ns]")},
                         index=pd.Index([10, 20, 10], name="key"))
    frame["o"] = frame["s"].fillna("").astype(object)
    values = [frame, pd.Series([0.5, 1.5], index=pd.Index(["p", "q"], name="k"), name="w"),
              np.arange(6.0).reshape(2, 3), np.array(3, "uint8"), np.array(["ab", "c"]), np.array([b"x"]),
              np.array(["a"], dtype=object), np.float32(2.5), {"a": [1, None, "s"]}]
    return [bytes([k]) + json.dumps(encode(v)).encode() for v in values for k in (0, 1, 21, 201)]


@target("value-codec", _value_codec_seeds)
def value_codec(data: bytes) -> None:
    """rules/value_codec.decode of what a box answers %box_pull with (the first byte: the JSON as sent, or with one
    byte of its npy array changed): a value or one one-line ValueCodecError, within the limit; what it reads
    encodes again and reads back the same (same type, dtypes, index and names)."""
    import numpy as np
    import pandas as pd

    from tkbox_nb.rules import value_codec as vc
    try:
        entry = p.loads_strict(data[1:], "a pulled value")
    except (ValueError, p.ProtocolError):
        return
    if data[0] & 1 and isinstance(entry, dict) and isinstance(entry.get("npy"), str):  # one npy byte changed
        try:
            raw = bytearray(base64.b64decode(entry["npy"], validate=True))
        except ValueError:  # not base64: sent as it is
            raw = bytearray()
        if raw:
            raw[(data[0] >> 1) % len(raw)] ^= 0xFF if data[0] < 128 else 0x01
            entry["npy"] = base64.b64encode(bytes(raw)).decode()
    try:
        value = vc.decode(entry, 1 << 20)
    except vc.ValueCodecError as e:
        assert "\n" not in str(e)
        return
    again = vc.decode(json.loads(json.dumps(vc.encode(value))), 1 << 20)
    assert type(again) is type(value)
    if isinstance(value, pd.DataFrame):
        pd.testing.assert_frame_equal(again, value)
    elif isinstance(value, pd.Series):
        pd.testing.assert_series_equal(again, value)
    elif isinstance(value, (np.ndarray, np.generic)):
        assert again.dtype == value.dtype and again.shape == value.shape
        np.testing.assert_array_equal(again, value)
    else:
        assert again == value
