"""The door stream codec: length-prefixed frames multiplexing many streams on one byte stream. Sans-IO.

Both sides use this module: the guest agent (standard library only, Python >= 3.9) and the host. Bytes go in,
frames and stream events come out, and every limit is checked here, so the codec can be fuzzed on its own.
docs/protocol.md is the specification.

    frame  = length:u32be type:u8 stream:u32be payload[length]
    OPEN   payload = JSON object (what the stream is for)      opener: host odd ids, guest even ids
    DATA   payload = channel:u8 bytes                          counts against the receiver's window
    WINDOW payload = credit:u32be                              more bytes the sender may send on the stream
    CLOSE  payload = JSON object or empty                      no more frames from this side on the stream
"""

import json
import re
import struct

OPEN, DATA, WINDOW, CLOSE = 1, 2, 3, 4
TYPES = {OPEN: "open", DATA: "data", WINDOW: "window", CLOSE: "close"}
HEADER = struct.Struct(">IBI")
MAX_PAYLOAD = 256 * 1024          # bytes in one frame
MAX_STREAMS = 256                 # open at once, both directions
INITIAL_WINDOW = 1024 * 1024      # bytes a side may send on a stream before the peer grants more
MAX_WINDOW = 16 * 1024 * 1024     # credit never grows past this: a peer cannot make us buffer more
MAX_JSON = 64 * 1024              # OPEN and CLOSE bodies
CH_STDIN, CH_STDOUT, CH_STDERR, CH_MSG, CH_BYTES = 0, 1, 2, 3, 4


class ProtocolError(Exception):
    """The peer broke the protocol. The side that sees it ends the connection (the host: the box) and says why."""


def encode(ftype, stream, payload=b""):
    if ftype not in TYPES:
        raise ValueError("unknown frame type")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError("payload over MAX_PAYLOAD")
    return HEADER.pack(len(payload), ftype, stream) + payload


def encode_json(ftype, stream, obj):
    return encode(ftype, stream, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8"))


def encode_data(stream, channel, data):
    """One DATA frame per MAX_PAYLOAD - 1 bytes of `data` (none for no bytes: an empty DATA frame is a violation)."""
    step = MAX_PAYLOAD - 1
    return b"".join(encode(DATA, stream, bytes([channel]) + data[i:i + step])
                    for i in range(0, len(data), step))


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name):
    raise ValueError("not JSON: " + name)


