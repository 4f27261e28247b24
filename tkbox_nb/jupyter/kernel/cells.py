"""The Tracekit Box kernel's execute requests, one at a time, in the order they came, as ipykernel runs them.

A cell (host-side magics, box code, or both) starts only after the cell before it has ended: its `execute_reply` and
its `idle` sent. Requests that come meanwhile wait in a FIFO; the main loop still serves comms, completion and the
control channel. So a host magic (`%box_restart`, `%%box_policy`, `%box_status`) never jumps ahead of a box cell sent
before it. With `stop_on_error` (the default), a cell that ends in error aborts the execute requests queued behind it
(each answered `busy`, `execute_reply` status `aborted`, `idle`), as ipykernel does.

A host magic that raises anything still ends its cell: an `execute_reply` with status `error` and the exception's
name and message, its traceback on the kernel's stderr, and `idle`.

Every cell that stores history (not `silent`, `store_history` not false) and has code takes the next execution count,
as IPython numbers it, whether the host answers it (host magics only) or the box does: the count is the host's, and
what the box's ipykernel says in execute_input, execute_result and execute_reply is replaced by it (`numbered`). So a
host-magic cell no longer shows the previous cell's number, a cell of host magics and box code is one number, and a
new box (whose ipykernel counts from 1 again) does not set the notebook back. Each box cell that takes a number goes
into the box with it (`p.COUNT_KEY` in its metadata; the bridge, guest/kernel.py, moves its ipykernel's count up to it
first), so the box's own `In[n]`, `Out[n]` and `_n` name the cell the notebook shows as [n], as in a plain ipykernel,
after host-magic cells and in a new box alike; before, they counted only the box's cells.

A request's `user_expressions` are read strictly first (jupyter_messages.user_expressions_request: text, at most 64,
each within its length); a request over a limit is answered with one error line (`UserExpressionsRefused`) and runs
nothing. They go to the box with the cell's code, decided with it; a cell that is only host magics evaluates none
(each is answered `NotEvaluated`, relay.unevaluated).
"""

from __future__ import annotations

import traceback
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from tkbox_nb.rules.jupyter_messages import user_expressions_request
from tkbox_nb.rules.refusal_notices import Shown, watch
from tkbox_nb.core.errors import DoorRefused, TkboxError
from tkbox_nb.box.notebook_box import HostMagics, split_host_magics
from tkbox_nb.guest import protocol as p
from tkbox_nb.jupyter.kernel.box_wait import wait_for_box
from tkbox_nb.jupyter.kernel.comms import CommGate
from tkbox_nb.jupyter.kernel.port import KernelPort
from tkbox_nb.jupyter.kernel.relay import host_notice
from tkbox_nb.jupyter.kernel.stdin import Stdin
from tkbox_nb.rules.door_table import PATCH

MAX_NUMBERS = 4096  # the counts of the newest cells kept, for what the box sends naming them
COUNTED = frozenset({"execute_input", "execute_result", "execute_reply"})


