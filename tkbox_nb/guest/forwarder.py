"""The box's end of the egress door: an HTTP proxy address on the box's loopback that leads only to the door.

Every connection a program in the box makes to it becomes one door stream ({"kind": "egress"}) whose bytes, both
ways, go on channel 4 unchanged. The host reads the proxy request (CONNECT or absolute-form), decides, dials and
relays; this side decides nothing and parses nothing. HTTP_PROXY, HTTPS_PROXY and ALL_PROXY (and their lower-case
forms) point here, so pip, curl, git, urllib, requests and httpx use it unchanged. Standard library only.

The model door's endpoint is a second Forwarder (kind "model", 127.0.0.1:3129): the box's OpenAI and Anthropic
clients send their HTTP requests to it as to a server, and the host parses, decides and answers them the same way.

One thread serves every connection (a selector), so a hundred connections cost no threads in a box whose thread count
is limited: a client is read only while the host grants window on its stream, and credit goes back to the host only
once its bytes are delivered to the client. A download's bulk frames are spliced from the door to the client
(`splice_in`, where os.splice exists): the bytes do not pass through the agent's memory unless the client is behind.
"""

import collections
import fcntl
import os
import selectors
import socket
import threading

from . import protocol as p

PORT = 3128
MAX_CONNECTIONS = 200   # below the stream limit, so a flood is refused here rather than breaking the door
READ_SIZE = p.MAX_PAYLOAD - 1
EXTRA_WINDOW = 7 * p.INITIAL_WINDOW  # downloads: 8 MiB in flight per connection, buffered here, in the box


class _Conn:
    def __init__(self, sid, client):
        self.sid, self.client = sid, client
        self.pending = collections.deque()  # from the host, not yet delivered to the client: one copy per frame
        self.host_closed = False       # the host sent CLOSE: shut the client once pending is delivered
        self.client_eof = False


