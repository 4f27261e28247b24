"""The egress door on the host: every connection out of the box resolved, checked, signed, dialled and relayed here.

The box opens an egress stream per connection (guest/forwarder.py); its first bytes are a proxy request, parsed by
`proxy_request` (h11). The host name is checked (`hostnames`), resolved once on the host (the system resolver, or the
policy's `egress.nameservers` with dnspython), and the door states the whole answer to the signer; the box policy's
verdict (`Policy.decide`, which judges every address with `addresses.classify` and then the allow list) and the
signer's own always-deny rules make one signed decision. Only the address that was checked is dialled: there is no
second lookup, so a name cannot rebind between the check and the dial. A refusal is an HTTP 403 inside the box whose
body names the rule. When the connection ends, its bytes each way and its duration are signed.
"""

from __future__ import annotations

import ipaddress
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING

from tkbox_nb.guest import protocol as p
from tkbox_nb.stream.connection import Stream, StreamClosed
from tkbox_nb.stream.events import Data
from tkbox_nb.rules.addresses import classify, refused_name
from tkbox_nb.rules.hostnames import HostError, check_host
from tkbox_nb.rules.proxy_request import ProxyRequest, ProxyRequestError, ProxyRequestParser
from tkbox_nb.doors.door import Door
from tkbox_nb.doors.egress_env import egress_env, secrets_env
from tkbox_nb.doors.resolver import resolve
from tkbox_nb.doors.spliced import SplicePipe
from tkbox_nb.rules.door_table import EGRESS

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext

HEAD_TIMEOUT_S = 30.0
MAX_ADDRESSES = 32
MAX_BOUND_AT_ONCE = 16   # connections to bound hosts served at once: each may hold a request body of 16 MiB
BOUND_WAIT_S = 30.0      # how long one more waits for a slot before it is answered 503
IDLE_TIMEOUT_S = 600.0   # a relayed connection with no byte either way for this long is closed (its end signed)
REASONS = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 431: "Request Header Fields Too Large",
           502: "Bad Gateway", 503: "Service Unavailable"}


def stated_facts(req: ProxyRequest, policy, lookup) -> tuple[dict, str]:
    """What the door states to the signer for one request, and the one address it will dial. Pure but for
    `lookup(name, port)` (the resolver, called at most once; it raises OSError when the name does not resolve)."""
    facts: dict = {"port": req.port, "method": req.method, "tunnel": req.tunnel}
    if not req.tunnel:
        facts["path"] = req.target[:500]
    addresses: list[str] = []
    try:
        kind, value = check_host(req.host)
        facts["host"] = str(value)
        if kind == "ip":
            addresses = [str(value)]
        elif not refused_name(value) and policy.egress_allow_index(str(value), req.port) is not None:
            try:  # only a name on the allow list is ever looked up: a refused name leaks nothing through DNS
                addresses = lookup(value, req.port)
            except OSError as e:
                facts["resolve_error"] = f"{value} did not resolve: {getattr(e, 'strerror', None) or e}"[:300]
    except HostError as e:
        facts["host"], facts["host_error"] = req.host[:200], str(e)[:300]
    # every address is judged before the answer is cut to MAX_ADDRESSES: the refused ones are stated first, so one
    # refused address still refuses the whole answer however long it is (and the policy re-derives that from them)
    cidrs, rank = policy.allow_cidrs(), {"always": 0, "special": 1, "ok": 2}
    judged = {a: classify(ipaddress.ip_address(a), cidrs)[0] for a in set(addresses)}
    unique = sorted(judged, key=lambda a: (rank[judged[a]], ":" in a, a))
    if len(unique) > MAX_ADDRESSES:
        facts["addresses_dropped"] = len(unique) - MAX_ADDRESSES
    facts["addresses"] = unique = unique[:MAX_ADDRESSES]
    address = unique[0] if unique else ""
    facts["address"] = address
    classes = set(judged.values())
    refused = "host_error" not in facts and refused_name(facts["host"])
    facts["address_class"] = "always" if "always" in classes or refused else \
        "special" if "special" in classes else "ok"
    return facts, address


