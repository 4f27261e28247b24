"""The host end of the door stream (stream/connection.py) against a scripted hostile box on a socketpair: what it
queues for a stream nobody reads, what it keeps of a stream it closed, and a box that stops reading its door."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from tkbox_nb.guest import protocol as p
from tkbox_nb.stream.connection import MAX_QUEUED, HostConnection, StreamClosed
from tkbox_nb.stream.events import Close, Data, Lost


class Peer:
    """The box's end: frames written by hand; a HostConnection on the other end that records its violation."""

    def __init__(self, take_opened: bool = True, write_stall_s: float | None = None):
        self.sock, host_sock = socket.socketpair()
        self.violations: list[str] = []
        self.opened: list = []
        self.ended = threading.Event()

        def on_open(stream, body):
            self.opened.append(stream)
            return take_opened

        def on_violation(reason):
            self.violations.append(reason)
            self.ended.set()

        self.conn = HostConnection(host_sock, on_violation, on_open=on_open)
        if write_stall_s is not None:
            self.conn.write_stall_s = write_stall_s
        self.send(p.encode_json(p.OPEN, 2, {"kind": "hello"}) + p.encode(p.CLOSE, 2))
        assert self.conn.ready.wait(5)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.conn.shutdown()
        self.sock.close()


@pytest.fixture
def peer():
    pr = Peer()
    yield pr
    pr.close()


def test_an_empty_data_frame_is_a_violation_as_it_would_cost_no_window(peer):
    """A DATA frame of only its channel byte charged nothing against the window: a box could send them forever and
    the host queued every one (a gigabyte in 30 s). Now the first one ends the box."""
    peer.send(p.encode_json(p.OPEN, 4, {"kind": "egress"}) + p.encode(p.DATA, 4, b"\x04") * 1000)
    assert peer.ended.wait(5), "an empty data frame was taken"
    assert "empty data frame" in peer.violations[0]
    with pytest.raises(p.ProtocolError, match="empty data frame"):
        _session_with(4).receive(p.DATA, 4, b"\x04")


def _session_with(sid: int) -> p.Session:
    s = p.Session(is_host=True)
    s.receive(p.OPEN, sid, b"{}")
    return s


def test_a_stream_s_queue_is_bounded_and_its_overflow_is_a_violation(peer):
    """Tiny frames on a stream the host does not read (channels alternating, so none can be joined) stay within the
    window, but each was one queued event: past MAX_QUEUED waiting, the box is ended."""
    frames = b"".join(p.encode(p.DATA, 4, bytes((1 + i % 2,)) + b"x") for i in range(MAX_QUEUED + 10))
    peer.send(p.encode_json(p.OPEN, 4, {"kind": "egress"}) + frames)
    assert peer.ended.wait(5), "the queue grew past its bound"
    assert f"more than {MAX_QUEUED} data frames waiting unread" in peer.violations[0]
    assert peer.opened[0].events.qsize() <= MAX_QUEUED + 1  # and the violation itself


