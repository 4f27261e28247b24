"""The door stream codec (sans-IO): frames, streams, windows and messages, including hostile byte streams."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tkbox_nb.guest import protocol as p


def test_frames_round_trip_across_any_split():
    frames = p.encode_json(p.OPEN, 2, {"kind": "hello"}) + p.encode(p.DATA, 2, b"\x01abc") + p.encode(p.CLOSE, 2)
    for cut in range(len(frames) + 1):
        d = p.Decoder()
        assert d.feed(frames[:cut]) + d.feed(frames[cut:]) == [
            (p.OPEN, 2, b'{"kind":"hello"}'), (p.DATA, 2, b"\x01abc"), (p.CLOSE, 2, b"")]


def test_window_credit_is_granted_back_in_batches_and_never_past_what_was_consumed():
    host, guest = p.Session(is_host=True), p.Session(is_host=False)
    sid = host.open()
    guest.receive(p.OPEN, sid, b"{}")
    chunk = b"\x03" + b"x" * 1000
    grants = []
    for _ in range(1024):  # the whole initial window, consumed as it comes
        assert guest.receive(p.DATA, sid, chunk)[0] == "data"
        frame = guest.consumed(sid, 1000)
        if frame:
            grants.append(struct.unpack(">I", frame[9:])[0])
    assert grants and all(g >= p.INITIAL_WINDOW // 4 for g in grants)
    assert sum(grants) <= 1024 * 1000
    guest.receive(p.DATA, sid, b"\x03" + b"x" * (p.INITIAL_WINDOW - 1024 * 1000 + sum(grants)))
    with pytest.raises(p.ProtocolError, match="past its window"):
        guest.receive(p.DATA, sid, b"\x03x")


def test_a_stream_granted_a_larger_window_gets_its_credit_back_in_larger_batches():
    """Fewer WINDOW frames on a download: a quarter of the stream's whole window at a time, never past consumed."""
    host, guest = p.Session(is_host=True), p.Session(is_host=False)
    sid = guest.open()
    host.receive(p.OPEN, sid, b"{}")
    extra = host.grant(sid, 7 * p.INITIAL_WINDOW)
    assert guest.receive(p.WINDOW, sid, extra[p.HEADER.size:]) == ("window", sid, 7 * p.INITIAL_WINDOW)
    assert guest.may_send(sid) == 8 * p.INITIAL_WINDOW
    step, consumed, grants = p.MAX_PAYLOAD - 1, 0, []
    for _ in range(64):  # 16 MiB through an 8 MiB window: only possible with the credit coming back
        n = min(step, guest.may_send(sid))
        assert n > 0
        guest.sent(sid, n)
        host.receive(p.DATA, sid, b"\x04" + b"x" * n)
        consumed += n
        frame = host.consumed(sid, n)
        if frame:
            (credit,) = struct.unpack(">I", frame[p.HEADER.size:])
            grants.append(credit)
            guest.receive(p.WINDOW, sid, frame[p.HEADER.size:])
    assert grants and all(g >= 2 * p.INITIAL_WINDOW for g in grants)
    assert len(grants) <= consumed // (2 * p.INITIAL_WINDOW)
    assert host.streams[sid]["recv_left"] == 8 * p.INITIAL_WINDOW - (consumed - sum(grants))


@pytest.mark.parametrize("frame,reason", [
    (p.HEADER.pack(0, 9, 1), "unknown frame type"),
    (p.HEADER.pack(p.MAX_PAYLOAD + 1, p.DATA, 1), "over the limit"),
])
def test_bad_headers_are_violations(frame, reason):
    with pytest.raises(p.ProtocolError, match=reason):
        p.Decoder().feed(frame)


@pytest.mark.parametrize("frames,reason", [
    ([(p.OPEN, 1, b"{}")], "wrong side"),
    ([(p.OPEN, 2, b"{}"), (p.OPEN, 2, b"{}")], "opened twice"),
    ([(p.DATA, 4, b"\x01x")], "not open"),
    ([(p.OPEN, 2, b"[1]")], "not a JSON object"),
    ([(p.OPEN, 2, b"{}"), (p.DATA, 2, b"")], "without a channel"),
    ([(p.OPEN, 2, b"{}"), (p.CLOSE, 2, b""), (p.DATA, 2, b"\x01x")], "after its close"),
    ([(p.OPEN, 2, b"{}"), (p.WINDOW, 2, struct.pack(">I", p.MAX_WINDOW))], "out of range"),
])
def test_stream_violations(frames, reason):
    host = p.Session(is_host=True)
    with pytest.raises(p.ProtocolError, match=reason):
        for ftype, sid, payload in frames:
            host.receive(ftype, sid, payload)