def finite_float(text):
    """A JSON number as a float, refused if it overflows to infinity (1e999): the host would write it out again as
    `Infinity`, which is not JSON, to the signer, the bundle or a Jupyter frontend."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("not JSON: a number out of range")
    return value


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:60]!r}")
        out[key] = value
    return out


def _non_standard(name):
    raise ValueError(f"non-standard number {name}")


def loads_one_reading(data):
    """JSON that every reader reads the same way, or ValueError: UTF-8 only, no duplicate key (Python keeps the
    last, another reader may keep the first), no NaN or Infinity, spelled or overflowing (1e999). For what is
    signed or verified as read: a model call's body, a bundle's files."""
    return json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_non_standard,
                      parse_float=finite_float)


def loads_strict(body, what):
    """One JSON object from UTF-8 bytes, strictly: no NaN or Infinity (spelled, or a number overflowing to it), and
    no lone surrogate escape (a string the
    host could not write out again as UTF-8, to the signer or to a Jupyter frontend). ProtocolError otherwise."""
    try:
        obj = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constant, parse_float=finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError(what + " that is not JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(what + " that is not a JSON object")
    if _SURROGATE_ESCAPE.search(body):  # rare: only then check every string (a valid pair is one character)
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(what + " with a lone surrogate") from None
    return obj


def decode_json(payload, what):
    if len(payload) > MAX_JSON:
        raise ProtocolError(what + ": JSON body over the limit")
    if not payload:
        return {}
    return loads_strict(payload, what + ": a body")


class Decoder:
    """Bytes in, (type, stream, payload) frames out. Raises ProtocolError on a bad header or oversized frame."""

    def __init__(self, max_payload=MAX_PAYLOAD):
        self.max_payload = max_payload
        self._buf = bytearray()

    def feed(self, data):
        """Frames whose payloads are memoryviews of `data` where a frame lies whole in it (no copy on the bulk path);
        only a frame that straddles two feeds is copied."""
        frames = []
        view = memoryview(data)
        pos = 0
        if self._buf:  # finish the frame begun in an earlier feed
            if len(self._buf) < HEADER.size:
                take = min(HEADER.size - len(self._buf), len(view))
                self._buf += view[:take]
                pos = take
                if len(self._buf) < HEADER.size:
                    return frames
            length, ftype, stream = self._header(self._buf, 0)
            take = min(HEADER.size + length - len(self._buf), len(view) - pos)
            self._buf += view[pos:pos + take]
            pos += take
            if len(self._buf) < HEADER.size + length:
                return frames
            frames.append((ftype, stream, bytes(self._buf[HEADER.size:])))
            self._buf = bytearray()
        while len(view) - pos >= HEADER.size:
            length, ftype, stream = self._header(view, pos)
            if len(view) - pos < HEADER.size + length:
                break
            frames.append((ftype, stream, view[pos + HEADER.size:pos + HEADER.size + length]))
            pos += HEADER.size + length
        if pos < len(view):
            self._buf += view[pos:]
        return frames

    def _header(self, buf, pos):
        length, ftype, stream = HEADER.unpack_from(buf, pos)
        if ftype not in TYPES:
            raise ProtocolError("unknown frame type %d" % ftype)
        if length > self.max_payload:
            raise ProtocolError("frame of %d bytes, over the limit of %d" % (length, self.max_payload))
        return length, ftype, stream

    @property
    def buffered(self):
        return len(self._buf)


class FrameReader:
    """Frames parsed in place in one reused buffer: the reader's caller reads into `room()` and hands the count to
    `filled(n)`, which returns the frames now whole, their payloads memoryviews of the buffer. A frame that arrives
    in pieces is not copied piece by piece (as Decoder does): the next read goes on after it in the same buffer, and
    only when the buffer's end is reached is the unfinished frame moved to the front (at most one frame, once per
    buffer's worth). Every header is checked as soon as it is whole. The frames of one `filled` are valid until the
    next `room()`, which may overwrite them: a consumer that keeps bytes copies them. Sans-IO."""

    def __init__(self, size=4 * 1024 * 1024, max_payload=MAX_PAYLOAD):
        if size < HEADER.size + max_payload:
            raise ValueError("a buffer smaller than one frame")
        self.max_payload = max_payload
        self._view = memoryview(bytearray(size))
        self._start = self._end = 0    # the unparsed bytes: the beginning of one frame, not yet whole
        self._need = HEADER.size       # bytes the frame at _start takes in all, once its header is known

    def room(self):
        """The writable view to read into next (never empty)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._view) or self._start + self._need > len(self._view):
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start:self._end]
            self._start, self._end = 0, kept
        return self._view[self._end:]

    def filled(self, n):
        """`n` more bytes were written at the start of the last `room()`: the frames now whole."""
        if not 0 < n <= len(self._view) - self._end:
            raise ValueError("filled past the room given")
        self._end += n
        frames, view, pos, end = [], self._view, self._start, self._end
        while end - pos >= HEADER.size:
            length, ftype, stream = HEADER.unpack_from(view, pos)
            if ftype not in TYPES:
                raise ProtocolError("unknown frame type %d" % ftype)
            if length > self.max_payload:
                raise ProtocolError("frame of %d bytes, over the limit of %d" % (length, self.max_payload))
            if end - pos < HEADER.size + length:
                self._start, self._need = pos, HEADER.size + length
                return frames
            frames.append((ftype, stream, view[pos + HEADER.size:pos + HEADER.size + length]))
            pos += HEADER.size + length
        self._start, self._need = pos, HEADER.size
        return frames

    def want(self):
        """For a caller that may read a frame's payload another way (splice): how much to read next so that no read
        goes past the current frame; a header and the first payload byte (the channel of a DATA frame) first."""
        have = self._end - self._start
        return HEADER.size + 1 - have if have <= HEADER.size else self._need - have

    def peek(self):
        """(type, stream, payload length) of the unfinished frame when exactly its header and first payload byte
        are buffered (what `want` reads up to), else None."""
        if self._end - self._start != HEADER.size + 1 or self._need <= HEADER.size + 1:
            return None
        length, ftype, stream = HEADER.unpack_from(self._view, self._start)
        return ftype, stream, length

    def take(self):
        """The frame `peek` shows, handed to the caller, who reads its remaining payload bytes from the source
        itself: (type, stream, first payload byte, bytes still to come). The reader starts afresh after it."""
        found = self.peek()
        if found is None:
            raise ValueError("no frame to take")
        ftype, stream, length = found
        first = self._view[self._start + HEADER.size]
        self._start = self._end = 0
        self._need = HEADER.size
        return ftype, stream, first, length - 1

    @property
    def buffered(self):
        return self._end - self._start