def test_small_frames_of_one_channel_are_joined_not_queued_one_by_one(peer):
    """A box sending its bytes in many small frames (a program writing a byte at a time) is not a violation: frames of
    one channel waiting unread are joined, and the bytes come out whole and in order."""
    payload = bytes(range(256)) * 80  # 20480 frames of one byte each
    peer.send(p.encode_json(p.OPEN, 4, {"kind": "egress"}) +
              b"".join(p.encode(p.DATA, 4, b"\x04" + payload[i:i + 1]) for i in range(len(payload))))
    deadline = time.monotonic() + 5
    while not peer.opened and time.monotonic() < deadline:
        time.sleep(0.01)
    stream = peer.opened[0]
    while peer.conn.bytes_in < len(payload) * (p.HEADER.size + 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not peer.violations and stream.events.qsize() <= 1
    got = b""
    while len(got) < len(payload):
        event = stream.get(timeout=5)
        assert isinstance(event, Data) and event.channel == p.CH_BYTES
        got += bytes(event.payload)
    assert got == payload


def _opened(peer) -> "object":
    deadline = time.monotonic() + 5
    while not peer.opened and time.monotonic() < deadline:
        time.sleep(0.01)
    return peer.opened[0]


def test_a_stream_s_events_are_typed_data_then_the_box_s_close(peer):
    """What a stream's reader gets are events of stream/events.py, never tagged tuples: each DATA frame's channel and
    payload as `Data`, the box's CLOSE with its body as `Close`, its last; and what was read is credited back."""
    peer.send(p.encode_json(p.OPEN, 4, {"kind": "egress"}) + p.encode(p.DATA, 4, b"\x04hello") +
              p.encode(p.DATA, 4, b"\x01out") + p.encode_json(p.CLOSE, 4, {"exit": 3}))
    stream = _opened(peer)
    assert [stream.get(timeout=5) for _ in range(3)] == [Data(p.CH_BYTES, b"hello"), Data(p.CH_STDOUT, b"out"),
                                                         Close({"exit": 3})]
    assert not peer.violations and stream.events.qsize() == 0


def test_a_stream_the_door_stream_ends_under_gets_lost_with_the_violation(peer):
    """A violation ends the door stream: every stream still read gets `Lost` naming it, after what came before."""
    stream = peer.conn.open({"kind": "command", "argv": ["true"]})
    peer.send(p.encode(p.DATA, stream.sid, b"\x01x") + p.encode(p.DATA, stream.sid, b"\x01"))
    assert peer.ended.wait(5)
    first, last = stream.get(timeout=5), stream.get(timeout=5)
    assert first == Data(p.CH_STDOUT, b"x")
    assert isinstance(last, Lost) and last.reason == peer.violations[0] and "empty data frame" in last.reason


def test_a_stream_s_queue_refuses_anything_but_a_typed_event(peer):
    """A tagged tuple (or any other object) put on a stream's queue is refused at once: no reader ever compares a
    tag, so a misspelt one cannot pass as data or as the stream's end."""
    peer.send(p.encode_json(p.OPEN, 4, {"kind": "egress"}))
    stream = _opened(peer)
    for untyped in (("data", p.CH_BYTES, b"x"), ("close", {}), ("violation", "gone"), b"x", None):
        with pytest.raises(TypeError, match="no door stream event"):
            stream.events.put(untyped)
    assert stream.events.qsize() == 0
    stream.events.put(Lost("the test ended it"))
    assert stream.get(timeout=1) == Lost("the test ended it")


def test_data_after_the_host_closed_a_box_opened_stream_is_dropped_and_never_credited(peer):
    """Once the host has closed its side of a stream the box opened (an egress refusal), nothing reads it: its data
    is dropped, not queued, and still counts against its window, so more than a window of it is a violation."""
    peer.send(p.encode_json(p.OPEN, 4, {"kind": "egress"}))
    deadline = time.monotonic() + 5
    while not peer.opened and time.monotonic() < deadline:
        time.sleep(0.01)
    stream = peer.opened[0]
    peer.conn.close(4, {})
    chunk = b"\x04" + b"y" * (p.MAX_PAYLOAD - 1)
    sent = 0
    while sent + p.MAX_PAYLOAD - 1 <= p.INITIAL_WINDOW:
        peer.send(p.encode(p.DATA, 4, chunk))
        sent += p.MAX_PAYLOAD - 1
    peer.send(p.encode(p.DATA, 4, b"\x04" + b"z" * (p.INITIAL_WINDOW - sent)))
    time.sleep(0.3)
    assert not peer.violations and stream.events.qsize() == 0  # dropped, within the window
    peer.send(p.encode(p.DATA, 4, b"\x04!"))
    assert peer.ended.wait(5) and "past its window" in peer.violations[0]


def test_a_box_that_stops_reading_its_door_ends_at_the_write_deadline():
    """A box that grants a large window and then never reads: the host's write blocked for good under the door's
    lock, and every other writer behind it. Now the write deadline ends the box, and the writer wakes."""
    pr = Peer(write_stall_s=1.0)
    try:
        stream = pr.conn.open({"kind": "command", "argv": ["cat"]})
        pr.send(p.encode(p.WINDOW, stream.sid, struct.pack(">I", p.MAX_WINDOW - p.INITIAL_WINDOW)))
        time.sleep(0.2)
        outcome = {}

        def write():
            try:
                pr.conn.send_data(stream.sid, p.CH_STDIN, b"x" * (14 << 20))
                outcome["r"] = "sent"
            except (OSError, StreamClosed) as e:
                outcome["r"] = e

        writer = threading.Thread(target=write, daemon=True)
        started = time.monotonic()
        writer.start()
        writer.join(10)
        assert not writer.is_alive(), "the write to a box that stopped reading never returned"
        assert time.monotonic() - started < 5 and isinstance(outcome["r"], (OSError, StreamClosed))
        assert pr.ended.wait(5) and pr.violations == ["the box stopped reading its door for 1 s"]
        closing = threading.Thread(target=lambda: pr.conn.close(stream.sid), daemon=True)
        closing.start()
        closing.join(2)
        assert not closing.is_alive()  # the door's lock is free again
    finally:
        pr.close()


def test_a_write_past_its_caller_s_deadline_calls_it_and_wakes():
    """The exec door's deadline covers stdin too: a write blocked past it calls the caller's end (the box ends with
    `exec timed out`), long before the stall deadline."""
    pr = Peer(write_stall_s=60.0)
    try:
        stream = pr.conn.open({"kind": "command", "argv": ["cat"]})
        pr.send(p.encode(p.WINDOW, stream.sid, struct.pack(">I", p.MAX_WINDOW - p.INITIAL_WINDOW)))
        time.sleep(0.2)
        called = []
        started = time.monotonic()
        with pytest.raises((OSError, StreamClosed)):
            pr.conn.send_data(stream.sid, p.CH_STDIN, b"x" * (14 << 20), deadline=time.monotonic() + 1.0,
                              on_deadline=lambda: called.append(time.monotonic() - started))
        assert called and called[0] < 3 and time.monotonic() - started < 5
        assert not pr.violations
    finally:
        pr.close()