def test_too_many_streams_is_a_violation():
    host = p.Session(is_host=True)
    with pytest.raises(p.ProtocolError, match="streams open"):
        for sid in range(2, 2 * p.MAX_STREAMS + 4, 2):
            host.receive(p.OPEN, sid, b"{}")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048), st.integers(min_value=1, max_value=64))
def test_fuzz_decoder_and_session_take_any_bytes_without_crashing(data, step):
    """Whatever a box writes, the host either reads events or raises ProtocolError; nothing else."""
    d, host = p.Decoder(), p.Session(is_host=True)
    try:
        for i in range(0, len(data), step):
            for ftype, sid, payload in d.feed(data[i:i + step]):
                host.receive(ftype, sid, payload)
    except p.ProtocolError:
        pass
    assert d.buffered <= p.HEADER.size + p.MAX_PAYLOAD


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_message_reader_takes_any_bytes_without_crashing(data):
    try:
        for obj in p.MessageReader(max_message=256).feed(data):
            assert isinstance(obj, dict)
    except p.ProtocolError:
        pass


def _read_all(reader, data, sizes):
    """`data` through a FrameReader in reads of the given sizes (cycled, each cut to the room given), as the
    agent reads it: the frames copied out before the next read, as every consumer does."""
    frames, pos, i = [], 0, 0
    while pos < len(data):
        room = reader.room()
        n = min(len(room), sizes[i % len(sizes)], len(data) - pos)
        room[:n] = data[pos:pos + n]
        pos, i = pos + n, i + 1
        frames += [(t, s, bytes(pl)) for t, s, pl in reader.filled(n)]
    return frames


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([p.OPEN, p.DATA, p.WINDOW, p.CLOSE]), st.integers(0, 2 ** 32 - 1),
                          st.binary(max_size=200)), max_size=12),
       st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=8))
def test_frame_reader_gives_exactly_the_frames_sent_whatever_the_reads(frames, sizes):
    """The agent's in-place reader: any frames in any read sizes, through a buffer of barely one frame (so the
    unfinished frame is moved to the front again and again), come out whole, in order, unchanged."""
    data = b"".join(p.encode(t, s, pl) for t, s, pl in frames)
    reader = p.FrameReader(size=p.HEADER.size + 200, max_payload=200)
    assert _read_all(reader, data, sizes) == frames
    assert reader.buffered == 0


@pytest.mark.parametrize("header,reason", [
    (p.HEADER.pack(0, 9, 1), "unknown frame type"),
    (p.HEADER.pack(p.MAX_PAYLOAD + 1, p.DATA, 1), "over the limit"),
])
def test_frame_reader_refuses_a_bad_header_before_any_of_its_payload(header, reason):
    reader = p.FrameReader()
    good = p.encode(p.DATA, 2, b"\x04" + b"y" * 1000)
    with pytest.raises(p.ProtocolError, match=reason):
        _read_all(reader, good + header, [len(good) + 3, 6])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048), st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=4))
def test_fuzz_frame_reader_agrees_with_the_decoder_on_any_bytes(data, sizes):
    """Any bytes: the reader and the Decoder give the same frames, or both refuse them; the reader never holds
    more than one unfinished frame."""
    def through(read):
        try:
            return read(), None
        except p.ProtocolError as e:
            return None, str(e)
    reader = p.FrameReader(size=p.HEADER.size + 512, max_payload=512)
    got, why = through(lambda: _read_all(reader, data, sizes))
    d = p.Decoder(max_payload=512)
    want, why_d = through(lambda: [(t, s, bytes(pl)) for t, s, pl in d.feed(data)])
    assert (got, why) == (want, why_d)
    assert reader.buffered < p.HEADER.size + 512


def test_frame_reader_reads_up_to_a_frame_s_first_payload_byte_and_hands_the_rest_over():
    """The agent's splice path: reads sized by `want` never go past the frame; a DATA frame's header and channel
    are shown by `peek`, `take` hands its payload to the caller, and the next frame is read as usual."""
    bulk = b"\x04" + bytes(range(256)) * 400
    data = p.encode(p.WINDOW, 2, struct.pack(">I", 4096)) + p.encode(p.DATA, 2, bulk) + p.encode(p.CLOSE, 2, b"{}")
    reader, pos, frames = p.FrameReader(), 0, []
    while (reader.peek() or (None,))[0] != p.DATA:  # the agent's loop: it takes only DATA frames' payloads
        room = reader.room()
        n = min(reader.want(), len(room))
        assert n > 0
        room[:n] = data[pos:pos + n]
        pos += n
        frames += [(t, s, bytes(pl)) for t, s, pl in reader.filled(n)]
    assert frames == [(p.WINDOW, 2, struct.pack(">I", 4096))]
    assert reader.peek() == (p.DATA, 2, len(bulk)) and reader.buffered == p.HEADER.size + 1
    assert reader.take() == (p.DATA, 2, 4, len(bulk) - 1)
    assert reader.buffered == 0 and reader.peek() is None
    pos += len(bulk) - 1  # the caller read those itself
    assert _read_all(reader, data[pos:], [reader.want()]) == [(p.CLOSE, 2, b"{}")]
    with pytest.raises(ValueError):
        reader.take()


