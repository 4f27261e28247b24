"""The in-box Jupyter kernel: a real ipykernel in the box, its messages carried over one door stream.

Imported only when the host opens a kernel stream, so the agent itself stays standard-library only: this part needs
ipykernel (and with it pyzmq) in the box's Python, as any notebook kernel does; the wire format is jsession.py's (not
jupyter_client's, whose import would compete with the kernel's own start). The kernel listens
on IPC sockets in the box's own /tmp with a key made here; the
host never learns it and never needs it, since it re-signs every message with the frontend's key after checking it.

On the stream, both ways, each message is one JSON object on channel 3 (protocol.encode_message):
    {"channel": "shell"|"control"|"stdin"|"iopub", "header", "parent_header", "metadata", "content", "buffers"}
with buffers base64. The bridge's own messages use channel "bridge": host -> box {"op": "interrupt"}; box -> host
{"event": "ready", "kernel_info": {...}} once the kernel answers on shell and iopub.
"""

import base64
import hmac
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import protocol as p

try:  # a VM under emulation imports ipykernel far slower: its backend sets a longer wait in the box's environment
    READY_TIMEOUT_S = min(max(float(os.environ.get("TKBOX_KERNEL_READY_S", "60")), 1.0), 3600.0)
except ValueError:
    READY_TIMEOUT_S = 60.0
CHANNELS = ("shell", "control", "stdin")
# run silently just before a cell the host numbered (p.COUNT_KEY): the kernel's count moves up to the frontend's n,
# and its In history gains an empty entry for each number the box never ran (a host-magic cell), so that In[n],
# Out[n], _n and _i<n> name the cell the notebook shows as [n]; never moved back. It runs in the user's namespace, so
# it names nothing a cell may have rebound (`from numpy import *` brings a `max`; a cell may set `len = None`): only
# `__import__`, which no star import exports, and the real builtins and shell reached through it. Everything it
# reads is read before anything changes, the count moves before the history is padded, and a jump of more than
# COUNT_MAX_JUMP numbers (a rerun's count comes from a bundle, hostile input) changes nothing at all: the box then
# keeps its own numbering rather than pad billions of entries
COUNT_MAX_JUMP = 10_000
MAX_EXECUTING = 10_000  # execute_requests tracked as running at most (past it, every cell gets its count setting)
SET_COUNT = ("(lambda b, ip, n: (lambda hs: 0 < n - ip.execution_count <= %d and [b.setattr(ip, 'execution_count', n)] "
             "and [h.extend([''] * b.min(n - b.len(h), %d)) for h in hs])("
             "(ip.history_manager.input_hist_parsed, ip.history_manager.input_hist_raw)))"
             "(__import__('builtins'), __import__('IPython').get_ipython(), %%d)") % (COUNT_MAX_JUMP, COUNT_MAX_JUMP)
BATCH_BYTES = 256 * 1024  # messages joined into one door write at most (a larger one goes alone)