class Session:
    """The stream state of one side. `receive` checks each frame from the peer against the protocol and the limits
    and returns events: ("open", id, body), ("data", id, channel, bytes), ("window", id, n), ("close", id, body).
    `may_send` / `sent` keep this side within the peer's windows."""

    def __init__(self, is_host, max_streams=MAX_STREAMS, window=INITIAL_WINDOW):
        self.is_host = is_host
        self.max_streams = max_streams
        self.window = window
        self.streams = {}   # id -> {"recv_left", "send_left", "owed", "size", "recv_closed", "sent_closed"}
        self._next = 1 if is_host else 2
        self._peer_max = 0  # the highest stream id the peer opened

    def _new(self, sid):
        if len(self.streams) >= self.max_streams:
            raise ProtocolError("more than %d streams open" % self.max_streams)
        self.streams[sid] = {"recv_left": self.window, "send_left": self.window, "owed": 0, "size": self.window,
                             "recv_closed": False, "sent_closed": False}

    def open(self):
        """A new stream id of ours (host: odd, guest: even)."""
        sid = self._next
        self._next += 2
        if sid > 0xFFFFFFFF:
            raise ProtocolError("stream ids exhausted")
        self._new(sid)
        return sid

    def receive(self, ftype, sid, payload):
        st = self.streams.get(sid)
        if ftype == OPEN:
            theirs = (sid % 2 == 0) if self.is_host else (sid % 2 == 1)
            if sid == 0 or not theirs:
                raise ProtocolError("stream %d opened by the wrong side" % sid)
            if st is not None:
                raise ProtocolError("stream %d opened twice" % sid)
            if sid <= self._peer_max:
                raise ProtocolError("stream %d reopened" % sid)
            body = decode_json(payload, "open")
            self._new(sid)
            self._peer_max = sid
            return ("open", sid, body)
        if st is None:
            if ftype == WINDOW and len(payload) == 4 and self._was_open(sid):
                return ("window", sid, 0)  # credit that crossed our close: nothing to do
            raise ProtocolError("%s on stream %d, which is not open" % (TYPES[ftype], sid))
        if ftype == DATA:
            if not payload:
                raise ProtocolError("data frame without a channel")
            self._data(st, sid, len(payload) - 1)  # an empty one is a violation: it would cost the window nothing
            return ("data", sid, payload[0], payload[1:])
        if ftype == WINDOW:
            if len(payload) != 4:
                raise ProtocolError("window frame of %d bytes" % len(payload))
            (credit,) = struct.unpack(">I", payload)
            if credit == 0 or st["send_left"] + credit > MAX_WINDOW:
                raise ProtocolError("window credit %d on stream %d is out of range" % (credit, sid))
            st["send_left"] += credit
            return ("window", sid, credit)
        if ftype == CLOSE:
            if st["recv_closed"]:
                raise ProtocolError("stream %d closed twice" % sid)
            st["recv_closed"] = True
            body = decode_json(payload, "close")
            self._forget(sid)
            return ("close", sid, body)
        raise ProtocolError("unknown frame type")

    def receive_data(self, sid, n):
        """The checks of `receive` for a DATA frame of `n` bytes (after its channel) that the caller reads itself
        rather than through a reader's buffer (FrameReader.take): a violation raises as it would there."""
        st = self.streams.get(sid)
        if st is None:
            raise ProtocolError("data on stream %d, which is not open" % sid)
        self._data(st, sid, n)

    def _data(self, st, sid, n):
        if n <= 0:
            raise ProtocolError("an empty data frame on stream %d" % sid)
        if st["recv_closed"]:
            raise ProtocolError("data on stream %d after its close" % sid)
        if n > st["recv_left"]:
            raise ProtocolError("stream %d sent %d bytes past its window" % (sid, n - st["recv_left"]))
        st["recv_left"] -= n

    def _was_open(self, sid):
        ours = (sid % 2 == 1) if self.is_host else (sid % 2 == 0)
        return 0 < sid < self._next if ours else 0 < sid <= self._peer_max

    def consumed(self, sid, n):
        """We processed `n` bytes of stream `sid`: the WINDOW frame granting them back, or b"" while the credit
        owed is under a quarter of the stream's window (the initial one plus what `grant` added): one frame per
        256 KiB on a plain stream, per 2 MiB on a download's 8 MiB, not one per message; the peer still has three
        quarters of its window to send on meanwhile, and fewer WINDOW frames mean fewer wake-ups on both sides."""
        st = self.streams.get(sid)
        if st is None or st["recv_closed"] or n <= 0:
            return b""
        st["owed"] += n
        if st["owed"] < min(st["size"], MAX_WINDOW) // 4:
            return b""
        credit, st["owed"] = st["owed"], 0
        st["recv_left"] += credit
        return encode(WINDOW, sid, struct.pack(">I", credit))

    def grant(self, sid, n):
        """Extra credit on one of our receiving streams (a bulk stream may take a larger window): the WINDOW frame."""
        st = self.streams.get(sid)
        if st is None or st["recv_closed"] or n <= 0 or st["recv_left"] + n > MAX_WINDOW:
            return b""
        st["recv_left"] += n
        st["size"] += n
        return encode(WINDOW, sid, struct.pack(">I", n))

    def may_send(self, sid):
        st = self.streams.get(sid)
        return 0 if st is None or st["sent_closed"] else st["send_left"]

    def sent(self, sid, n):
        st = self.streams[sid]
        if n > st["send_left"]:
            raise ValueError("sending past the peer's window")
        st["send_left"] -= n

    def close(self, sid, body=None):
        """The CLOSE frame of ours for `sid`."""
        st = self.streams.get(sid)
        if st is None or st["sent_closed"]:
            return b""
        st["sent_closed"] = True
        self._forget(sid)
        return encode_json(CLOSE, sid, body or {})

    def _forget(self, sid):
        st = self.streams.get(sid)
        if st and st["recv_closed"] and st["sent_closed"]:
            del self.streams[sid]


