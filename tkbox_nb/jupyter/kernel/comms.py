"""Comm messages (widgets) between the frontend and the two comm managers behind the Tracekit Box kernel: the host's
(host_comms.py, the run view) and the box's (its ipykernel, whose comms `BoxKernel.comms` tracks).

Both ways, a message naming a comm the other end does not hold is refused, not forwarded, and signed as a fault
(`exec`, kind `comm_fault`, issue 22): from the frontend, one naming neither a host comm nor a comm the box holds;
from the box, a comm_msg or comm_close naming a comm it never opened (nor the frontend opened toward it). A box
message naming a host comm is a protocol violation and ends the box. A fault seen while no box's run is open (before
the first cell takes the box that starts with the kernel, or between boxes) is signed in the next run that opens,
before that run's first cell is decided (docs/jupyter.md, "Two comm managers behind one kernel"). A run signs its
first `MAX_SIGNED` faults one by one; past them (or past `MAX_PENDING` held ones) faults are only counted, and the
count is signed as one record for each side they came from, at the next cell boundary or as the kernel stops the
box (else in the next run to open): a box cannot spam the signer by naming made-up comms. The count of messages
other than outputs the box sent naming cells already signed (dropped by doors/cell.py; late outputs are signed and
shown there, rules/late_outputs.py) is signed the same way, as one `late_output` record.

The frontend's comm housekeeping is answered as ipykernel answers it, never signed as a fault (issue 36: every
JupyterLab session left one): a comm_open the box cannot take (no run open yet, as when JupyterLab opens the widget
control comm at page load, or refused by the exec door) is answered with a comm_close from the host, as ipykernel
closes a comm whose target it lacks, and what the frontend still sends naming that comm (its `request_states`, sent
before the close reached it) is dropped; a comm_close naming a comm neither side holds is dropped, as ipykernel drops
it. None of them reaches the box. A comm_msg naming a comm neither side holds nor the host closed stays a fault.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

from tkbox_nb.jupyter.kernel.host_comms import HostComms
from tkbox_nb.jupyter.kernel.port import KernelPort

from tkbox_nb.rules.door_table import EXEC

MAX_PENDING = 64  # faults held for the next run; past this, only counted
MAX_SIGNED = 64  # faults signed one by one in a run; past this, only counted
MAX_CLOSED = 1024  # comm ids the host closed (comm_opens no box took), newest last


class CommGate:
    def __init__(self, port: KernelPort):
        self.port = port  # the kernel (app.py), only through KernelPort
        self.host = HostComms(self._publish_host)  # the host process's comms (app.py installs it as `comm`'s)
        self.host_parent: dict | None = None  # the frontend message a host comm's messages answer
        self.pending: list[dict] = []
        self.unrecorded: dict[str, int] = {}  # faults counted, not each signed, by the side they came from
        self._run = None  # the box whose run `signed` counts faults for
        self.signed = 0
        self._lock = threading.Lock()
        self.closed_here: OrderedDict[str, None] = OrderedDict()  # comm_opens answered with the host's comm_close

    def box_comms(self) -> dict[str, str]:
        box_kernel = self.port.box_kernel
        return box_kernel.comms if box_kernel is not None and not box_kernel.ended else {}

    def _publish_host(self, msg_type: str, content: dict, metadata: dict, buffers: list) -> None:
        self.port.send("iopub", msg_type, content, self.host_parent, metadata=metadata, buffers=buffers)

    def show_view(self, bundle: Path, header: dict) -> None:
        """%box_view: the run view of `bundle`, live widgets of the host process, shown in the cell `header`."""
        from tkbox_nb.jupyter.run_view import view
        self.host_parent = header
        widget = view(bundle)
        data = widget._repr_mimebundle_()
        self.port.send("iopub", "display_data", {"data": data, "metadata": {}}, header)

    # -- faults ----------------------------------------------------------------------------------------------------
    def fault(self, facts: dict) -> None:
        """Sign a refused comm message as a fault in the run in force (its first `MAX_SIGNED`), or hold it for the
        next run (the first `MAX_PENDING`); count it otherwise, for `flush` to sign the count."""
        box = self.port.nb.box if self.port.nb.live else None
        with self._lock:
            if box is not None and box is not self._run:
                self._run, self.signed = box, 0
            sign = box is not None and self.signed < MAX_SIGNED
            hold = box is None and len(self.pending) < MAX_PENDING
            if sign:
                self.signed += 1
            elif hold:
                self.pending.append(facts)
            else:
                self.unrecorded[facts["from"]] = self.unrecorded.get(facts["from"], 0) + 1
                if sum(self.unrecorded.values()) > 1:
                    return
        if sign:
            box.recorder.decide(EXEC, "comm_fault", facts)
        what = "refused" if sign or hold else "refused (further faults only counted until the next cell)"
        self.port.log(f"{what} {facts['msg_type']} naming {facts['fault']} ({facts['comm_id'][:40]})")

    def flush(self, box) -> None:
        """Sign, in `box`'s run, the faults held while no run was open and the count of those not signed one by
        one (called as a cell takes its box, and as the kernel stops a box: `end_run`)."""
        with self._lock:
            pending, self.pending = self.pending, []
            counted, self.unrecorded = self.unrecorded, {}
        for facts in pending:
            box.recorder.decide(EXEC, "comm_fault", facts)
        for side, n in sorted(counted.items()):
            box.recorder.decide(EXEC, "comm_fault", {"msg_type": "comm_msg", "comm_id": "", "from": side,
                                                       "fault": f"{n} more, not each signed"})
        box_kernel = self.port.box_kernel
        late = box_kernel.take_late() if box_kernel is not None and box_kernel.box is box else 0
        if late:  # what the box sent naming cells already signed: dropped, never shown, counted here (doors/cell.py)
            box.recorder.decide(EXEC, "comm_fault", {"msg_type": "late_output", "comm_id": "", "from": "box",
                                                       "fault": f"{late} messages naming cells already signed"})

    def end_run(self) -> None:
        """The kernel stops the box: the count of faults not yet signed goes into its run while it is open."""
        try:
            if self.port.nb.live:
                self.flush(self.port.nb.box)
        except Exception as e:  # stopping the box goes on; what was not signed is logged
            self.port.log(f"comm faults not signed as the box stopped: {e}")

    # -- from the frontend -----------------------------------------------------------------------------------------
    def from_frontend(self, channel: str, msg: dict) -> None:
        """A comm message from the frontend: to a host comm (handled here), to a comm the box holds (decided by the
        exec door, then forwarded), a comm_open (for the box), or else refused and signed as a fault."""
        port = self.port
        t, content = msg["header"]["msg_type"], msg["content"]
        comm_id = content.get("comm_id")
        if self.host.owns(comm_id) and t != "comm_open":
            self.host_parent = msg["header"]
            self.host.handle(msg)
            return
        comm_id = str(comm_id or "")[:128]
        held = t == "comm_open" or comm_id in self.box_comms()
        if not held and comm_id in self.closed_here:  # the host closed it: what was on its way is dropped
            if t == "comm_close":
                self.closed_here.pop(comm_id, None)
            return
        if t == "comm_close" and not held:
            return  # housekeeping (a page closing what it thinks is open): dropped, as ipykernel drops it
        if t == "comm_open" and self.host.owns(comm_id):
            why = "a host comm's id"
        elif not held:
            why = "a comm the box does not hold"
        else:
            why = None
        if why is not None:
            return self.fault({"msg_type": t, "comm_id": comm_id, "from": "frontend", "fault": why})
        box_kernel = port.box_kernel
        if not port.nb.live or box_kernel is None or box_kernel.ended:
            return self._close_here(comm_id, msg)  # no box to take it: closed, as ipykernel closes an unknown target
        data = json.dumps(content, sort_keys=True, default=str).encode("utf-8")
        port.nb.box.flush_late()  # late outputs held for ended cells are signed before this crossing (late_outputs)
        crossing = port.nb.box.recorder.decide(EXEC, "comm", {"msg_type": t, "comm_id": comm_id}, {"data": data})
        if crossing.allowed:  # BoxKernel.send tracks the comm the frontend opened (or closed) toward the box
            box_kernel.send(channel, port.into_box(msg), msg.get("buffers") or [])  # under a header made here
        elif t == "comm_open":  # refused (and signed so): the frontend is told the comm is closed
            self._close_here(comm_id, msg)

    def _close_here(self, comm_id: str, msg: dict) -> None:
        """A frontend's comm_open no box took, answered with a comm_close (what ipykernel sends for a target it
        lacks), so the frontend stops using the comm; its id is kept (the newest `MAX_CLOSED`) so what the frontend
        sent on it before the close reached it is dropped, not signed as a fault."""
        if not comm_id:
            return
        self.closed_here[comm_id] = None
        while len(self.closed_here) > MAX_CLOSED:
            self.closed_here.popitem(last=False)
        self.port.send("iopub", "comm_close", {"comm_id": comm_id, "data": {}}, msg["header"])

    # -- from the box ----------------------------------------------------------------------------------------------
    def from_box(self, msg) -> bool:
        """Whether a comm message from the box goes on to the frontend. One naming a host comm is a protocol
        violation and ends the box (signed as its last word); a comm_msg or comm_close naming a comm the box does
        not hold is refused and signed as a fault."""
        comm_id = msg.content.get("comm_id")
        if self.host.owns(comm_id):
            self.port.protocol_violation(f"door protocol violation: a {msg.msg_type} from the box names a host comm")
            return False
        if msg.unknown_comm:
            self.fault({"msg_type": msg.msg_type, "comm_id": comm_id[:128], "from": "box",
                        "fault": "a comm the box does not hold"})
            return False
        return True
