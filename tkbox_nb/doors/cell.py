"""The host end of the box's Jupyter kernel: one door stream to a real ipykernel in the box (guest/kernel.py).

Messages in are the frontend's (or `Box.execute`'s), already through the exec door. Messages out are hostile: each
is decoded by the codec's MessageReader (size limit), checked by `jupyter_messages.check_box_message`, and only then
routed: to the cell it belongs to (whose outputs are collected, limited and signed when the cell ends) and to any
listener (the Tracekit Box kernel, which forwards it to the frontend). A malformed message ends the box.

A cell ends when both its `execute_reply` and its `status: idle` have come, as a Jupyter client reckons it. The
first reply is the cell's (the one signed and the one forwarded): a second `execute_reply` for a tracked cell is a
protocol violation that ends the box. Once a cell is signed, an output the box still sends naming it (a background
thread's print, a display update) is held (rules/late_outputs.py), signed in a batch of its own (exec, kind
`late_output`, naming the cell's seq), and only then given to the listeners, which forward it under the cell's parent
as ipykernel would; past the caps it is dropped and counted, the count signed too. Anything else naming a signed cell
(a comm message) is dropped, never forwarded unsigned, and counted: the count is signed in the next cell's result
(`late_outputs`); the Tracekit Box kernel signs it first, as one `late_output` fault at the next cell boundary or as
it stops the box (jupyter/kernel/comms.py). A box ended for a violation names what it dropped unsigned in its end
reason.

Only what the box was asked for goes to the listeners: a message whose parent is none of the ids the host sent into
the box (a cell, a comm message, a shell request; `sent`, the newest `MAX_SENT`), tracked or signed, is dropped
(a thread naming a request the box never saw, a made-up id, no parent at all) and counted (`strays`); the count is
signed at the next crossing or as the box stops (`flush_late`, one `comm_fault` record of `msg_type: stray`).

A request's `user_expressions` (decided with the cell's code, box.decide_cell) are evaluated by the box's kernel;
their results, rebuilt from an allowlist (jupyter_messages), are kept for exactly the keys asked, count against the
cell's output limit, are signed in the cell's end, and the `execute_reply` that carries them is given to the
listeners only once that end is signed (the messages after it wait behind it, so their order stays).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tkbox_nb.doors.door import Door
from tkbox_nb.guest import protocol as p
from tkbox_nb.rules.late_outputs import FLUSH_S, Batch, LateOutputs
from tkbox_nb.rules.jupyter_messages import BoxMessage, check_box_message
from tkbox_nb.rules.widget_state import REFUSED, control_kind, widget_kind
from tkbox_nb.stream.events import Close, Data, Lost
from tkbox_nb.rules.door_table import EXEC

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext
    from tkbox_nb.signing.recorder import Crossing

READY_TIMEOUT_S = 90.0
NOT_ANSWERED = {"status": "error", "ename": "NotAnswered", "evalue": "the box's kernel gave no result for it",
                "traceback": []}
PROTOCOL_VERSION = "5.3"
MAX_SENT = 4096  # ids of messages the host sent into the box, kept to route what the box sends under them


def new_header(msg_type: str, session: str) -> dict[str, Any]:
    return {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": session, "username": "tkbox",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": PROTOCOL_VERSION}


def _json_default(obj: Any) -> str:
    """Dates in a frontend's headers (jupyter_client parses them) go into the box as ISO 8601 text."""
    if isinstance(obj, (datetime.datetime, datetime.date)):
        return obj.isoformat()
    raise TypeError(f"{type(obj).__name__} is not JSON")


def _own_start(msg: BoxMessage) -> bool:
    """What the box's kernel sends for its own start, asked by no one here: its `starting` status (no parent) and the
    answers to the bridge's readiness probes (guest/kernel.py; the host never sends a kernel_info_request into the
    box). Dropped as any message naming no request the host sent, but not counted."""
    if msg.parent_id is None:
        return msg.msg_type == "status" and msg.content["execution_state"] == "starting"
    probe = msg.parent_header.get("msg_type") == "kernel_info_request"
    return probe and msg.msg_type in ("status", "kernel_info_reply")