# -- messages on a stream's channel 3 ----------------------------------------------------------------------------------
# A JSON message may be larger than one frame: on channel 3 each message is length:u32be followed by that many bytes
# of UTF-8 JSON, and may span DATA frames. MessageReader is the receiving side, with its own size limit.
MSG_HEADER = struct.Struct(">I")
MAX_MESSAGE = 32 * 1024 * 1024
# in an execute_request's metadata, host -> box: the execution count the frontend shows for the cell (an int); the
# bridge (guest/kernel.py) sets its ipykernel's count to it first, so `In[n]`, `Out[n]` and `_n` in the box name the
# cell the notebook shows as [n], and takes the key off before the kernel sees the request
COUNT_KEY = "tkbox_execution_count"


def encode_message(obj, default=None):
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=default).encode("utf-8")
    return MSG_HEADER.pack(len(body)) + body


class MessageReader:
    """Bytes of one stream's channel 3 in, JSON objects out. Raises ProtocolError on an oversized or invalid one.
    With parse=False the messages come out as their JSON bytes, split and size-checked only: for the guest's kernel
    bridge, which parses each once itself (the host's messages need no checking there, and every parse is
    emulated in a VM)."""

    def __init__(self, max_message=MAX_MESSAGE, parse=True):
        self.max_message = max_message
        self.parse = parse
        self._buf = bytearray()

    def feed(self, data):
        self._buf += data
        out = []
        while len(self._buf) >= MSG_HEADER.size:
            (length,) = MSG_HEADER.unpack_from(self._buf)
            if length > self.max_message:
                raise ProtocolError("a message of %d bytes, over the limit of %d" % (length, self.max_message))
            if len(self._buf) < MSG_HEADER.size + length:
                break
            body = bytes(self._buf[MSG_HEADER.size:MSG_HEADER.size + length])
            del self._buf[:MSG_HEADER.size + length]
            out.append(loads_strict(body, "a message") if self.parse else body)
        return out

    @property
    def buffered(self):
        return len(self._buf)