class EgressDoor(Door):
    name = "egress"

    def __init__(self, box: "DoorContext"):
        self.box = box
        # bounds what a box can make the host hold: the secrets door reads each request to a bound host whole
        # (intercept.MAX_REQUEST_BODY) before it swaps and checks it, so at most this many such bodies at once
        self.bound_slots = threading.BoundedSemaphore(MAX_BOUND_AT_ONCE)
        self.idle_timeout_s = IDLE_TIMEOUT_S
        self._open: dict[socket.socket, list] = {}   # relayed upstream -> [counts, bytes seen, when they last moved]
        self._open_changed = threading.Condition()
        self._reaper: threading.Thread | None = None
        self.connections = 0  # allowed in this run, stated in each next one ([egress] max_connections)
        self._connections_lock = threading.Lock()

    def env(self) -> dict[str, str]:  # the proxy settings, and with secrets bound the CA and placeholders
        return {**egress_env(), **secrets_env(self.box.bindings)}

    def start(self) -> None:  # each secret binding signed, before any connection (intercept.py)
        from tkbox_nb.doors.intercept import bind_secrets
        bind_secrets(self.box)

    def stop(self, reason: str, wait_s: float = 5.0) -> None:
        """At the box's stop: every relayed connection still open is shut, and its end signed (within `wait_s`)
        before the run closes, however idle its upstream keeps it."""
        with self._open_changed:
            self._stopped = reason  # a connection dialled before the stop but tracked after it is shut at once
            for upstream, (counts, _, _) in list(self._open.items()):
                self._shut(upstream, counts, reason)
            self._open_changed.wait_for(lambda: not self._open and not self._dialling, timeout=wait_s)

    @staticmethod
    def _shut(upstream: socket.socket, counts: dict, why: str) -> None:
        counts.setdefault("closed_by_door", why[:200])
        try:  # wakes the download (recv or splice gives the end), which signs the connection's end
            upstream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    _stopped: str | None = None
    _dialling = 0  # connections being dialled: tracked (or failed) when the dial ends

    def _track(self, upstream: socket.socket | None, counts: dict) -> None:
        """A dial's end: its connection (None: it failed) is tracked until its end is signed; one tracked after the
        door's stop is shut at once."""
        with self._open_changed:
            self._dialling -= 1
            self._open_changed.notify_all()
            if upstream is None:
                return
            self._open[upstream] = [counts, 0, time.monotonic()]
            if self._stopped is not None:
                self._shut(upstream, counts, self._stopped)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap_idle, daemon=True, name="tkbox-egress-idle")
                self._reaper.start()

    def _untrack(self, upstream: socket.socket) -> None:
        with self._open_changed:
            self._open.pop(upstream, None)
            self._open_changed.notify_all()

    def _reap_idle(self) -> None:
        """Shuts each relayed connection whose bytes have not moved either way for `idle_timeout_s`; ends when none
        is open (the next one starts it again), so an ended box leaves no thread behind."""
        while True:
            time.sleep(max(0.05, min(self.idle_timeout_s / 4, 5.0)))
            now = time.monotonic()
            with self._open_changed:
                if not self._open:
                    self._reaper = None
                    return
                for upstream, entry in list(self._open.items()):
                    counts, seen, since = entry
                    moved = counts["bytes_up"] + counts["bytes_down"]
                    if moved != seen:
                        entry[1], entry[2] = moved, now
                    elif now - since >= self.idle_timeout_s:
                        self._shut(upstream, counts, f"idle for {self.idle_timeout_s:g}s")

    def accept(self, stream: Stream, body: dict) -> bool:
        """Called by the door connection for each stream the box opens; True when it is an egress stream."""
        if body.get("kind") != "egress":
            return False
        threading.Thread(target=self._serve, args=(stream,), daemon=True, name="tkbox-egress").start()
        return True

    # -- one connection ------------------------------------------------------------------------------------------
    def _serve(self, stream: Stream) -> None:
        conn = self.box.conn
        crossing, relaying = None, False
        try:
            req = self._read_request(stream)
            if req is None:
                conn.close(stream.sid)
                return
            crossing, address = self._decide(req)
            if not crossing.allowed:
                rules = ", ".join(crossing.rule_ids) or "refused"
                why = crossing.verdict.reason or crossing.reason
                return self._answer(stream, 403, f"tkbox egress door: refused by {crossing.verdict.rule} "
                                                 f"({rules}): {why}\n")
            watch = None
            if self.box.bindings:
                from tkbox_nb.rules.secrets import PlaceholderWatch, bound_for, rewrite_request
                bound = bound_for(crossing.args["host"], self.box.bindings)
                if req.tunnel and bound:  # every binding goes along: another's placeholder here is a misuse too
                    relaying = True  # from here the relay signs the connection's end, whatever it ends on
                    return self._relay_bound(stream, req, crossing, address, self.box.bindings)
                if not req.tunnel:  # plain http: a placeholder here is never swapped, only flagged or refused
                    from tkbox_nb.doors.intercept import record_secret_crossings
                    watch = PlaceholderWatch(crossing.args["host"], self.box.bindings)  # the body, as it comes
                    rw = rewrite_request(crossing.args["host"], req.target.encode(), req.headers, self.box.bindings,
                                         tls=False)
                    rw.misuses += watch.feed(req.rest)
                    refused = record_secret_crossings(self.box, crossing.args["host"], self.box.bindings, rw,
                                                      tls=False)
                    if refused:
                        self.box.recorder.complete(crossing, "error", {"error": "refused by the secrets door"})
                        return self._answer(stream, 403, f"tkbox secrets door: refused: {refused}\n")
            relaying = True
            self._relay(stream, req, crossing, address, watch)
        except ProxyRequestError as e:
            self._answer(stream, e.status, f"tkbox egress door: {e}\n")
        except (StreamClosed, OSError):
            pass
        except p.ProtocolError as e:
            self.box.fail_closed(f"door protocol violation: {e}")
        except Exception as e:  # a fault of this door: this connection ends, answered, closed and signed
            self._failed(stream, crossing, relaying, e)

    def _failed(self, stream: Stream, crossing, relaying: bool, e: Exception) -> None:
        """An exception the door did not foresee: the box gets a 502 and its stream is closed (a thread that died
        left both open, and nothing signed). The error is signed (its type only: the door may have held a secret's
        value): as the end of the connection's crossing, or a refused one when none was decided yet."""
        why = f"the egress door failed on this connection ({type(e).__name__})"
        if relaying:  # the relay answered what it could and signed the end itself
            try:
                self.box.conn.close(stream.sid)
            except (StreamClosed, OSError):
                pass
            return
        self._answer(stream, 502, f"tkbox egress door: {why}\n")
        try:
            if crossing is None:
                crossing = self.box.recorder.decide(EGRESS, "connect", {
                    "host": "", "port": 0, "method": "", "tunnel": False, "addresses": [], "address": "",
                    "address_class": "ok", "host_error": why})
            if crossing.allowed:
                self.box.recorder.complete(crossing, "error", {"error": why})
        except Exception:  # a recorder that fails here has failed the box already (RunRecorder.broken)
            pass

    def _read_request(self, stream: Stream) -> ProxyRequest | None:
        parser = ProxyRequestParser()
        deadline = time.monotonic() + HEAD_TIMEOUT_S
        while True:
            try:
                event = stream.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ProxyRequestError(408, "no complete request within 30s") from None
            if not isinstance(event, Data):
                return None
            if event.channel != p.CH_BYTES:
                raise p.ProtocolError(f"egress data on channel {event.channel}")
            req = parser.feed(event.payload)
            if req is not None:
                if not req.tunnel:
                    req.upstream, req.framer = parser.upstream_head(req), parser
                return req

    def _decide(self, req: ProxyRequest):
        policy = self.box.policy
        facts, address = stated_facts(req, policy, lambda name, port: resolve(
            name, port, policy.get("egress", "nameservers"), policy.get("egress", "connect_timeout_s")))
        with self._connections_lock:  # one at a time, so each states the allowed ones signed before it (verify)
            facts["run_connections"] = self.connections
            crossing = self.box.recorder.decide(EGRESS, "connect", facts)
            self.connections += crossing.allowed
        if not crossing.allowed and self.box.recorder.broken:
            self.box.fail_closed(f"signer lost: {self.box.recorder.broken}")
        return crossing, address

    def _relay(self, stream: Stream, req: ProxyRequest, crossing, address: str, watch=None) -> None:
        """Dial the checked address and relay both ways; on plain HTTP with secrets bound, every byte the box sends
        after the head goes through `watch` first, and a refused placeholder ends the connection before it goes."""
        conn, sid = self.box.conn, stream.sid
        started = time.monotonic()
        with self._open_changed:
            self._dialling += 1  # the door's stop waits for this dial's end too
        try:
            upstream = socket.create_connection((address, req.port),
                                                timeout=self.box.policy.get("egress", "connect_timeout_s"))
        except Exception as e:  # OSError: unreachable; anything else a fault of the door, this connection's end
            if not isinstance(e, OSError):
                e = f"the egress door failed on this connection ({type(e).__name__})"
            try:
                self.box.recorder.complete(crossing, "error", {"error": f"connect to {address}:{req.port}: {e}"[:300]})
                return self._answer(stream, 502, f"tkbox egress door: cannot reach {req.host}:{req.port} ({e})\n")
            finally:
                self._track(None, {})
        upstream.settimeout(None)
        counts = {"bytes_up": 0, "bytes_down": 0}
        self._track(upstream, counts)
        refused: list[tuple[str, str]] = []  # (door, why), set by the upload thread when what the box sent is refused
        try:
            if req.tunnel:  # the box's bytes go up once its ClientHello names the CONNECT host (client_hello.py)
                from tkbox_nb.rules.client_hello import TunnelGate
                conn.send_data(sid, p.CH_BYTES, b"HTTP/1.1 200 Connection established\r\n\r\n")
                gate, pending = TunnelGate(crossing.args["host"]).feed, req.rest
            else:  # one request: its body framed again, and nothing after it (a pipelined request) goes up
                gate, pending = req.framer.body, b""
                upstream.sendall(req.upstream)
                counts["bytes_up"] += len(req.upstream)
            up = threading.Thread(target=self._box_to_upstream, args=(stream, upstream, counts, watch, refused,
                                                                      crossing.args["host"], gate, pending),
                                  daemon=True)
            up.start()
            pipe = None
            if SplicePipe.usable() and conn.can_splice():
                try:
                    pipe = SplicePipe()
                except OSError:  # out of file descriptors for a pipe: this connection copies instead
                    pipe = None
            if pipe is not None:
                self._download_spliced(sid, upstream, counts, pipe)
            else:
                buffer = memoryview(bytearray(p.MAX_PAYLOAD - 1))  # reused: each chunk is sent before the next recv
                while True:
                    n = upstream.recv_into(buffer)
                    if not n:
                        break
                    conn.send_data(sid, p.CH_BYTES, buffer[:n])
                    counts["bytes_down"] += n
            up.join(timeout=5)
        except (OSError, StreamClosed) as e:
            counts["error"] = str(e)[:200]
        except Exception as e:  # a fault of this door: the connection still ends signed
            counts["error"] = f"the egress door failed on this connection ({type(e).__name__})"
        finally:
            if refused:
                door, why = refused[0]
                counts["error"] = f"refused by the {door} door: {why}"[:300]
                if not counts["bytes_down"] and not req.tunnel:  # the upstream answered nothing: the box gets why
                    try:
                        conn.send_data(sid, p.CH_BYTES, _answer_bytes(403, f"tkbox {door} door: refused: {why}\n"))
                    except (OSError, StreamClosed):
                        pass
            if getattr(req.framer, "dropped", 0):
                counts["dropped_after_request"] = req.framer.dropped
            upstream.close()
            try:
                conn.close(sid)
            except (OSError, StreamClosed):
                pass
        try:
            self._signed_end(crossing, counts, started)
        finally:
            self._untrack(upstream)

    def _download_spliced(self, sid: int, upstream: socket.socket, counts: dict, pipe: SplicePipe) -> None:
        """Upstream -> box with splice (doors/spliced.py): the same DATA frames, no copy through Python."""
        conn = self.box.conn
        try:
            while True:
                n = pipe.fill(upstream.fileno(), conn.credit(sid))
                if not n:
                    break
                conn.send_spliced(sid, p.CH_BYTES, pipe, n)
                counts["bytes_down"] += n
        finally:
            pipe.close()

    def _relay_bound(self, stream: Stream, req: ProxyRequest, crossing, address: str, bindings) -> None:
        """A CONNECT to a host a secret is bound to: TLS terminated and re-originated (intercept.py)."""
        import ssl

        from tkbox_nb.doors.intercept import Closed, Refused, relay_bound
        from tkbox_nb.rules.secrets import error_text
        started, counts = time.monotonic(), {"bytes_up": 0, "bytes_down": 0, "intercepted": True}
        values = [b.value for b in bindings]  # an error on this path may quote a value (h11 names an illegal header)
        if not self.bound_slots.acquire(timeout=BOUND_WAIT_S):
            why = f"{MAX_BOUND_AT_ONCE} connections to bound hosts are being served; this one waited {BOUND_WAIT_S:g}s"
            self.box.recorder.complete(crossing, "error", {"error": why})
            return self._answer(stream, 503, f"tkbox secrets door: busy: {why}\n")
        try:
            relay_bound(self.box, stream, crossing.args["host"], req.port, address, req.rest, bindings, counts)
        except Refused as e:  # a request for another host, a response the scrubber cannot read
            counts["error"] = "refused by the secrets door: " + error_text(e, values).partition(": ")[2][:270]
        except (OSError, ssl.SSLError, Closed, StreamClosed) as e:
            counts["error"] = error_text(e, values)
            if not counts["bytes_up"] and isinstance(e, (ssl.SSLCertVerificationError, ConnectionError)):
                self._answer(stream, 502, f"tkbox egress door: {req.host}:{req.port}: {error_text(e, values)}\n")
        except Exception as e:  # h11 errors on either side end this connection only
            counts["error"] = error_text(e, values)
        finally:
            self.bound_slots.release()
            try:
                self.box.conn.close(stream.sid)
            except (OSError, StreamClosed):
                pass
        self._signed_end(crossing, counts, started)

    def _signed_end(self, crossing, counts: dict, started: float) -> None:
        """The connection's end, signed: bytes each way, duration, and the error if it ended on one."""
        self.box.recorder.complete(crossing, "ok" if "error" not in counts else "error",
                                   dict(counts, duration_ms=int((time.monotonic() - started) * 1000)))

    def _box_to_upstream(self, stream: Stream, upstream: socket.socket, counts: dict, watch, refused: list,
                         host: str, gate, pending: bytes) -> None:
        """Box -> upstream: each piece through `watch` (placeholders, plain HTTP) and then `gate` (a tunnel's
        ClientHello check, or a forwarded request's body framing), which says what of it may go now; a refusal by
        either ends the connection before the bytes go."""
        from tkbox_nb.rules.client_hello import HelloError
        data = pending
        while True:
            found = watch.feed(data) if watch is not None and data else []
            if found:  # signed before these bytes go; refused: they never do, and the connection ends
                from tkbox_nb.doors.intercept import record_secret_crossings
                from tkbox_nb.rules.secrets import Rewrite
                why = record_secret_crossings(self.box, host, self.box.bindings, Rewrite(headers=[], misuses=found),
                                              tls=False)
                if why:
                    return self._refuse_upload(upstream, refused, "secrets", why)
            try:
                data = gate(data)
            except (HelloError, ProxyRequestError) as e:
                return self._refuse_upload(upstream, refused, "egress", str(e)[:200])
            try:
                if data:
                    upstream.sendall(data)
            except OSError:
                break
            counts["bytes_up"] += len(data)
            event = stream.get()
            if not isinstance(event, Data) or event.channel != p.CH_BYTES:
                break
            data = event.payload
        try:
            upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _refuse_upload(upstream: socket.socket, refused: list, door: str, why: str) -> None:
        refused.append((door, why))
        try:  # wakes the download; the upstream sees no end of what the box sent, so it never answers it
            upstream.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def _answer(self, stream: Stream, status: int, body: str) -> None:
        try:
            self.box.conn.send_data(stream.sid, p.CH_BYTES, _answer_bytes(status, body))
            self.box.conn.close(stream.sid)
        except (StreamClosed, OSError):
            pass


def _answer_bytes(status: int, body: str) -> bytes:
    """A whole HTTP/1.1 answer from the door to the box (the connection closes after it)."""
    data = body.encode("utf-8", "replace")
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    return head + data