class Forwarder:
    def __init__(self, door, port=PORT, kind="egress"):
        self.door, self.kind = door, kind
        self.conns = {}   # sid -> _Conn
        self._pipe = None  # (read end, write end) for splice_in, made by can_splice
        self.lock = threading.Lock()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        threading.Thread(target=self._loop, daemon=True, name="tkbox-forwarder-" + kind).start()

    # -- called by the agent's reader thread -----------------------------------------------------------------------
    def owns(self, sid):
        return sid in self.conns

    def can_splice(self):
        """Whether `splice_in` works here (os.splice: Python >= 3.10 on Linux); makes the pipe it uses."""
        if not hasattr(os, "splice"):
            return False
        if self._pipe is None:
            try:
                r, w = os.pipe()
            except OSError:
                return False
            try:  # room for a whole frame even in many small pieces
                fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
            except OSError:
                pass
            self._pipe = (r, w)
        return True

    def splice_in(self, sid, door_fd, n):
        """The next `n` bytes of the door are the payload of a DATA frame for `sid`: moved by splice from the door
        through a pipe into the client, not through this process's memory. What the client cannot take now is
        read out of the pipe into `pending` (one copy, as in `data`), so the pipe is empty again on return and the
        reader never waits for a client."""
        r, w = self._pipe
        while n:
            k = os.splice(door_fd, w, n)
            if k <= 0:
                raise ConnectionResetError("the door ended inside a frame")
            n -= k
            self._from_pipe(sid, r, k)

    def _from_pipe(self, sid, r, k):
        """The `k` bytes in the pipe: to the client as far as it takes them, the rest into `pending`."""
        delivered, gone = 0, False
        with self.lock:
            conn = self.conns.get(sid)
            if conn is not None and not conn.pending:
                try:
                    while delivered < k:
                        moved = os.splice(r, conn.client.fileno(), k - delivered)
                        if moved <= 0:
                            break
                        delivered += moved
                except BlockingIOError:
                    pass
                except OSError:
                    gone = True  # the client is gone: what is left is dropped, the host's window kept honest
            rest = b""
            while len(rest) < k - delivered:  # the pipe is left empty, whatever happens to the bytes
                rest += os.read(r, k - delivered - len(rest))
            queued = bool(rest) and conn is not None and not gone
            if queued:
                conn.pending.append(memoryview(rest))
        credit = k if gone else delivered
        if credit:
            with self.door.lock:
                self.door.send_raw(self.door.session.consumed(sid, credit))
        if queued:
            self.wake()

    def data(self, sid, data):
        """Bytes from the host: written to the client at once when nothing is queued before them (no thread
        handoff on the fast path), queued for the selector thread otherwise: copied once (the reader's buffer is
        reused), sent from that copy without another."""
        sent = 0
        with self.lock:
            conn = self.conns.get(sid)
            if conn is None:
                return
            if not conn.pending:
                try:
                    sent = conn.client.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    sent = len(data)  # the client is gone: drop it, keep the host's window honest
            if sent < len(data):
                conn.pending.append(memoryview(bytes(data[sent:])))
        if sent:
            with self.door.lock:
                self.door.send_raw(self.door.session.consumed(sid, sent))
        if sent < len(data):
            self.wake()

    def closed(self, sid):
        with self.lock:
            conn = self.conns.get(sid)
            if conn is not None:
                conn.host_closed = True
        self.wake()

    def wake(self):
        try:
            self.wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    # -- the selector thread ---------------------------------------------------------------------------------------
    def _loop(self):
        while True:
            self._arm()
            for key, mask in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    try:
                        while self.wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                else:
                    conn = key.data
                    if mask & selectors.EVENT_WRITE:
                        self._deliver(conn)
                    if mask & selectors.EVENT_READ:
                        self._pump(conn)

    def _arm(self):
        """Watch each client for reading only while its stream has window, for writing only while bytes wait."""
        with self.lock:
            conns = list(self.conns.values())
        for conn in conns:
            with self.lock:
                pending, done = bool(conn.pending), conn.host_closed and not conn.pending
            if done:
                self._finish(conn)
                continue
            events = 0
            if not conn.client_eof and self.door.session.may_send(conn.sid) > 0:
                events |= selectors.EVENT_READ
            if pending:
                events |= selectors.EVENT_WRITE
            try:
                if events:
                    self.selector.modify(conn.client, events, conn)
                else:
                    self.selector.unregister(conn.client)
            except KeyError:
                if events:
                    self.selector.register(conn.client, events, conn)
            except (ValueError, OSError):
                self._finish(conn)

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            with self.lock:
                full = len(self.conns) >= MAX_CONNECTIONS
            if full:
                try:
                    client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                   b"Connection: close\r\n\r\n")
                except OSError:
                    pass
                client.close()
                continue
            client.setblocking(False)
            try:  # room for a whole frame or more: most host bytes go straight out, no handoff to this thread
                client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            except OSError:
                pass
            with self.door.lock:
                sid = self.door.session.open()
                with self.lock:
                    self.conns[sid] = _Conn(sid, client)
                self.door.send_raw(p.encode_json(p.OPEN, sid, {"kind": self.kind}))
                self.door.send_raw(self.door.session.grant(sid, EXTRA_WINDOW))

    def _pump(self, conn):
        """Client -> host, within the stream's window."""
        with self.door.lock:
            room = min(self.door.session.may_send(conn.sid), READ_SIZE)
        if room <= 0:
            return
        try:
            chunk = conn.client.recv(room)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self.door.send_data(conn.sid, p.CH_BYTES, chunk)
            return
        conn.client_eof = True
        self.door.close(conn.sid, {})

    def _deliver(self, conn):
        """Host -> client, as much as the client takes now; credit goes back for what was delivered. The chunk
        being sent stays first in `pending` until it is all sent, so `data` queues behind it meanwhile."""
        delivered = 0
        while True:
            with self.lock:
                if not conn.pending:
                    break
                chunk = conn.pending[0]
            try:
                sent = conn.client.send(chunk)
            except BlockingIOError:
                break
            except OSError:
                sent = len(chunk)  # the client is gone: drop what it would have read, keep the host's window honest
            delivered += sent
            with self.lock:
                if sent < len(chunk):
                    conn.pending[0] = chunk[sent:]
                    break
                conn.pending.popleft()
        if delivered:
            with self.door.lock:
                self.door.send_raw(self.door.session.consumed(conn.sid, delivered))

    def _finish(self, conn):
        with self.lock:
            self.conns.pop(conn.sid, None)
        try:
            self.selector.unregister(conn.client)
        except (KeyError, ValueError, OSError):
            pass
        try:
            conn.client.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.client.close()
        if not conn.client_eof:
            self.door.close(conn.sid, {})
