"""Several connections to one signed run, so that crossings ready at the same time share the signer's fsync.

Why lanes (read in tracekit 1.4.2, docs/bundle-format.md#concurrent-crossings has the measurements):
- the signer already commits in groups: its one writer thread takes every request queued at that moment (up to
  512), signs each record and appends them with one fsync (tracekit/signer/pipeline.py, `RecordLog._loop`), and
  answers each only once that batch is durable (ack-on-fsync);
- but its Unix transport answers one connection's frames strictly one after another (read, handle, write: the next
  frame is not read before the answer is written; tracekit/transport/__init__.py `serve`), so pipelining several
  requests on one connection still puts them to the writer one at a time;
- and its client sends a run's events one at a time per stream, each once the one before it is answered
  (tracekit/sdk/client.py `Client._turn`).
So one connection never has two records in a batch, and every crossing pays its own fsync. Concurrency has to come
from several connections: one per lane (to the machine signer a `DirectClient` below; to the central one, over HTTPS,
a Tracekit `Client`, the first being the one that registered the run), each lane a Tracekit *stream* of its own,
all writing the one run (a run takes up to `streams_per_run` streams, 64 by default; a lane is opened only when every
open one is busy, so a box that crosses one door at a time keeps one connection).

Each lane carries one call at a time, and fills in its stream's `client_seq` itself (which also keeps the client's
per-run turn lock out of the way): the counter goes up by one per event in the order the signer receives them, which
is all the signer checks (per stream). A call that fails leaves its lane closed; the recorder breaks on any failure
anyway (fail closed). `tails()` gives every stream's last `client_seq` for close_run, so an event that never reached
the signer on any lane becomes its signed `client_counter_gap`, as it would with one connection.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import warnings
from typing import Any, Callable

from tkbox_nb.core.errors import SignerError

LIMIT = 16  # lanes per run: 16 crossings in flight fill a batch well past the point where fsync stops dominating
GROW_BACKOFF_S = 1.0


def _fields(method: str) -> tuple[bool, bool]:
    """(takes a run token, is an event with stream and client_seq) for a per-run RPC, from Tracekit's contract."""
    from tracekit.signer.rpc_schema import REQUESTS
    props = REQUESTS[method]["properties"]
    return "run_token" in props, "client_seq" in props


