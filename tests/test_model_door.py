"""The model door's whole call, driven without a box: tests/bound_relay's in-memory stream and recorder (deciding with
the real policy) and a plain-HTTP upstream on 127.0.0.1. Every allowed call gets its signed end, and its reserved
output tokens back."""

from __future__ import annotations

import socket
import threading

from tests.bound_relay import FakeBox, FakeStream
from tkbox_nb.guest import protocol as p
from tkbox_nb.doors.model import ModelDoor
from tkbox_nb.policy import Policy
from tkbox_nb.stream.events import Data

BODY = b'{"model":"claude-x","max_tokens":60,"messages":[]}'


def upstream(answer: bytes, seen: list | None = None) -> int:
    """A provider on 127.0.0.1 (its port returned): each connection's request, read to its JSON body's end, is kept
    in `seen` (if given) and answered `answer`."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def run():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                        more = conn.recv(65536)
                        if not more:
                            break
                        data += more
                    if seen is not None:
                        seen.append(data)
                    conn.sendall(answer)
                except OSError:
                    pass
    threading.Thread(target=run, daemon=True).start()
    return server.getsockname()[1]


def _door(monkeypatch, port: int) -> ModelDoor:
    monkeypatch.setenv("TKB_TEST_KEY", "sk-ant-legal")
    policy = Policy.from_toml('[models]\nallow = ["anthropic:*"]\nmax_output_tokens = 100\n[models.anthropic]\n'
                              f'base_url = "http://127.0.0.1:{port}"\nkey = "env:TKB_TEST_KEY"\n')
    return ModelDoor(FakeBox(policy, []))


def serve(door: ModelDoor, request: bytes) -> bytes:
    """What the door sends the box for one connection on which the box sent `request`."""
    stream = FakeStream()
    stream.events.put(Data(p.CH_BYTES, request))
    door._serve(stream)
    out = []
    while not door.box.conn.out.empty():
        out.append(door.box.conn.out.get() or b"")
    return b"".join(out)


def _call(door: ModelDoor, extra: bytes = b"") -> bytes:
    return serve(door, b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra
                 + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)


def _ends_signed(door: ModelDoor) -> None:
    log = door.box.recorder.log
    allowed = [e for e in log if e[0] == "decide" and e[4] == "allow"]
    assert len([e for e in log if e[0] == "complete"]) == len(allowed)
    assert door.reserved == 0


def test_a_header_value_not_ascii_is_refused_400_and_signed(monkeypatch):
    """`Accept: \\xe9` passed h11 (obs-text) and made httpx raise UnicodeEncodeError: the allowed call was never
    signed as ended and its reserved output tokens never came back, so the run's budget shrank for good."""
    door = _door(monkeypatch, upstream(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"))
    for _ in range(2):
        out = _call(door, b"accept: \xe9\r\n")
        assert out.startswith(b"HTTP/1.1 400") and b"not visible ASCII" in out
    refusals = [e for e in door.box.recorder.log if e[0] == "decide"]
    assert len(refusals) == 2 and all("request_error" in e[3] for e in refusals)
    _ends_signed(door)


def test_an_upstream_content_type_not_ascii_still_ends_the_call_signed(monkeypatch):
    door = _door(monkeypatch, upstream(b"HTTP/1.1 200 OK\r\ncontent-type: application/json; x=\xe9\r\n"
                                        b"content-length: 2\r\nconnection: close\r\n\r\n{}"))
    out = _call(door)
    assert out.startswith(b"HTTP/1.1 200") and b"content-type: application/json; x=?" in out
    _ends_signed(door)
    assert [e[2] for e in door.box.recorder.log if e[0] == "complete"] == ["ok"]


def test_a_response_that_reports_no_usage_is_charged_what_the_call_reserved(monkeypatch):
    """A streamed OpenAI chat without `stream_options.include_usage` reports no usage: it counted as 0 tokens, so
    a run output budget let call after call through."""
    stream = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    port = upstream(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n"
                     b"connection: close\r\n\r\n" % len(stream) + stream)
    monkeypatch.setenv("TKB_TEST_KEY", "sk-legal")
    door = ModelDoor(FakeBox(Policy.from_toml(
        '[models]\nallow = ["openai:*"]\nmax_output_tokens = 100\nmax_input_tokens = 1000\n[models.openai]\n'
        f'base_url = "http://127.0.0.1:{port}"\nkey = "env:TKB_TEST_KEY"\n'), []))
    body = b'{"model":"gpt-x","max_tokens":60,"stream":true,"messages":[]}'

    def call() -> bytes:
        s = FakeStream()
        s.events.put(Data(p.CH_BYTES, b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body))
        door._serve(s)
        out = []
        while not door.box.conn.out.empty():
            out.append(door.box.conn.out.get() or b"")
        return b"".join(out)

    assert call().startswith(b"HTTP/1.1 200")
    (end,) = [e for e in door.box.recorder.log if e[0] == "complete"]
    assert end[3]["usage"] == {"input_tokens": len(body), "output_tokens": 60}
    assert end[3]["usage_charged"] == ["output_tokens", "input_tokens"]
    assert (door.output_tokens, door.input_tokens, door.reserved) == (60, len(body), 0)
    assert call().startswith(b"HTTP/1.1 403")  # 60 charged + 60 asked is over the run's 100