class KernelBridge:
    """One ipykernel process in the box and the sockets that talk to it; messages go to and from the door."""

    def __init__(self, door, sid):
        from .jsession import Session

        self.door, self.sid = door, sid
        self.session = Session(key=secrets.token_hex(32).encode(), username="box")
        # IPC sockets in a private directory of the box's own /tmp: no port to race for, no TCP at all
        self.sock_dir = tempfile.mkdtemp(prefix="tkbox-kernel-")
        ip = os.path.join(self.sock_dir, "k")
        conn = {"transport": "ipc", "ip": ip, "shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4,
                "hb_port": 5, "key": self.session.key.decode(), "signature_scheme": "hmac-sha256"}
        self.conn_path = os.path.join(self.sock_dir, "connection.json")
        with open(self.conn_path, "w") as f:
            json.dump(conn, f)
        env = dict(os.environ)
        env.pop("TKBOX_DOOR_FD", None)
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        cwd = "/workspace" if os.path.isdir("/workspace") else os.getcwd()
        from . import zygote  # a warm box's first kernel was started in its template (zygote.py)
        self.proc = zygote.take(env, cwd, self.conn_path) or subprocess.Popen(
            [sys.executable, "-m", "ipykernel_launcher", "-f", self.conn_path], env=env, cwd=cwd,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import zmq  # after the kernel's start: its imports go on while this one does

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sockets = {}
        for name, kind in (("shell", zmq.DEALER), ("control", zmq.DEALER), ("stdin", zmq.DEALER),
                           ("iopub", zmq.SUB)):
            s = self.ctx.socket(kind)
            s.linger = 0
            s.reconnect_ivl = 10  # the kernel binds its sockets after these connect: retry soon, not in 100 ms
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            else:  # one identity, as jupyter_client does: the kernel sends input_request to the shell's identity
                s.setsockopt(zmq.IDENTITY, self.session.bsession)
            if name == "stdin":
                # the kernel's stdin ROUTER drops an input_request for an identity it has not met yet, and the cell
                # then waits for its answer forever: the bridge is ready only once this socket's handshake is done
                self.stdin_monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            s.connect("ipc://%s-%d" % (ip, conn[name + "_port"]))
            self.sockets[name] = s
        self.inbox = self.ctx.socket(zmq.PULL)  # messages from the host, pushed by the agent's reader thread
        self.inbox.bind("inproc://tkbox-to-kernel")
        self.outbox_lock = threading.Lock()
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect("inproc://tkbox-to-kernel")
        # msg_ids of the bridge's own requests (readiness probes, a cell's count), each with what is still to come of
        # it ("reply" on shell, "idle" on iopub): all of it stays here, and the id is forgotten once none is left
        self.own = {}
        self.counting = {}  # msg_id of each count setting still to answer: (its number, the numbered cell's header)
        # the count the kernel gives its next stored cell, as its last execute_reply said (ipykernel starts at 1), and
        # the execute_requests passed on whose reply has not come: a cell whose number is that one, with none before
        # it still running, needs no count setting (one silent execute less per cell, about 2 ms of a round trip)
        self.next_count, self.executing = 1, set()
        self.ready = False
        self.stopped = False
        threading.Thread(target=self._loop, daemon=True, name="tkbox-kernel").start()

    # -- from the host -------------------------------------------------------------------------------------------
    def from_host(self, raw):
        """Called on the agent's reader thread with each message the host sent on this stream, as its JSON bytes:
        passed on as they are and parsed once, on the bridge's thread (not parsed, dumped and parsed again)."""
        with self.outbox_lock:
            self.outbox.send(raw)

    def _to_kernel(self, raw):
        try:
            msg = json.loads(raw.decode("utf-8"))
        except ValueError:  # the host sends JSON only; anything else is dropped, not a reason to end the kernel
            return
        channel = msg.get("channel") if isinstance(msg, dict) else None
        if channel == "bridge":
            if msg.get("op") == "interrupt" and self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGINT)
            return
        if channel not in CHANNELS:
            return
        buffers = [base64.b64decode(b) for b in msg.get("buffers") or []]
        out = {k: msg.get(k) or {} for k in ("header", "parent_header", "metadata", "content")}
        if channel == "shell" and isinstance(out["metadata"], dict) and p.COUNT_KEY in out["metadata"]:
            out["metadata"] = dict(out["metadata"])
            count = out["metadata"].pop(p.COUNT_KEY)
            if type(count) is int and 0 < count < 2 ** 31 and out["header"].get("msg_type") == "execute_request" \
                    and (count != self.next_count or self.executing):
                own = self._own_request("execute_request", {
                    "code": SET_COUNT % count, "silent": True, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": False}, ("reply", "idle"))
                self.counting[own] = (count, out["header"])
        if channel == "shell" and out["header"].get("msg_type") == "execute_request" \
                and isinstance(out["header"].get("msg_id"), str) and len(self.executing) < MAX_EXECUTING:
            self.executing.add(out["header"]["msg_id"])
        self.session.send(self.sockets[channel], out, buffers=buffers)

    def _replied(self, parts):
        """An execute_reply on its way to the host: its request is no longer running, and the kernel's next stored
        cell takes the number after the one it gives (ipykernel: its count less one; an aborted one gives none)."""
        try:
            parent = json.loads(parts[1].decode("utf-8")).get("msg_id")
            count = json.loads(parts[3].decode("utf-8")).get("execution_count")
        except (ValueError, AttributeError):
            return
        self.executing.discard(parent)
        if type(count) is int and 0 <= count < 2 ** 31:
            self.next_count = count + 1

    # -- to the host ---------------------------------------------------------------------------------------------
    def _to_host(self, channel, msg):
        body = {"channel": channel, "header": msg["header"], "parent_header": msg["parent_header"],
                "metadata": msg["metadata"], "content": msg["content"],
                "buffers": [base64.b64encode(bytes(b)).decode() for b in msg.get("buffers") or []]}
        data = json.dumps(body, separators=(",", ":")).encode("utf-8")
        self.door.send_data(self.sid, p.CH_MSG, p.MSG_HEADER.pack(len(data)) + data)

    def _pass_raw(self, channel, frames, out):
        """One message from the kernel to the host without parsing it here: its signature is checked, and its four
        JSON parts are spliced into the door message as they are (the host parses and checks every one). The
        message's bytes are appended to `out`, which the loop sends when it has taken every message waiting; the
        count of them is returned (0 for a message dropped here)."""
        try:
            _, msg_list = self.session.feed_identities(frames)
        except ValueError:
            return 0
        if len(msg_list) < 5:
            return 0
        signature, parts, buffers = msg_list[0], msg_list[1:5], msg_list[5:]
        if not hmac.compare_digest(signature, self.session.sign(parts)):
            return 0
        if self.own and self._is_own(channel, parts):
            if channel == "shell" and self.counting:
                self._count_failed(parts, out)
            return 0
        if channel == "shell" and b"execute_reply" in parts[0]:
            self._replied(parts)
        data = (b'{"channel":"', channel.encode(), b'","header":', parts[0], b',"parent_header":', parts[1],
                b',"metadata":', parts[2], b',"content":', parts[3], b',"buffers":[',
                b",".join(b'"' + base64.b64encode(bytes(b)) + b'"' for b in buffers), b"]}")
        size = sum(len(d) for d in data)
        out.append(p.MSG_HEADER.pack(size))
        out.extend(data)
        return size

    def _count_failed(self, parts, out):
        """The reply to a count setting: when it failed (a cell rebound `__import__`), a line on the numbered cell's
        stderr says so, ahead of that cell's own reply (the same socket, in order), so the cell shows it; the setter
        changed nothing (SET_COUNT reads everything before it changes anything)."""
        try:
            parent = json.loads(parts[1].decode("utf-8")).get("msg_id")
            content = json.loads(parts[3].decode("utf-8"))
        except (ValueError, AttributeError):
            return
        n, header = self.counting.pop(parent, (None, None))
        if header is None or not isinstance(content, dict) or content.get("status") == "ok":
            return
        why = ("%s: %s" % (content.get("ename"), content.get("evalue")))[:200]
        msg = self.session.msg("stream", {"name": "stderr", "text": (
            "tkbox: the box could not number this cell [%d] (%s); In, Out and _n in the box keep its own numbers "
            "(a cell that rebinds __import__ or __builtins__ stops the numbering)\n" % (n, why))}, parent=header)
        data = json.dumps(dict(msg, channel="iopub", buffers=[]), separators=(",", ":")).encode("utf-8")
        out.extend((p.MSG_HEADER.pack(len(data)), data))

    def _drain(self, sock, channel, out):
        """Every message already waiting on a kernel socket, into `out`: a cell's last messages (its reply on shell,
        its idle status on iopub) come together, and go to the host in one write, one VM exit, one wake-up of the
        host's reader. Only what is there is taken; nothing waits for more. At most BATCH_BYTES at a time."""
        zmq = self.zmq
        frames, size = sock.recv_multipart(copy=True), 0
        while True:
            size += self._pass_raw(channel, frames, out)
            if size > BATCH_BYTES:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return

    def _is_own(self, channel, parts):
        """An answer to one of the bridge's own requests (a late one to a readiness probe, sent every 50 ms until the
        kernel answered; what a cell's count setting made): it stays here, so the frontend never sees a status or a
        reply for a request it did not make."""
        try:
            parent = json.loads(parts[1].decode("utf-8")).get("msg_id")
        except (ValueError, AttributeError):
            return False
        return self._own_answer(parent, channel, channel == "iopub" and b'"idle"' in parts[3])

    def _own_answer(self, parent, channel, idle):
        """Whether a message under `parent` answers one of the bridge's own requests; the request is forgotten once
        what was still to come of it (its idle status, its reply) has come, in whichever order the sockets give."""
        left = self.own.get(parent)
        if left is None:
            return False
        if idle or channel == "shell":
            left.discard("idle" if idle else "reply")
            if not left:
                del self.own[parent]
        return True

    def _own_request(self, msg_type, content, waits):
        msg = self.session.msg(msg_type, content)
        self.own[msg["header"]["msg_id"]] = set(waits)
        self.session.send(self.sockets["shell"], msg)
        return msg["header"]["msg_id"]

    def _probe(self):
        self._own_request("kernel_info_request", {}, ("idle",))

    def _maybe_ready(self, info, iopub_seen, stdin_met):
        """Ready when the kernel answered on shell, published on iopub, and has met the stdin socket."""
        if not self.ready and info is not None and iopub_seen and stdin_met:
            self.ready = True
            self._to_host("bridge", {"header": {"msg_type": "ready"}, "parent_header": {}, "metadata": {},
                                     "content": info})

    def _loop(self):
        zmq = self.zmq
        poller = zmq.Poller()
        for s in list(self.sockets.values()) + [self.inbox, self.stdin_monitor]:
            poller.register(s, zmq.POLLIN)
        names = {s: n for n, s in self.sockets.items()}
        info, iopub_seen, stdin_met, next_probe = None, False, False, 0.0
        started = time.monotonic()
        try:
            while not self.stopped:
                if not self.ready:
                    now = time.monotonic()
                    if now - started > READY_TIMEOUT_S:
                        raise RuntimeError("the kernel did not answer within %ds" % READY_TIMEOUT_S)
                    if now >= next_probe:
                        self._probe()
                        next_probe = now + 0.05
                if self.proc.poll() is not None:
                    raise RuntimeError("the kernel exited with status %s" % self.proc.returncode)
                out = []
                for sock, _ in poller.poll(200):
                    if sock is self.inbox:
                        self._to_kernel(sock.recv())
                        continue
                    if sock is self.stdin_monitor:
                        sock.recv_multipart()
                        stdin_met = True
                        self._maybe_ready(info, iopub_seen, stdin_met)
                        continue
                    name = names[sock]
                    if self.ready:  # the fast path: the kernel's own JSON goes on as it is, once its HMAC checks
                        self._drain(sock, name, out)
                        continue
                    frames = sock.recv_multipart(copy=True)
                    try:
                        _, msg_list = self.session.feed_identities(frames)
                        msg = self.session.deserialize(msg_list)
                    except Exception:  # not the kernel's: nothing else speaks on these sockets, drop it
                        continue
                    parent = msg["parent_header"].get("msg_id")
                    if self._own_answer(parent, name, name == "iopub"
                                        and msg["content"].get("execution_state") == "idle"):
                        if msg["header"]["msg_type"] == "kernel_info_reply":
                            info = msg["content"]
                        elif name == "iopub":
                            iopub_seen = True
                        self._maybe_ready(info, iopub_seen, stdin_met)
                        continue
                    if name == "iopub" and msg["header"]["msg_type"] == "stream" and not parent:
                        continue  # the kernel's own start on its stderr (debugpy's warnings): no cell's output
                    if name == "iopub" and msg["header"]["msg_type"] == "iopub_welcome":
                        iopub_seen = True  # subscribed: the kernel's iopub reaches the bridge from now on
                        self._maybe_ready(info, iopub_seen, stdin_met)
                        continue
                    self._to_host(name, msg)
                if out:
                    self.door.send_data(self.sid, p.CH_MSG, b"".join(out))
            reason = {"exit_code": 0}
        except Exception as e:
            reason = {"error": str(e)[:500], "exit_code": self.proc.poll()}
        self.stop()
        with self.door.lock:
            self.door.send_raw(self.door.session.close(self.sid, reason))

    def stop(self):
        self.stopped = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        import shutil
        shutil.rmtree(self.sock_dir, ignore_errors=True)
