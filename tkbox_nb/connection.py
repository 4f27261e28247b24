"""The host end of the door stream: a reader thread around the sans-IO codec, one event queue per stream.

Everything read here comes from the box and is hostile. The codec checks frames and limits; any violation (or a
reply that does not fit what was asked) ends the connection at once and calls `on_violation` with the reason, so
the box is stopped fail-closed and the reason recorded. Window credit is granted back only as the host consumes a
stream's data, so a box can never make the host buffer more than its windows.
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Callable

from . import protocol as p


class StreamClosed(Exception):
    pass


class Stream:
    """Events of one stream: ("data", channel, bytes), ("close", body), ("violation", reason)."""

    def __init__(self, conn: "HostConnection", sid: int):
        self.conn, self.sid = conn, sid
        self.events: queue.Queue = queue.Queue()

    def get(self, timeout: float | None = None):
        event = self.events.get(timeout=timeout)
        if event[0] == "data":
            self.conn.consumed(self.sid, len(event[2]))
        return event


class HostConnection:
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
        self.bytes_in = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name="tkbox-door")
        self._reader.start()

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
            s.events.put(("violation", self.violation or "the box's door stream ended"))
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
                self.sock.sendall(self.session.close(sid))
            return
        stream = self.streams.get(sid)
        if stream is None:
            raise p.ProtocolError(f"{kind} on stream {sid}, which nobody here reads")
        if kind == "data":
            stream.events.put(("data", event[2], event[3]))
        elif kind == "close":
            stream.events.put(("close", event[2]))
            self.streams.pop(sid, None)

    def _violate(self, reason: str) -> None:
        if self.violation is None:
            self.violation = reason[:500]
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.on_violation(self.violation)

    # -- writing -------------------------------------------------------------------------------------------------
    def open(self, body: dict) -> Stream:
        if self.closed or self.violation:
            raise StreamClosed(self.violation or "the door stream is closed")
        with self.lock:
            sid = self.session.open()
            stream = self.streams[sid] = Stream(self, sid)
            self.sock.sendall(p.encode_json(p.OPEN, sid, body))
        return stream

    def send_data(self, sid: int, channel: int, data: bytes, window_wait_s: float = 60.0) -> None:
        """Send within the box's window, waiting for credit (a box that grants none for `window_wait_s` is
        treated as gone for this stream)."""
        view = memoryview(data)
        while len(view):
            with self.lock:
                n = min(len(view), self._credit(sid, window_wait_s))
                self.session.sent(sid, n)
                _send_parts(self.sock, (p.HEADER.pack(n + 1, p.DATA, sid), bytes((channel,)), view[:n]))
            view = view[n:]

    def _credit(self, sid: int, window_wait_s: float) -> int:
        """Under the lock: the bytes the next DATA frame on `sid` may carry, once the box's window allows any."""
        while True:
            n = min(self.session.may_send(sid), p.MAX_PAYLOAD - 1)
            if n > 0:
                return n
            if self.closed or self.violation or sid not in self.session.streams:
                raise StreamClosed("the stream is closed")
            if not self.window_changed.wait(window_wait_s):
                raise StreamClosed("the box gives no window for this stream")

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
            _send_parts(self.sock, (p.HEADER.pack(n + 1, p.DATA, sid), bytes((channel,))))
            pipe.drain(self.sock.fileno(), n)

    def close(self, sid: int, body: dict | None = None) -> None:
        with self.lock:
            frame = self.session.close(sid, body)
            if frame and not self.closed:
                self.sock.sendall(frame)

    def consumed(self, sid: int, n: int) -> None:
        with self.lock:
            frame = self.session.consumed(sid, n)
            if frame and not self.closed:
                try:
                    self.sock.sendall(frame)
                except OSError:
                    pass

    def shutdown(self) -> None:
        self.closed = True
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