class Cells:
    def __init__(self, port: KernelPort, comms: CommGate, stdin: Stdin):
        self.port = port  # the kernel (app.py), only through KernelPort
        self.comms = comms  # comm faults signed as a cell takes its box; the run view's host comms
        self.stdin = stdin  # the host's prompt of a magic (%box_secret), answered for the cell running it
        self.magics = HostMagics(port.nb, self._read_secret)
        self.queue: deque[tuple[str, list[bytes], dict]] = deque()
        # the cell in the box now: msg_id, and whether its reply and its idle have reached the frontend
        self.current: dict[str, Any] | None = None
        self.asked: dict[str, frozenset[str]] = {}  # user_expressions keys each box cell's request asked for
        self._host_status: tuple[Any, Any] | None = None  # (msg_id, status) of the last reply the host made itself
        self.host: tuple[list[bytes], dict, bool] | None = None  # (idents, header, allow_stdin) whose magics run now
        self.busy_here: set[str] = set()  # cells whose `busy` the host published: the box's for them is dropped
        self.refusals_shown = Shown()  # refusals said in each cell: a flood is not shown as one
        self.count = 0  # the last execution count a cell took (IPython's execution_count - 1)
        self.numbers: OrderedDict[str, int] = OrderedDict()  # the count each cell shows, by the frontend's msg_id

    def enqueue(self, channel: str, idents: list[bytes], msg: dict) -> None:
        self.queue.append((channel, idents, msg))

    def pump(self) -> None:
        """Start queued cells while none is in the box (called by the main loop, never from inside a handler)."""
        while self.current is None and self.queue and self.port.running:
            channel, idents, msg = self.queue.popleft()
            self._start(channel, idents, msg)

    def _read_secret(self, prompt: str) -> str:
        return self.stdin.read_secret(prompt, self.host)

    def show_refusal(self, line: str) -> None:
        """A crossing refused while a cell runs (rules/refusal_notices.py; on a door's thread): shown in that cell as
        the host's notice, the first few of each cell."""
        cur, host = self.current, self.host
        header = cur["header"] if cur is not None else host[1] if host is not None else None
        if header is not None and (line := self.refusals_shown.admit(header.get("msg_id"), line)) is not None:
            self.port.send("iopub", "display_data", host_notice([line]), header)

    def took_busy(self, msg_id: str) -> bool:
        """Whether the host published `busy` as it took this cell (the box's own `busy` for it is then dropped)."""
        if msg_id not in self.busy_here:
            return False
        self.busy_here.discard(msg_id)
        return True

    # -- execution counts ----------------------------------------------------------------------------------------------
    def _take_number(self, msg_id: str, content: dict, silent: bool) -> int:
        """The count the cell `msg_id` shows: the next one if it stores history and has code (IPython's rule: an
        empty cell, a silent one or `store_history: false` takes none and shows the last), else the last one."""
        code = content.get("code")
        if not silent and content.get("store_history", True) is not False and isinstance(code, str) and code.strip():
            self.count += 1
        self.numbers[msg_id] = self.count
        while len(self.numbers) > MAX_NUMBERS:
            self.numbers.popitem(last=False)
        return self.count

    def number(self, msg_id: Any) -> int:
        """The execution count the frontend's cell `msg_id` shows (the last one taken if it is not known)."""
        return self.numbers.get(msg_id, self.count) if isinstance(msg_id, str) else self.count

    def numbered(self, wire: dict, msg_id: Any) -> dict:
        """A message rebuilt for the frontend with the count of its cell `msg_id` in place of the box's."""
        content = wire.get("content")
        if wire["header"].get("msg_type") in COUNTED and isinstance(content, dict) and "execution_count" in content:
            wire = dict(wire, content=dict(content, execution_count=self.number(msg_id)))
        return wire

    # -- the end of a cell -----------------------------------------------------------------------------------------
    def replied(self, msg_id: Any, status: Any, idle: bool = False) -> None:
        """An execute_reply went to the frontend (forwarded from the box, or the host's own; `idle`: with its idle)."""
        cur = self.current
        if cur is not None and cur["msg_id"] == msg_id:
            first = not cur["reply"]
            cur["reply"], cur["status"] = True, status
            cur["idle"] = cur["idle"] or idle
            if first and status == "error" and cur["stop_on_error"]:
                self.abort_queued()  # those that came while it ran, as ipykernel: never one sent after its reply
            self._maybe_end()
        else:
            self._host_status = (msg_id, status)

    def idled(self, parent_id: Any) -> None:
        cur = self.current
        if cur is not None and cur["msg_id"] == parent_id:
            cur["idle"] = True
            self._maybe_end()

    def _maybe_end(self) -> None:
        cur = self.current
        if cur is not None and cur["reply"] and cur["idle"]:
            self.current = None
            self.asked.pop(cur["msg_id"], None)

    def box_ended(self) -> None:
        """The box's kernel is gone (its requests answered by app._box_kernel_ended): the cell in it ends, idle too."""
        self.busy_here.clear()
        cur = self.current
        if cur is not None:
            if not cur["idle"]:
                self.port.publish_status("idle", cur["header"])
            if not cur["reply"] and cur["stop_on_error"]:
                self.abort_queued()
            cur["reply"] = cur["idle"] = True
            cur["status"] = cur["status"] or "error"
            self._maybe_end()

    def abort_queued(self) -> None:
        """Answer every queued execute request `aborted` (busy, reply, idle), as ipykernel does after an error."""
        queued, self.queue = self.queue, deque()
        for channel, idents, msg in queued:
            header = msg["header"]
            self.port.publish_status("busy", header)
            self.port.send(channel, "execute_reply", {"status": "aborted"}, header, idents,
                        metadata={"status": "aborted"})
            self.port.publish_status("idle", header)

    # -- the start of a cell ---------------------------------------------------------------------------------------
    def _start(self, channel: str, idents: list[bytes], msg: dict) -> None:
        header, content = msg["header"], msg["content"]
        silent = bool(content.get("silent"))
        stops = not silent and content.get("stop_on_error", True) is not False
        self.asked[header["msg_id"]] = frozenset()  # the user_expressions keys, once read (_run)
        self._take_number(header["msg_id"], content, silent)
        self._host_status = None
        self.port.publish_status("busy", header)  # at once, as ipykernel: the cell may wait for its box to start
        try:
            self._run(channel, idents, msg, silent, stops)
        except Exception as e:  # a bug of ours: the cell still gets its reply and idle
            self.port.log(f"error in an execute_request: {e}\n{traceback.format_exc()}")
            forwarded = self.current is not None and self.current["msg_id"] == header["msg_id"]
            if not forwarded and (self._host_status or (None,))[0] != header["msg_id"]:
                self.port.host_reply(channel, idents, header, "error", silent, (type(e).__name__, str(e)))
        host = self._host_status
        if self.current is None and stops and host is not None and host[0] == header["msg_id"] and host[1] == "error":
            self.abort_queued()

    def _run(self, channel: str, idents: list[bytes], msg: dict, silent: bool, stops: bool) -> None:
        """Do the cell's host magics and forward the rest to the box (or answer it here)."""
        port = self.port
        header, content = msg["header"], msg["content"]
        code = content.get("code", "")
        try:
            expressions = user_expressions_request(content.get("user_expressions"))
        except TkboxError as e:  # nothing of the request runs
            port.host_reply(channel, idents, header, "error", silent, ("UserExpressionsRefused", str(e)))
            return
        self.asked[header["msg_id"]] = frozenset(expressions)
        magics, remainder = split_host_magics(code)
        if magics or not remainder.strip():  # answered here, under the count the cell took (_take_number)
            self.host = (idents, header, bool(content.get("allow_stdin")))
            try:
                for name, line, body in magics:
                    text = self.magics.run(name, line, body)
                    if isinstance(text, Path):  # %box_view: the run view, live widgets of the host process
                        if not silent:
                            self.comms.show_view(text, header)
                        continue
                    if text and not silent:
                        port.send("iopub", "stream", {"name": "stdout", "text": text.rstrip("\n") + "\n"}, header)
            except Exception as e:  # TkboxError, or anything a magic raised: the cell ends in error all the same
                if not isinstance(e, TkboxError):
                    port.log(f"host magic failed: {e}\n{traceback.format_exc()}")
                port.host_reply(channel, idents, header, "error", silent, (type(e).__name__, str(e)))
                return
            finally:
                self.host = None
            if not remainder.strip():
                port.host_reply(channel, idents, header, "ok", silent)
                return
            msg = dict(msg, content=dict(content, code=remainder))
            code = remainder
        try:
            port.nb.start_for_cell()  # in the background, unless a box runs or is starting already
            while port.nb.starting():
                if not wait_for_box(port, channel, idents, header, silent):
                    return
                port.nb.start_for_cell()  # the box that was starting no longer fits: the next one
            box = port.nb.ensure_box()
            if box.recorder.on_refused is None:  # each refusal shown in the cell it happens in (refusal_notices);
                # a patch file's comes only from %box_patch or %box_pull, which say each file's decision themselves
                watch(box.recorder, self.show_refusal, skip=frozenset({(PATCH, "file"), (PATCH, "summary")}))
            self.comms.flush(box)  # comm faults seen while no run was open
            crossing = box.decide_cell(code, expressions)  # the expressions are decided with the code
        except (DoorRefused, TkboxError) as e:
            port.host_reply(channel, idents, header, "error", silent, (type(e).__name__, str(e)))
            return
        # into the box under a header made here (relay.Parents): the box never learns the frontend's ids
        # the code decided (a cell's host magics taken off it), never the request's: what runs is what was signed;
        # with the number the frontend shows for it, if it takes one (the box's In/Out/_n use it)
        meta = msg.get("metadata")
        meta = {k: v for k, v in meta.items() if k != p.COUNT_KEY} if isinstance(meta, dict) else {}
        if not silent and content.get("store_history", True) is not False:
            meta[p.COUNT_KEY] = self.number(header["msg_id"])
        sent = port.into_box(dict(msg, metadata=meta, content=dict(msg["content"], user_expressions=expressions)))
        try:
            box_kernel = port.attach(box)
            box_kernel.track(sent["header"]["msg_id"], crossing, expressions=expressions)
        except Exception as e:
            box.recorder.complete(crossing, "error", {"ended": str(e)[:300]})
            port.host_reply(channel, idents, header, "error", silent, (type(e).__name__, str(e)))
            return
        port.open_request(sent["header"]["msg_id"], channel, idents, header)
        self.busy_here.add(header["msg_id"])
        self.current = {"msg_id": header["msg_id"], "header": header, "reply": False, "idle": False,
                        "status": None, "stop_on_error": stops}
        box_kernel.send("shell", sent)
