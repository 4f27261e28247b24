"""The host end of the door stream: a reader thread around the sans-IO codec, one event queue per stream.

Everything read here comes from the box and is hostile. The codec checks frames and limits; any violation (or a
reply that does not fit what was asked) ends the connection at once and calls `on_violation` with the reason, so
the box is stopped fail-closed and the reason recorded. Window credit is granted back only as the host consumes a
stream's data, so a box can never make the host buffer more than its windows; each stream's queue also holds at most
MAX_QUEUED events (small data frames of one channel are joined), so a box cannot make the host keep a million tiny
ones either. Data on a stream the box opened, after the host closed its side, is dropped and never credited back.
A stream's events are typed (`stream/events.py`: `Data`, `Close`, `Lost`), and its queue takes nothing else.

Every write to the box has a deadline: a watchdog shuts the socket once a write has waited `write_stall_s` (the box
stopped reading its door, a violation) or past the deadline its caller gave, so no writer, and nobody waiting for
the door's lock behind it, blocks for good.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Callable

from tkbox_nb.guest import protocol as p
from tkbox_nb.stream.events import EVENTS, Close, Data, Event, Lost

MAX_QUEUED = 4096          # data events waiting unread in one stream's queue
JOIN_BELOW = 64 * 1024     # a data event smaller than this is copied out of the read buffer and joined to the last
WRITE_STALL_S = 60.0       # a write to the box that has waited this long: the box stopped reading its door


class StreamClosed(Exception):
    pass


class _Events(queue.Queue):
    """A stream's events, bounded: past MAX_QUEUED data events waiting is a violation. A small data event is copied
    (so it does not hold the reader's whole buffer) and joined to the last one when that is of the same channel.
    Anything but an event of `stream/events.py` is refused (TypeError), so no untyped event reaches a reader."""

    def __init__(self, sid: int):
        super().__init__()
        self.sid = sid

    def _put(self, item: Event) -> None:
        if type(item) not in EVENTS:
            raise TypeError(f"stream {self.sid}: {type(item).__name__} is no door stream event")
        if isinstance(item, Data):
            data = item.payload
            if len(data) < JOIN_BELOW:
                last = self.queue[-1] if self.queue else None
                if isinstance(last, Data) and last.channel == item.channel and isinstance(last.payload, bytearray) \
                        and len(last.payload) + len(data) <= JOIN_BELOW:
                    last.payload.extend(data)
                    return
                item = Data(item.channel, bytearray(data))
            if len(self.queue) >= MAX_QUEUED:
                raise p.ProtocolError(f"stream {self.sid} has more than {MAX_QUEUED} data frames waiting unread")
        self.queue.append(item)


class Stream:
    """Events of one stream (`stream/events.py`): `Data(channel, payload)`, then at most one `Close(body)` (the box
    closed it) or `Lost(reason)` (the door stream ended under it), its last."""

    def __init__(self, conn: "HostConnection", sid: int):
        self.conn, self.sid = conn, sid
        self.events: queue.Queue = _Events(sid)
        self.discard = False  # the host closed its side of a stream the box opened: its data is dropped, uncredited

    def get(self, timeout: float | None = None) -> Event:
        event = self.events.get(timeout=timeout)
        if isinstance(event, Data):
            self.conn.consumed(self.sid, len(event.payload))
        return event


class HostConnection:
    write_stall_s = WRITE_STALL_S

    def __init__(self, sock: socket.socket, on_violation: Callable[[str], None],
                 on_open: Callable[["Stream", dict], bool] | None = None):
        self.sock = sock
        self.on_violation = on_violation
        self.on_open = on_open  # a stream the box opens (egress): taken when it returns True
        self.session = p.Session(is_host=True)
        self.decoder = p.Decoder()
        self.lock = threading.Lock()
        self.window_changed = threading.Condition(self.lock)
        self.streams: dict[int, Stream] = {}
        self.hello: dict | None = None
        self.ready = threading.Event()
        self.violation: str | None = None
        self.closed = False
        self.aborted = False
        self.bytes_in = 0
        self._writing: tuple | None = None  # (started, deadline or None, on_deadline or None) of the write under way
        self._reader = threading.Thread(target=self._read, daemon=True, name="tkbox-door")
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="tkbox-door-watch")
        self._watchdog.start()

    # -- reading -------------------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(1 << 20)
                if not data:
                    break
                self.bytes_in += len(data)
                for ftype, sid, payload in self.decoder.feed(data):
                    with self.lock:
                        event = self.session.receive(ftype, sid, payload)
                        if event[0] in ("window", "close"):
                            self.window_changed.notify_all()
                    self._dispatch(event)
        except p.ProtocolError as e:
            self._violate(str(e))
        except OSError:
            pass
        self.closed = True
        for s in list(self.streams.values()):
            s.events.put(Lost(self.violation or "the box's door stream ended"))
        with self.lock:
            self.window_changed.notify_all()

    def _dispatch(self, event) -> None:
        kind, sid = event[0], event[1]
        if kind == "window":
            return
        if kind == "open":
            if self.hello is None and event[2].get("kind") == "hello":
                self.hello = event[2]
                self.ready.set()
                return
            if self.hello is not None and self.on_open is not None:
                stream = self.streams[sid] = Stream(self, sid)
                if self.on_open(stream, event[2]):
                    return
                self.streams.pop(sid, None)
            raise p.ProtocolError(f"the box opened stream {sid} ({str(event[2].get('kind'))[:40]!r}), which this "
                                  "version does not take")
        if kind == "close" and sid not in self.streams:  # the hello stream ending
            with self.lock:
                self._send((self.session.close(sid),))
            return
        stream = self.streams.get(sid)
        if stream is None:
            raise p.ProtocolError(f"{kind} on stream {sid}, which nobody here reads")
        if kind == "data":
            if not stream.discard:  # else counted against its window, never granted back
                stream.events.put(Data(event[2], event[3]))
        elif kind == "close":
            stream.events.put(Close(event[2]))
            self.streams.pop(sid, None)

    def _violate(self, reason: str) -> None:
        if self.violation is None:
            self.violation = reason[:500]
            self.abort()
            self.on_violation(self.violation)

    def abort(self) -> None:
        """Shut the socket both ways (never close it under a thread that uses it): a writer blocked on the box wakes
        with an error, the reader sees the end. The box is being ended."""
        self.aborted = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- the write deadline --------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Every write runs under the door's lock with its start noted: one that waits past its caller's deadline
        or `write_stall_s` has its box ended, and the socket shut so that it (and whoever waits for the lock) wakes."""
        while not (self.aborted or (self.closed and self._writing is None)):
            time.sleep(min(0.5, self.write_stall_s / 4))
            writing = self._writing
            if writing is None:
                continue
            started, deadline, on_deadline = writing
            now = time.monotonic()
            if deadline is not None and now > deadline and on_deadline is not None:
                on_deadline()
                self.abort()
            elif now - started > self.write_stall_s:
                self._violate(f"the box stopped reading its door for {self.write_stall_s:g} s")

    def _send(self, parts: tuple, deadline: float | None = None, on_deadline=None, pipe=None, n: int = 0) -> None:
        """Under the lock: one frame to the box, from its parts (then `n` bytes from `pipe`, spliced), watched."""
        self._writing = (time.monotonic(), deadline, on_deadline)
        try:
            _send_parts(self.sock, parts)
            if pipe is not None:
                pipe.drain(self.sock.fileno(), n)
        finally:
            self._writing = None

    # -- writing -------------------------------------------------------------------------------------------------
    def open(self, body: dict) -> Stream:
        if self.closed or self.violation:
            raise StreamClosed(self.violation or "the door stream is closed")
        with self.lock:
            sid = self.session.open()
            stream = self.streams[sid] = Stream(self, sid)
            self._send((p.encode_json(p.OPEN, sid, body),))
        return stream

    def send_data(self, sid: int, channel: int, data: bytes, window_wait_s: float = 60.0,
                  deadline: float | None = None, on_deadline: Callable[[], None] | None = None) -> None:
        """Send within the box's window, waiting for credit (a box that grants none for `window_wait_s` is
        treated as gone for this stream). Past `deadline` (time.monotonic), in a wait for credit or a write,
        `on_deadline()` ends the box and StreamClosed is raised."""
        view = memoryview(data)
        while len(view):
            with self.lock:
                n = min(len(view), self._credit(sid, window_wait_s, deadline, on_deadline))
                self.session.sent(sid, n)
                self._send((p.HEADER.pack(n + 1, p.DATA, sid), bytes((channel,)), view[:n]), deadline, on_deadline)
            view = view[n:]

    def _credit(self, sid: int, window_wait_s: float, deadline: float | None = None, on_deadline=None) -> int:
        """Under the lock: the bytes the next DATA frame on `sid` may carry, once the box's window allows any."""
        give_up = time.monotonic() + window_wait_s
        while True:
            n = min(self.session.may_send(sid), p.MAX_PAYLOAD - 1)
            if n > 0:
                return n
            if self.closed or self.violation or self.aborted or sid not in self.session.streams:
                raise StreamClosed("the stream is closed")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                if on_deadline is not None:
                    on_deadline()
                raise StreamClosed("past its deadline, waiting for the box's window")
            if now >= give_up:
                raise StreamClosed("the box gives no window for this stream")
            self.window_changed.wait(min(give_up, deadline if deadline is not None else give_up) - now)

    def credit(self, sid: int, window_wait_s: float = 60.0) -> int:
        """The bytes the next DATA frame on `sid` may carry (waiting for window as `send_data` does). Only the
        stream's one sender calls it, so the credit can only grow before its `send_spliced`."""
        with self.lock:
            return self._credit(sid, window_wait_s)

    def can_splice(self) -> bool:
        """Whether `send_spliced` may be used: a blocking door socket (the bubblewrap socketpair)."""
        return self.sock.gettimeout() is None and self.sock.family == socket.AF_UNIX

    def send_spliced(self, sid: int, channel: int, pipe, n: int) -> None:
        """One DATA frame whose `n` payload bytes wait in `pipe` (doors/spliced.py): the header is written, the
        payload spliced after it, under the lock so that no other frame comes between them."""
        with self.lock:
            if self.closed or self.violation or self.session.may_send(sid) < n:
                raise StreamClosed(self.violation or "the stream is closed")
            self.session.sent(sid, n)
            self._send((p.HEADER.pack(n + 1, p.DATA, sid), bytes((channel,))), pipe=pipe, n=n)

    def close(self, sid: int, body: dict | None = None) -> None:
        with self.lock:
            frame = self.session.close(sid, body)
            stream = self.streams.get(sid)
            if stream is not None and sid % 2 == 0:  # a stream the box opened: the host reads no more of it
                stream.discard = True
            if frame and not self.closed:
                self._send((frame,))

    def consumed(self, sid: int, n: int) -> None:
        with self.lock:
            frame = self.session.consumed(sid, n)
            if frame and not self.closed:
                try:
                    self._send((frame,))
                except OSError:
                    pass

    def shutdown(self) -> None:
        self.closed = True
        self.abort()
        try:
            self.sock.close()
        except OSError:
            pass


def _send_parts(sock: socket.socket, parts: tuple) -> None:
    """One frame from its parts without joining them first (bulk data is not copied on its way out)."""
    total = sum(len(part) for part in parts)
    sent = sock.sendmsg(parts)
    if sent < total:
        sock.sendall(b"".join(bytes(part) for part in parts)[sent:])