def test_data_taken_past_the_reader_is_checked_against_the_window_as_any_other():
    guest, host = p.Session(is_host=False), p.Session(is_host=True)
    sid = host.open()
    guest.receive(p.OPEN, sid, b"{}")
    guest.receive_data(sid, p.INITIAL_WINDOW - 10)
    with pytest.raises(p.ProtocolError, match="past its window"):
        guest.receive_data(sid, 11)
    with pytest.raises(p.ProtocolError, match="not open"):
        guest.receive_data(sid + 2, 1)
    guest.receive(p.CLOSE, sid, b"")
    with pytest.raises(p.ProtocolError):
        guest.receive_data(sid, 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([p.OPEN, p.DATA, p.WINDOW, p.CLOSE]), st.integers(0, 2 ** 32 - 1),
                          st.binary(max_size=300)), max_size=12),
       st.integers(min_value=0, max_value=300), st.integers(min_value=1, max_value=64))
def test_reads_sized_by_want_with_payloads_taken_give_every_frame_exactly(frames, threshold, cap):
    """However the agent splits the work (reads of at most `want`, also cut shorter; DATA payloads over a size
    taken and read past the reader), each frame comes out once, whole, in order."""
    data = b"".join(p.encode(t, s, pl) for t, s, pl in frames)
    reader, pos, got = p.FrameReader(size=p.HEADER.size + 300, max_payload=300), 0, []
    while pos < len(data):
        room = reader.room()
        n = min(reader.want(), len(room), cap, len(data) - pos)
        room[:n] = data[pos:pos + n]
        pos += n
        got += [(t, s, bytes(pl)) for t, s, pl in reader.filled(n)]
        head = reader.peek()
        if head and head[0] == p.DATA and head[2] > threshold:
            ftype, sid, first, rest = reader.take()
            got.append((ftype, sid, bytes([first]) + data[pos:pos + rest]))
            pos += rest
    assert got == frames and reader.buffered == 0


def test_message_reader_unparsed_splits_and_limits_but_leaves_the_json_to_its_reader():
    """The guest's kernel bridge parses each host message once itself: the agent's reader only splits channel 3
    into messages, across any cut, and still refuses one over the size limit."""
    bodies = [b'{"channel":"shell","content":{"code":"1+1"}}', b'{"channel":"bridge","op":"interrupt"}', b"[1]"]
    data = b"".join(p.MSG_HEADER.pack(len(b)) + b for b in bodies)
    for cut in range(len(data) + 1):
        r = p.MessageReader(parse=False)
        assert r.feed(data[:cut]) + r.feed(data[cut:]) == bodies
        assert r.buffered == 0
    with pytest.raises(p.ProtocolError):
        p.MessageReader(max_message=8, parse=False).feed(p.MSG_HEADER.pack(9) + b"x" * 9)


@pytest.mark.parametrize("size", [1, 500, 32 * 1024 - p.HEADER.size - 1, 200 * 1024, 300 * 1024])
def test_char_device_door_writes_each_frame_whole(size):
    """A VM's door is a character device with no vectored write: a small frame goes out joined in one write, a
    bulk one in parts; either way the bytes are the frame's, in order (here through a real pipe)."""
    import os
    import threading

    from tkbox_nb.guest.agent import CharDevice, Door
    r, w = os.pipe()
    got = bytearray()

    def drain():
        for chunk in iter(lambda: os.read(r, 1 << 16), b""):
            got.extend(chunk)
    reader = threading.Thread(target=drain)
    reader.start()
    door = Door(CharDevice(w))
    sid = door.session.open()
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    door.send_data(sid, p.CH_BYTES, payload)
    os.close(w)
    reader.join()
    assert p.Decoder().feed(bytes(got)) == [(p.DATA, sid, bytes((p.CH_BYTES,)) + payload[i:i + p.MAX_PAYLOAD - 1])
                                            for i in range(0, size, p.MAX_PAYLOAD - 1)]
    os.close(r)
