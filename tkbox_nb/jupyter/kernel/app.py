"""The Tracekit Box kernel: a Jupyter kernel on the host whose cells run in a box, through the exec door.

To the frontend (JupyterLab, Notebook 7, VS Code, nbclient) this is a kernel like any other: it binds the five
sockets of its connection file and signs with the frontend's key. Behind it is the notebook's box and, in the box, a
real ipykernel (guest/kernel.py); messages pass through the door stream, and every one from the box has been checked
(jupyter_messages) before it is re-signed here with the frontend's key, which the box never learns.

What happens to each request from the frontend:
- execute_request: one at a time, in order (cells.py); host-side magics (notebook_box) are done here; any other code
  is decided by the exec door (signed) before it reaches the box, and its outputs are signed when it ends. A refusal
  is shown as an error. The execution count the frontend sees is the host's (cells.py), whoever answers the cell.
- input_reply: to the box only when it answers the box's own pending prompt, never the host's (stdin.py).
- comm_open / comm_msg / comm_close (widgets): decided by the exec door (kind "comm"), then forwarded (comms.py).
- complete, inspect, is_complete, history, comm_info: forwarded to the box's kernel (answered here while no box runs).
- kernel_info: answered here. interrupt: SIGINT to the box's kernel (the box goes on); a cell still waiting for the
  box to start ends, not run (box_wait.py). shutdown: the box stops and its bundle is written, then the process
  exits; a restart is a new process, so a new box and a new run.

The box and its kernel start in the background as this kernel starts (kernel/__main__.py, NotebookBox.start_early),
so the first cell does not wait for them; a first cell that changes the policy or binds a secret gets a box started
for it instead. Every box start runs in the background, and a cell waits for it in box_wait.py, so the control
channel is answered meanwhile. A box that breaks the protocol is ended; the cell shows why, and the next cell starts
a fresh box (a new run). A cell is `busy` from the moment it is taken (the box's own `busy` for it is not forwarded).
Every message from the box is forwarded rebuilt (relay.py): a header made here, the frontend's own request as parent;
every message into the box goes under a header made here too, so the box names only what it was sent, and what it
sends under any other parent is dropped and counted (doors/cell.py). The host's own notices carry a mark no output of
the box can (relay.host_notice). The helpers (cells, comms, stdin, box_wait) keep their own state and reach this kernel
only through KernelPort (port.py): its public members, nothing private, no field of it assigned.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import traceback
import uuid
from typing import Any

import zmq

from tkbox_nb._version import __version__
from tkbox_nb.rules.jupyter_messages import BoxMessage
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.guest.jsession import Session
from tkbox_nb.box.notebook_box import NotebookBox
from tkbox_nb.doors.cell import BoxKernel
from tkbox_nb.jupyter.kernel.cells import Cells
from tkbox_nb.jupyter.kernel.comms import CommGate
from tkbox_nb.jupyter.kernel.relay import Parents, host_notice, rebuilt, unevaluated
from tkbox_nb.jupyter.kernel.stdin import Stdin

PROTOCOL_VERSION = "5.3"
FORWARDED = {"complete_request", "inspect_request", "is_complete_request", "history_request", "comm_info_request"}
COMMS = {"comm_open", "comm_msg", "comm_close"}


def _url(info: dict, port_name: str) -> str:
    if info.get("transport", "tcp") == "ipc":
        return f"ipc://{info['ip']}-{info[port_name]}"
    return f"tcp://{info['ip']}:{info[port_name]}"


class TkboxKernel:
    def __init__(self, connection_file: str, nb: NotebookBox | None = None):
        with open(connection_file) as f:
            info = json.load(f)
        # the wire format without jupyter_client, whose import (0.15 s) would slow the start (guest/jsession.py)
        self.session = Session(info["key"].encode(), username="tkbox",
                               signature_scheme=info.get("signature_scheme") or "hmac-sha256")
        self.ctx = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}
        # iopub is an XPUB, as ipykernel's: a frontend's subscription is seen, and answered with `iopub_welcome`
        # (JEP 65), so a client that waits for iopub to be connected does not time out on a PUB's lost first status
        for name, kind in (("shell", zmq.ROUTER), ("control", zmq.ROUTER), ("stdin", zmq.ROUTER),
                           ("iopub", zmq.XPUB)):
            s = self.ctx.socket(kind)
            s.linger = 1000
            s.bind(_url(info, name + "_port"))
            self.sockets[name] = s
        self._hb_url = _url(info, "hb_port")
        threading.Thread(target=self._heartbeat, daemon=True, name="tkbox-hb").start()
        self.wake_url = f"inproc://tkbox-wake-{uuid.uuid4().hex}"
        self.wake = self.ctx.socket(zmq.PULL)
        self.wake.bind(self.wake_url)
        self._wake_local = threading.local()
        self.from_box: queue.Queue = queue.Queue()
        self.nb = nb or NotebookBox.for_kernel()
        # the helpers reach the kernel only through KernelPort (port.py); each keeps its own state
        self.stdin = Stdin(self)  # the host's prompt (%box_secret) and the box's, kept apart
        self.comms = CommGate(self)  # comms both ways: the box's ids are BoxKernel.comms, the host's comms.host
        self.comms.host.install()  # the `comm` package's manager in this process: widgets of the run view
        self.cells = Cells(self, self.comms, self.stdin)  # execute requests, one at a time, in order; host magics
        self.parents = Parents()  # what went into the box, under ids made here -> the frontend's headers
        # requests open in the box, by the msg_id the host sent each under -> (socket, idents, the frontend's header)
        self.requests: dict[str, tuple[str, list[bytes], dict]] = {}
        self.running = True
        self.welcomed = False  # an iopub subscription has been answered
        self.box_kernel: BoxKernel | None = None  # the box's kernel whose messages are relayed
        self._iopub_lock = threading.Lock()  # host widgets publish from other threads (the view's Verify)
        self.box_violated = False  # set when the box broke the protocol here: it is ended, its messages dropped

    # -- plumbing ------------------------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        hb = self.ctx.socket(zmq.REP)
        hb.linger = 0
        hb.bind(self._hb_url)
        try:
            while True:
                hb.send(hb.recv())
        except zmq.ZMQError:
            return

    def _on_box_message(self, msg: BoxMessage | None) -> None:
        """Called on the box reader thread: hand the message to the main loop."""
        self.from_box.put(msg)
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._wake_local.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(self.wake_url)
        sock.send(b"")

    def send(self, channel: str, msg_type: str, content: dict, parent: dict | None, idents=None,
             metadata: dict | None = None, buffers: list | None = None) -> dict:
        if channel == "iopub":
            with self._iopub_lock:
                return self.session.send(self.sockets[channel], msg_type, content, parent=parent, metadata=metadata,
                                         buffers=buffers)
        return self.session.send(self.sockets[channel], msg_type, content, parent=parent, ident=idents,
                                 metadata=metadata)

    def publish_status(self, state: str, parent: dict | None) -> None:
        self.send("iopub", "status", {"execution_state": state}, parent)

    # -- main loop -----------------------------------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        for name in ("shell", "control", "stdin"):
            poller.register(self.sockets[name], zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        self.publish_status("starting", None)
        while self.running:
            self._welcome()
            # until a frontend has subscribed, look for its subscription often (it comes on iopub, which is not
            # polled here: other threads publish on it, under the lock)
            for sock, _ in poller.poll(500 if self.welcomed else 10):
                if sock is self.wake:
                    sock.recv()
                    self._drain_box()
                    continue
                name = next(n for n, s in self.sockets.items() if s is sock)
                if (got := self.receive(name)) is None:  # malformed, or a bad signature: not from our frontend
                    continue
                idents, msg = got
                try:
                    self._dispatch(name, idents, msg)
                except Exception as e:  # a bug of ours must not take the notebook down
                    self.log(f"error handling {msg['header'].get('msg_type')}: {e}\n{traceback.format_exc()}")
            self.cells.pump()  # the next queued cell, once the one before it has ended
            self.check_deadlines()
        self.close()

    def ready(self, channels, timeout_ms: float) -> set[str]:
        poller = zmq.Poller()
        for name in channels:
            poller.register(self.sockets[name], zmq.POLLIN)
        got = dict(poller.poll(timeout_ms))
        return {name for name in channels if self.sockets[name] in got}

    def receive(self, channel: str) -> tuple[list[bytes], dict] | None:
        """The next message on a frontend channel, and its identities; None if malformed or badly signed."""
        try:
            idents, msg_list = self.session.feed_identities(self.sockets[channel].recv_multipart(copy=True))
            return idents, self.session.deserialize(msg_list)
        except Exception:
            return None

    def _welcome(self) -> None:
        """Answer each new iopub subscription with `iopub_welcome`, as ipykernel does."""
        iopub = self.sockets["iopub"]
        with self._iopub_lock:
            while True:
                try:
                    frame = iopub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                if frame[:1] == b"\x01":
                    self.welcomed = True
                    self.session.send(iopub, "iopub_welcome", {"subscription": frame[1:].decode("utf-8", "replace")})

    def serve_control(self) -> str | None:
        """A control message while a cell waits on the host (its box starting, the host's prompt): an interrupt is
        answered here, with nothing to signal (no cell runs in the box meanwhile); any other is handled as ever."""
        if (got := self.receive("control")) is None:  # malformed, or a bad signature: not from our frontend
            return None
        idents, msg = got
        if (t := msg["header"]["msg_type"]) == "interrupt_request":
            self.send("control", "interrupt_reply", {"status": "ok"}, msg["header"], idents)
        else:
            self._dispatch("control", idents, msg)
        return t

    def log(self, text: str) -> None:
        sys.stderr.write(f"[tkbox kernel] {text}\n")
        sys.stderr.flush()

    def _dispatch(self, channel: str, idents: list[bytes], msg: dict) -> None:
        header = msg["header"]
        t = header["msg_type"]
        if t == "kernel_info_request":
            self.publish_status("busy", header)
            self.send(channel, "kernel_info_reply", self.kernel_info(), header, idents)
            self.publish_status("idle", header)
        elif t == "shutdown_request":
            restart = bool(msg["content"].get("restart"))
            try:
                self.comms.end_run()
                self.nb.stop("kernel restart" if restart else "kernel shutdown")
            except Exception as e:  # the frontend waits for the reply: it gets it, and the kernel ends, whatever
                self.log(f"stopping the box at shutdown: {type(e).__name__}: {e}")
            self.send(channel, "shutdown_reply", {"status": "ok", "restart": restart}, header, idents)
            self.running = False
        elif t == "interrupt_request":
            if self.box_kernel is not None and not self.box_kernel.ended:
                self.box_kernel.interrupt()
            self.send(channel, "interrupt_reply", {"status": "ok"}, header, idents)
        elif t == "execute_request":
            self.cells.enqueue(channel, idents, msg)  # started by the main loop once the cell before has ended
        elif t in COMMS:
            self.comms.from_frontend(channel, msg)
        elif t in FORWARDED:
            if self.box_kernel is None or self.box_kernel.ended:
                self._answer_without_box(channel, idents, msg)
            else:
                sent = self.into_box(msg)  # the box never sees the frontend's header
                self.open_request(sent["header"]["msg_id"], channel, idents, header)
                self.box_kernel.send(channel, sent)
        elif t == "input_reply":
            self.stdin.from_frontend(msg)  # to the box only if it answers the box's own pending prompt

    def kernel_info(self) -> dict:
        info = (self.box_kernel.info if self.box_kernel is not None and self.box_kernel.info else {}) or {}
        language = info.get("language_info") or {
            "name": "python", "version": sys.version.split()[0], "mimetype": "text/x-python",
            "file_extension": ".py", "pygments_lexer": "ipython3", "codemirror_mode": {"name": "ipython", "version": 3},
            "nbconvert_exporter": "python"}
        return {"status": "ok", "protocol_version": PROTOCOL_VERSION, "implementation": "tkbox-nb",
                "implementation_version": __version__, "language_info": language,
                "banner": "Python 3 (Tracekit Box): every cell runs in a box, decided and signed",
                "help_links": [{"text": "tkbox-nb", "url": "https://pypi.org/project/tracekit-ai/"}]}

    # -- execute -------------------------------------------------------------------------------------------------
    def host_reply(self, channel, idents, header, status: str, silent: bool, error: tuple | None = None) -> None:
        content: dict[str, Any] = {"status": status, "execution_count": self.cells.number(header["msg_id"])}
        names = sorted(self.cells.asked.pop(header["msg_id"], frozenset()))
        if status == "ok":
            content.update(payload=[], user_expressions=unevaluated(names))
        else:
            content.update(ename=error[0], evalue=error[1], traceback=[f"{error[0]}: {error[1]}"])
            if not silent:
                self.send("iopub", "error", {"ename": error[0], "evalue": error[1],
                                             "traceback": [f"\x1b[0;31m{error[0]}\x1b[0m: {error[1]}"]}, header)
        self.send(channel, "execute_reply", content, header, idents)
        self.publish_status("idle", header)
        self.cells.replied(header["msg_id"], status, idle=True)

    def attach(self, box) -> BoxKernel:
        kernel = box.kernel()
        if kernel is not self.box_kernel:
            kernel.listeners.append(self._on_box_message)
            self.box_kernel = kernel
        return kernel

    def into_box(self, msg: dict, parent_header: dict | None = None, keep: bool = True) -> dict:
        return self.parents.into_box(msg, parent_header, keep)

    def open_request(self, sent_id: str, channel: str, idents: list[bytes], header: dict) -> None:
        self.requests[sent_id] = (channel, idents, header)

    def request_open(self, sent_id) -> bool:
        return sent_id in self.requests

    def protocol_violation(self, why: str) -> None:
        self.box_violated = True  # what the box sends until its end is seen is dropped (_drain_box)
        if self.nb.box is not None:
            self.nb.box.fail_closed(why)

    def _answer_without_box(self, channel: str, idents: list[bytes], msg: dict) -> None:
        header, t = msg["header"], msg["header"]["msg_type"]
        replies = {
            "complete_request": {"status": "ok", "matches": [], "cursor_start": msg["content"].get("cursor_pos", 0),
                                 "cursor_end": msg["content"].get("cursor_pos", 0), "metadata": {}},
            "inspect_request": {"status": "ok", "found": False, "data": {}, "metadata": {}},
            "is_complete_request": {"status": "unknown"},
            "history_request": {"status": "ok", "history": []},
            "comm_info_request": {"status": "ok", "comms": self.comms.host.info()},
        }
        self.send(channel, t.replace("_request", "_reply"), replies[t], header, idents)

    # -- from the box --------------------------------------------------------------------------------------------
    def _drain_box(self) -> None:
        while True:
            try:
                msg = self.from_box.get_nowait()
            except queue.Empty:
                return
            if msg is None:
                self._box_kernel_ended()
                self.box_violated = False
                continue
            if self.box_violated:  # the box is being ended: nothing more of it reaches the frontend
                continue
            self._forward(msg)

    def _forward(self, msg: BoxMessage) -> None:
        """One checked message from the box, rebuilt here (relay.py) and sent on to the frontend, under the frontend's
        message the host sent into the box under its parent's id; under any other parent, dropped and counted."""
        t, parent = msg.msg_type, msg.parent_id
        front = self.parents.get(parent).get("msg_id")  # what the frontend knows this request as
        if front is None:  # doors/cell.py lets through only ids the host sent; one past Parents' limit ends here
            if self.box_kernel is not None:
                self.box_kernel.stray()
            return
        box_id = self.box_kernel.session if self.box_kernel is not None else ""
        if msg.channel == "iopub":
            if t in COMMS and not self.comms.from_box(msg):
                return
            if t == "status" and msg.content.get("execution_state") == "busy" and self.cells.took_busy(front):
                return  # the frontend has had the host's, as the cell was taken
            wire = self.cells.numbered(rebuilt(msg, self.session.msg_header(t), self.parents, box_id), front)
            with self._iopub_lock:
                self.session.send(self.sockets["iopub"], wire, buffers=msg.buffers)
            if t == "status" and msg.content.get("execution_state") == "idle":
                self.cells.idled(front)
            return
        if msg.channel == "stdin":
            target = self.requests.get(parent)
            if target is not None:  # a prompt of a request in the box; the reply goes in under the box's header
                wire = rebuilt(msg, self.session.msg_header(t), self.parents, box_id)
                self.stdin.box_prompt(wire["header"]["msg_id"], msg.header, parent)
                self.session.send(self.sockets["stdin"], wire, ident=target[1])
            return
        target = self.requests.get(parent)
        if target is None:
            return
        if t != target[2]["msg_type"].replace("_request", "_reply"):  # a reply of another type: a violation
            # the request stays open; the box's end answers it (_box_kernel_ended)
            self.protocol_violation(f"door protocol violation: the box sent a {t} in reply to {target[2]['msg_type']}")
            return
        self.requests.pop(parent)
        wire = self.cells.numbered(rebuilt(msg, self.session.msg_header(t), self.parents, box_id,
                                           self.cells.asked.get(front)), front)
        if t == "comm_info_reply" and isinstance(wire["content"].get("comms"), dict):
            wire["content"]["comms"] = {k: v for k, v in wire["content"]["comms"].items()
                                        if not self.comms.host.owns(k)} | self.comms.host.info()
        self.session.send(self.sockets[target[0]], wire, ident=target[1], buffers=msg.buffers)
        if t == "execute_reply":
            self.cells.replied(front, msg.content.get("status"))

    def _box_kernel_ended(self) -> None:
        """The box's kernel (or the box) is gone: every request still open gets an error reply, shown in place."""
        reason = (self.nb.box.ended if self.nb.box is not None and self.nb.box.ended else None) or \
            (self.box_kernel.ended if self.box_kernel is not None else "the box's kernel ended")
        for msg_id, (channel, idents, header) in list(self.requests.items()):
            self.requests.pop(msg_id, None)
            if header["msg_type"] == "execute_request":
                self.send("iopub", "display_data", host_notice([  # a mark the box cannot make (relay.py)
                    reason, "the next cell starts a new box"]), header)
                self.host_reply(channel, idents, header, "error", False, ("BoxEnded", reason))
            else:
                self._answer_without_box(channel, idents, {"header": header, "content": {}})
        self.box_kernel = None
        self.stdin.box_ended()
        self.cells.box_ended()
        if self.nb.box is not None and self.nb.box.ended:
            try:
                self.nb.stop(reason)
            except TkboxError as e:
                self.log(str(e))

    def check_deadlines(self) -> None:
        if self.nb.live and self.box_kernel is not None:
            self.nb.box.watch(list(self.box_kernel.cells.values()))

    def close(self) -> None:
        self.comms.end_run()
        try:
            self.nb.stop("kernel shutdown")
        except TkboxError as e:
            self.log(str(e))
        for s in self.sockets.values():
            s.close(linger=1000)


def main(argv: list[str] | None = None, nb: NotebookBox | None = None) -> int:
    """Serve one kernel. `nb`: the notebook's box, already starting early (kernel/__main__.py), else made here."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m tkbox_nb.kernel")
    p.add_argument("-f", "--connection-file", required=True)
    a = p.parse_args(argv)
    kernel = TkboxKernel(a.connection_file, nb)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts come as messages (kernel.json interrupt_mode)

    def on_term(signum, frame):
        kernel.running = False
    signal.signal(signal.SIGTERM, on_term)
    kernel.serve()
    return 0