@dataclass
class Cell:
    """One execute_request in flight: its signed crossing and what the box has said about it so far."""

    msg_id: str
    crossing: "Crossing"
    on_output: Callable[[dict], None] | None = None
    started: float = field(default_factory=time.monotonic)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    output_bytes: int = 0
    dropped: list[str] = field(default_factory=list)
    reply: dict[str, Any] | None = None
    idle: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    ended: str | None = None
    expressions: dict[str, str] | None = None  # the user_expressions sent with it (decided with its code)
    expression_results: dict[str, Any] | None = None  # what the box answered, rebuilt; signed in the cell's end
    held: BoxMessage | None = None  # its execute_reply, given to the listeners once the results are signed
    behind: list[BoxMessage] = field(default_factory=list)  # messages after the held reply, in order

    @property
    def status(self) -> str:
        if self.reply is None:
            return "error"
        return self.reply.get("status", "error")

    @property
    def execution_count(self) -> int | None:
        count = (self.reply or {}).get("execution_count")
        return count if isinstance(count, int) and not isinstance(count, bool) else None


class BoxKernel(Door):
    """The box's kernel, as the host sees it. Start with `Box.kernel()`, which waits until it answers; the box
    ends it after its other doors (`stop`), a cell still running ended with it, its end signed."""

    name = "cell"

    def __init__(self, box: "DoorContext"):
        self.box = box
        self.session = box.box_id
        self.reader = p.MessageReader()
        self.ready = threading.Event()
        self.info: dict[str, Any] | None = None
        self.ended: str | None = None
        self.cells: dict[str, Cell] = {}
        self.listeners: list[Callable[[BoxMessage], None]] = []
        # the box's comms, opened by its kernel or by the frontend toward it: id -> what the widget is (its model and
        # view names, widget_state.widget_kind; REFUSED for a link's), so the state a comm_msg carries is checked for
        # what it will render
        self.comms: dict[str, str] = {}
        self.requests = _Requests(self)  # the msg_ids of the requests the box was sent: all an Output may capture
        self.signed: set[str] = set()  # cells whose end is signed: what names them later is dropped and counted
        self.late = 0  # messages dropped so, not yet in a signed record
        self.late_outputs = LateOutputs()  # outputs naming signed cells, held until signed (rules/late_outputs.py)
        self.sent: OrderedDict[str, None] = OrderedDict()  # msg_ids the host sent into the box (shell, control):
        # what the box may send under, and all an Output widget may capture (_Requests)
        self.strays = 0  # messages naming none of them, dropped, not yet in a signed record
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one signer of late outputs at a time, so their records keep order
        self._flush_timer: threading.Timer | None = None
        self.stream = box.conn.open({"kind": "kernel"})
        threading.Thread(target=self._read, daemon=True, name="tkbox-kernel-reader").start()

    # -- to the box ----------------------------------------------------------------------------------------------
    def send(self, channel: str, msg: dict[str, Any], buffers: list[bytes] = ()) -> None:
        import base64
        self._track_comm(msg["header"].get("msg_type"), msg.get("content") or {})
        if channel != "stdin":  # what the box sends under it may go on; an input reply asks for nothing
            with self._lock:
                self.sent[msg["header"]["msg_id"]] = None
                while len(self.sent) > MAX_SENT:
                    self.sent.popitem(last=False)
        body = {"channel": channel, "header": msg["header"], "parent_header": msg.get("parent_header") or {},
                "metadata": msg.get("metadata") or {}, "content": msg.get("content") or {},
                "buffers": [base64.b64encode(bytes(b)).decode() for b in buffers]}
        self.box.conn.send_data(self.stream.sid, p.CH_MSG, p.encode_message(body, default=_json_default))

    def interrupt(self) -> None:
        """SIGINT to the box's kernel process: the running cell stops, the kernel and the box go on."""
        self.box.conn.send_data(self.stream.sid, p.CH_MSG, p.encode_message({"channel": "bridge", "op": "interrupt"}))

    def execute_request(self, code: str, crossing: "Crossing", on_output: Callable[[dict], None] | None = None,
                        silent: bool = False, user_expressions: dict[str, str] | None = None,
                        execution_count: int | None = None) -> Cell:
        """Send one cell (already allowed through the exec door, with its user_expressions) and return what tracks
        it; `execution_count`: the number the box's kernel gives it (its In/Out/_n), else its own next one."""
        header = new_header("execute_request", self.session)
        cell = self.track(header["msg_id"], crossing, on_output, user_expressions)
        meta = {p.COUNT_KEY: execution_count} if execution_count is not None and not silent else {}
        self.send("shell", {"header": header, "metadata": meta, "content": {
            "code": code, "silent": silent, "store_history": not silent, "user_expressions": user_expressions or {},
            "allow_stdin": False, "stop_on_error": True}})
        return cell

    def track(self, msg_id: str, crossing: "Crossing", on_output: Callable[[dict], None] | None = None,
              expressions: dict[str, str] | None = None) -> Cell:
        cell = Cell(msg_id, crossing, on_output, expressions=dict(expressions) if expressions else None)
        with self._lock:
            if self.ended:
                raise p.ProtocolError(self.ended)
            self.cells[msg_id] = cell
        return cell

    # -- from the box --------------------------------------------------------------------------------------------
    def _read(self) -> None:
        reason = "the box's kernel ended"
        try:
            while True:
                event = self.stream.get()
                if isinstance(event, Data):
                    if event.channel != p.CH_MSG:
                        raise p.ProtocolError(f"kernel data on channel {event.channel}")
                    for raw in self.reader.feed(event.payload):
                        msg = check_box_message(raw, self.comms, self.requests)
                        if msg is not None:
                            self._route(msg)
                elif isinstance(event, Close):
                    body = event.body
                    reason = f"the box's kernel ended: {str(body.get('error') or body)[:300]}"
                    break
                else:
                    reason = f"the box's kernel stream ended: {event.reason if isinstance(event, Lost) else event!r}"
                    break
        except p.ProtocolError as e:
            reason = f"door protocol violation: {e}"
            with self._lock:
                unsigned = self.late_outputs.discard()  # a box that broke the protocol gets nothing more shown
            late = self.take_late() + unsigned
            if late:  # signed in the box's end, as no cell boundary comes to sign their count
                reason += f" ({late} messages naming cells already signed were dropped before it)"
            strays = self.take_strays()
            if strays:
                reason += f" ({strays} messages naming no request sent into the box were dropped before it)"
            self.box.fail_closed(reason)
        self._finish(reason)

    def _track_comm(self, msg_type: Any, content: dict, refused: bool = False) -> None:
        comm_id = content.get("comm_id")
        if not isinstance(comm_id, str):
            return
        data = content.get("data") if isinstance(content.get("data"), dict) else {}
        if refused and msg_type != "comm_close":  # a link's comm: what names it later is refused with it
            self.comms[comm_id] = REFUSED
        elif msg_type == "comm_open" or (msg_type == "comm_msg" and comm_id in self.comms):
            known = self.comms.get(comm_id, "") if msg_type == "comm_msg" else ""
            self.comms[comm_id] = widget_kind(known, data.get("state"))
            if msg_type == "comm_msg" and data.get("method") == "update_states":  # checked: widget_state.control_states
                for model_id, entry in data["states"].items():
                    self.comms[model_id] = control_kind(entry, self.comms.get(model_id, ""))
        elif msg_type == "comm_close":
            self.comms.pop(comm_id, None)

    def _route(self, msg: BoxMessage) -> None:
        if msg.channel == "bridge":
            self.info = msg.content
            self.ready.set()
            return
        cell = self.cells.get(msg.parent_id) if msg.parent_id else None
        if cell is not None:
            self._collect(cell, msg)
        elif msg.parent_id in self.signed:
            if msg.msg_type == "execute_reply":
                raise p.ProtocolError("a second execute_reply for a cell")
            output = msg.as_output()
            if output is not None:
                self._late(msg, output)
            elif msg.msg_type != "status":
                with self._lock:
                    self.late += 1
            return
        elif msg.parent_id not in self.sent:  # nothing the host asked of the box: never shown, counted
            if not _own_start(msg):
                self.stray()
            return
        if msg.channel == "iopub":
            self._track_comm(msg.msg_type, msg.content, msg.refused is not None)
        if msg.refused is not None:  # its refusal is in the cell's dropped (signed); the frontend never sees it
            pass
        elif cell is not None and cell.held is None and msg.msg_type == "execute_reply" and cell.expressions:
            cell.held = msg  # it carries the expressions' results: shown once they are signed
        elif cell is not None and cell.held is not None:
            cell.behind.append(msg)
        else:
            self._tell(msg)
        if cell is not None and cell.reply is not None and cell.idle:
            with self._lock:
                self.cells.pop(cell.msg_id, None)
                self.signed.add(cell.msg_id)
                self.late_outputs.cell_ended(cell.msg_id, cell.crossing.run_seq)
            if self._sign_end(cell) and cell.held is not None:
                for waiting in [cell.held, *cell.behind]:
                    self._tell(waiting)
            cell.done.set()

    def _tell(self, msg: BoxMessage) -> None:
        for listener in list(self.listeners):
            listener(msg)

    # -- late outputs (rules/late_outputs.py) --------------------------------------------------------------------------
    def _late(self, msg: BoxMessage, output: dict) -> None:
        """An output naming a signed cell: held, to be signed within FLUSH_S (or dropped and counted past a cap)."""
        with self._lock:
            if self.late_outputs.add(msg.parent_id, (msg, output), len(json.dumps(output))) \
                    and self._flush_timer is None:
                self._flush_timer = threading.Timer(FLUSH_S, self.flush_late)
                self._flush_timer.daemon = True
                self._flush_timer.start()

    def flush_late(self, boundary: bool = False) -> None:
        """Sign the late outputs held (one record per cell), then give them to the listeners; `boundary` (the next
        crossing, the box's stop): the counts of those dropped past a cap too."""
        with self._flush_lock:
            with self._lock:
                if self._flush_timer is not None:
                    self._flush_timer.cancel()
                self._flush_timer = None
                batches = self.late_outputs.take(boundary)
            for batch in batches:
                if self._sign_late(batch):
                    for msg, _ in batch.items:
                        self._tell(msg)
            strays = self.take_strays() if boundary else 0
            if strays:  # dropped, never shown: their count is signed (as jupyter/kernel/comms.py signs faults)
                self.box.recorder.decide(EXEC, "comm_fault", {
                    "msg_type": "stray", "comm_id": "", "from": "box",
                    "fault": f"{strays} messages naming no request the host sent into the box"})

    def _sign_late(self, batch: Batch) -> bool:
        facts: dict[str, Any] = {"cell_seq": batch.seq, "messages": len(batch.items)}
        if batch.dropped:
            facts["dropped"] = batch.dropped
        content = {"outputs": json.dumps([o for _, o in batch.items], sort_keys=True).encode("utf-8")} \
            if batch.items else {}
        recorder = self.box.recorder
        crossing = recorder.decide(EXEC, "late_output", facts, content)
        if not crossing.allowed:
            return False
        sanitised = sorted({d for msg, _ in batch.items for d in msg.dropped})[:50]
        return recorder.complete(crossing, "ok", {"dropped": sanitised} if sanitised else {})

    def _collect(self, cell: Cell, msg: BoxMessage) -> None:
        cell.dropped += msg.dropped
        if msg.msg_type == "execute_reply":
            if cell.reply is not None:  # the first reply is the cell's; a box that sends two breaks the protocol
                raise p.ProtocolError("a second execute_reply for a cell")
            self._expressions(cell, msg)
            cell.reply = msg.content
        elif msg.msg_type == "status" and msg.content["execution_state"] == "idle":
            cell.idle = True
        output = msg.as_output()
        if output is not None:
            size = len(json.dumps(output))
            limit = self.box.policy.get("exec", "max_output_bytes")
            if cell.output_bytes + size > limit:
                raise p.ProtocolError(f"cell output over exec.max_output_bytes ({limit})")
            cell.output_bytes += size
            cell.outputs.append(output)
            if cell.on_output is not None:
                cell.on_output(output)

    def _expressions(self, cell: Cell, msg: BoxMessage) -> None:
        """The reply's user_expressions: exactly the keys sent (one the box left out of an ok reply answered as an
        error), none when none was sent; counted against the cell's output limit, as they are signed with its
        outputs."""
        got = msg.content.get("user_expressions") if isinstance(msg.content.get("user_expressions"), dict) else {}
        # as ipykernel: a cell that did not end ok evaluates none (its reply has {}), so none is missing then
        ok = msg.content.get("status") == "ok"
        results = {key: got.get(key, NOT_ANSWERED) for key in sorted(cell.expressions or {}) if ok or key in got}
        if results:
            limit = self.box.policy.get("exec", "max_output_bytes")
            cell.output_bytes += len(json.dumps(results))
            if cell.output_bytes > limit:
                raise p.ProtocolError(f"cell output over exec.max_output_bytes ({limit})")
            cell.expression_results = results
        msg.content = dict(msg.content, user_expressions=results)

    def stop(self, reason: str) -> None:
        self._finish(f"the box stopped: {reason}")

    def _finish(self, reason: str) -> None:
        if "door protocol violation" not in f"{reason} {getattr(self.box, 'ended', None)}":
            try:  # what was held is signed (and shown) while the run is open: the box ends, its output stays
                self.flush_late(boundary=True)
            except Exception:
                pass
        with self._lock:
            if self.ended is None:
                self.ended = reason
            pending, self.cells = list(self.cells.values()), {}
        self.ready.set()
        for cell in pending:
            cell.ended = reason
            self._sign_end(cell)
            cell.done.set()
        for listener in list(self.listeners):
            listener(None)

    def stray(self) -> None:
        """Count a message from the box that names no request the host sent into it (dropped, never shown)."""
        with self._lock:
            self.strays += 1

    def take_strays(self) -> int:
        with self._lock:
            strays, self.strays = self.strays, 0
        return strays

    def take_late(self) -> int:
        """The count of late messages dropped since the last signed record, taken to be signed."""
        with self._lock:
            late, self.late = self.late, 0
        return late

    def _sign_end(self, cell: Cell) -> bool:
        """Sign the end of a cell: its status and execution count, its outputs disclosed. The exec door's record,
        written here because only the kernel knows when a cell has ended (its reply and idle, or the kernel gone)."""
        result: dict = {"execution_count": cell.execution_count}
        if cell.dropped:
            result["dropped"] = sorted(set(cell.dropped))[:50]
        if cell.ended:
            result["ended"] = cell.ended[:300]
        late = self.take_late()
        if late:
            result["late_outputs"] = late
        status = cell.status if not cell.ended else "error"
        content = {"outputs": json.dumps(cell.outputs, sort_keys=True).encode("utf-8")}
        if cell.expression_results:
            content["user_expressions"] = json.dumps(cell.expression_results, sort_keys=True).encode("utf-8")
        return self.box.recorder.complete(cell.crossing, "ok" if status == "ok" else "error", result, content)


class _Requests:
    """The msg_ids of the requests a box was sent (cells running or signed, the newest shell requests: a widget's
    comm_msg, whose handler `interact` runs `with out:`): the only ones an Output widget of the box's may name as its
    `msg_id` (widget_state.widget_state). What answers them is the box's (a cell that mixes host magics with box code
    shows its host outputs before the box is sent it)."""

    def __init__(self, kernel: BoxKernel):
        self.kernel = kernel

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self.kernel.cells or msg_id in self.kernel.signed or msg_id in self.kernel.sent