class DirectClient:
    """One lane's connection to a signer on a Unix socket: one call at a time, sent and answered on the calling thread.

    Tracekit's `Client` pipelines any number of threads' calls over one connection, so each call goes through its
    writer thread and comes back through its reader thread and a Future: three threads and their hand-offs for every
    call. A lane never has two calls in flight, so it needs none of that; in the box's process those hand-offs cost
    as much CPU as the rest of the crossing and compete with the signer for the same cores. This speaks the same
    frames on the same socket with Tracekit's own pieces: `connect` (its `hello` and protocol check), the signer's
    frame limit, `read_frame`; a `request_id` per state-changing call, and a call whose connection drops is sent again
    with the same id on a new one (as Tracekit's client does; the signer answers a repeated id with its first answer).
    The signer checks every frame itself: nothing here is trusted more than the Tracekit client was."""

    RETRIES = 3

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout = path, timeout
        self._sock = self._rfile = None
        self._closed = False
        self._timeout: float | None = None  # the timeout the socket has now
        self.hello: dict | None = None

    def _connect(self) -> None:
        from tracekit.sdk.client import connect
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a signer of another Tracekit version: its hello says so, as before
            self._sock, self._rfile, self.hello = connect(self.path)

    def call(self, method: str, req: dict) -> dict:
        from tracekit.sdk.client import SignerUnavailable
        from tracekit.signer.quotas import MAX_LINE
        from tracekit.signer.rpc_schema import REQUESTS, RPCError
        from tracekit.transport import read_frame
        if "request_id" in REQUESTS[method]["properties"] and "request_id" not in req:
            req = dict(req, request_id=uuid.uuid4().hex)
        try:
            data = json.dumps({"method": method, **req}, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        except (TypeError, ValueError) as e:
            raise RPCError("invalid_request", f"the {method} request is not JSON: {e}") from None
        if len(data) > MAX_LINE + 1:
            raise RPCError("quota_exceeded", f"the {method} request is {len(data) - 1} bytes, over the signer's limit")
        lost = None
        for _ in range(self.RETRIES):
            if self._closed:  # closed under a call in flight: never connect again
                raise SignerUnavailable("the lane is closed")
            try:
                if self._sock is None:
                    self._connect()
                    self._timeout = None
                if self._timeout != self.timeout:
                    self._timeout = self.timeout
                    self._sock.settimeout(self._timeout)
                self._sock.sendall(data)
                reply = read_frame(self._rfile)
            except TimeoutError:
                self.close()  # its answer may still come: this connection can never be read in step again
                raise SignerUnavailable(f"no answer from the signer within {self.timeout:g}s") from None
            except (OSError, RPCError) as e:  # the connection dropped (or its answer did not frame): send it again
                lost, reply = e, None
            if reply is None:
                self._drop()
                lost = lost or "the signer closed the connection"
                continue
            if "error" in reply:
                e = reply["error"]
                raise RPCError(e.get("code"), e.get("message", ""), e.get("retry_after_ms"))
            return reply
        raise SignerUnavailable(f"lost the connection to the signer {self.RETRIES} times (last: {lost})")

    def status(self, req: dict) -> dict:
        return self.call("status", req)

    def close(self) -> None:
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        sock, self._sock, self._rfile = self._sock, None, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class _Lane:
    def __init__(self, client):
        self.client = client
        self.stream = uuid.uuid4().hex
        self.next_seq = 0  # the next client_seq of this stream
        self.dead = False


class RunLanes:
    """Calls on one run (`run_id`, `run_token`) over up to `limit` connections made by `make_client()`. `first`: a
    client already connected (the one that registered the run), used as the first lane."""

    def __init__(self, make_client: Callable[[], Any], run_id: str, run_token: str, first=None,
                 limit: int = LIMIT):
        self.make_client = make_client
        self.run_id, self.run_token = run_id, run_token
        self.limit = max(1, limit)
        self._cond = threading.Condition()
        self._lanes: list[_Lane] = []
        self._idle: list[_Lane] = []
        self._opening = 0
        self._grow_after = 0.0  # after a connect that failed, no new lane before this (monotonic) time
        self._closed = False
        self.timeout: float | None = None  # seconds per call; None: each client's own
        if first is not None:
            lane = _Lane(first)
            self._lanes.append(lane)
            self._idle.append(lane)

    def call(self, method: str, **fields: Any) -> dict:
        """One per-run RPC on a free lane; raises what the Tracekit client raises (RPCError, SignerUnavailable) or
        SignerError when no lane frees up within the call timeout."""
        token, event = _fields(method)
        req = {"run_id": self.run_id, **({"run_token": self.run_token} if token else {}), **fields}
        lane = self._take()
        ok = False
        try:
            if event:
                req.update(stream=lane.stream, client_seq=lane.next_seq)
                lane.next_seq += 1  # used up even if the call fails: close_run then names it as a gap
            if self.timeout is not None:
                lane.client.timeout = self.timeout
            reply = lane.client.call(method, req)
            ok = True
            return reply
        finally:
            self._give(lane, ok)

    def tails(self) -> list[dict]:
        """The last client_seq each lane's stream used (lanes that sent no event are left out), for close_run."""
        with self._cond:
            return [{"stream": lane.stream, "client_seq": lane.next_seq - 1} for lane in self._lanes
                    if lane.next_seq > 0][-64:]

    @property
    def opened(self) -> int:
        """How many connections this run has used so far (for tests and status lines)."""
        with self._cond:
            return len(self._lanes)

    def _live(self) -> int:
        return sum(not lane.dead for lane in self._lanes)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            lanes, self._idle = list(self._lanes), []
            self._cond.notify_all()
        for lane in lanes:
            try:
                lane.client.close()
            except Exception:
                pass

    # -- the pool ------------------------------------------------------------------------------------------------
    def _take(self) -> _Lane:
        """An idle lane; else a new one when under the limit; else the next lane another call gives back."""
        wait = (self.timeout or 30.0) + 5.0
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        raise SignerError("the run's connections are closed")
                    if self._idle:
                        return self._idle.pop()
                    # one lane opens at a time: the signer's listen backlog is small (socketserver's 5), and a burst
                    # of connects past it is refused (EAGAIN) rather than queued
                    if not self._opening and self._live() < self.limit and time.monotonic() >= self._grow_after:
                        self._opening = 1
                        break
                    if not self._cond.wait(wait):
                        raise SignerError(f"no connection to the signer came free within {wait:g}s")
            lane = self._open()
            if lane is not None:
                return lane

    def _open(self) -> _Lane | None:
        """A new lane, connected now (a `status` call, which writes nothing) so that a refused connect costs no
        crossing: None when it could not connect and other lanes are open (the caller waits for one of those)."""
        client = None
        try:
            client = self.make_client()
            if self.timeout is not None:
                client.timeout = self.timeout
            client.status({})
        except Exception as e:
            if client is not None:
                try:
                    client.close()
                except Exception:
                    pass
            with self._cond:
                self._opening = 0
                self._grow_after = time.monotonic() + GROW_BACKOFF_S
                live = self._live()
                self._cond.notify_all()
            if live == 0:
                raise SignerError(f"cannot connect to the signer: {e}") from None
            return None
        with self._cond:
            self._opening = 0
            if self._closed:
                client.close()
                raise SignerError("the run's connections are closed")
            lane = _Lane(client)
            self._lanes.append(lane)
            self._cond.notify_all()
        return lane

    def _give(self, lane: _Lane, ok: bool) -> None:
        with self._cond:
            if ok and not self._closed:
                self._idle.append(lane)
            else:
                lane.dead = True
            self._cond.notify()
        if not ok:  # a lane whose call failed is not reused: its connection's state is unknown
            try:
                lane.client.close()
            except Exception:
                pass


def together(fn: Callable[[Any], Any], items: list, limit: int = LIMIT) -> list:
    """`fn` of each item, up to `limit` at once (the lanes a run may open), results in the order of `items`: for
    crossings ready together (RunRecorder.decide_many / complete_many). Threads that each take the next item, not a
    ThreadPoolExecutor: its Future and wake-ups per item cost the box's process about 0.07 ms of CPU a crossing (10%
    of its side, on the cores the signer needs). An exception stops further items and is raised once the items in
    flight are done."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    out: list = [None] * len(items)
    todo = iter(enumerate(items))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            with lock:
                nxt = next(todo, None)
            if nxt is None:
                return
            try:
                out[nxt[0]] = fn(nxt[1])
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                failed.append(e)

    threads = [threading.Thread(target=work, name=f"tkbox-crossing-{i}", daemon=True)
               for i in range(min(max(1, limit), len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return out


def lanes_for(signer, run_id: str, run_token: str, client) -> RunLanes:
    """The lanes of a run that `client` registered or adopted. Where the signer has a lane client of its own (the
    machine signer's Unix socket, lanes.DirectClient) every lane uses one and `client` is closed; else (the
    central signer, over HTTPS) lanes are Tracekit clients and `client` is the first."""
    if hasattr(signer, "lane_client"):
        client.close()
        return RunLanes(signer.lane_client, run_id, run_token)
    return RunLanes(signer.client, run_id, run_token, first=client)
