"""Comm messages (widgets) between the frontend and the two comm managers behind the Tracekit Box kernel: the host's
(host_comms.py, the run view) and the box's (its ipykernel, whose comms `BoxKernel.comms` tracks).

Both ways, a message naming a comm the other end does not hold is refused, not forwarded, and signed as a fault
(`exec`, kind `comm_fault`, issue 22): from the frontend, one naming neither a host comm nor a comm the box holds;
from the box, a comm_msg or comm_close naming a comm it never opened (nor the frontend opened toward it). A box
message naming a host comm is a protocol violation and ends the box. A fault seen while no box's run is open (before
the first cell takes the box that starts with the kernel, or between boxes) is signed in the next run that opens,
before that run's first cell is decided (docs/jupyter.md, "Two comm managers behind one kernel").
"""

from __future__ import annotations

import json

MAX_PENDING = 64  # faults held for the next run; past this, only counted


class CommGate:
    def __init__(self, kernel):
        self.k = kernel  # the TkboxKernel (app.py)
        self.pending: list[dict] = []
        self.unrecorded = 0

    def box_comms(self) -> dict[str, str]:
        k = self.k.kernel
        return k.comms if k is not None and not k.ended else {}

    # -- faults ----------------------------------------------------------------------------------------------------
    def fault(self, facts: dict) -> None:
        """Sign a refused comm message as a fault in the run in force, or hold it for the next run."""
        if self.k.nb.live:
            self.k.nb.box.recorder.decide("exec", "comm_fault", facts)
        elif len(self.pending) < MAX_PENDING:
            self.pending.append(facts)
        else:
            self.unrecorded += 1
        self.k._log(f"refused {facts['msg_type']} naming {facts['fault']} ({facts['comm_id'][:40]})")

    def flush(self, box) -> None:
        """Sign the faults held while no run was open, in `box`'s run (called as a cell takes its box)."""
        pending, self.pending = self.pending, []
        for facts in pending:
            box.recorder.decide("exec", "comm_fault", facts)
        if self.unrecorded:
            box.recorder.decide("exec", "comm_fault", {"msg_type": "comm_msg", "comm_id": "", "from": "frontend",
                                                       "fault": f"{self.unrecorded} more, not each signed"})
            self.unrecorded = 0

    # -- from the frontend -----------------------------------------------------------------------------------------
    def from_frontend(self, channel: str, msg: dict) -> None:
        """A comm message from the frontend: to a host comm (handled here), to a comm the box holds (decided by the
        exec door, then forwarded), a comm_open (for the box), or else refused and signed as a fault."""
        k = self.k
        t, content = msg["header"]["msg_type"], msg["content"]
        comm_id = content.get("comm_id")
        if k.host_comms.owns(comm_id) and t != "comm_open":
            k._comm_parent = msg["header"]
            k.host_comms.handle(msg)
            return
        comm_id = str(comm_id or "")[:128]
        if t == "comm_open" and k.host_comms.owns(comm_id):
            why = "a host comm's id"
        elif t != "comm_open" and comm_id not in self.box_comms():
            why = "a comm the box does not hold"
        else:
            why = None
        if why is not None:
            return self.fault({"msg_type": t, "comm_id": comm_id, "from": "frontend", "fault": why})
        if not k.nb.live or k.kernel is None or k.kernel.ended:
            return  # a comm_open with no box to take it, as with a kernel that has no such target
        data = json.dumps(content, sort_keys=True, default=str).encode("utf-8")
        crossing = k.nb.box.recorder.decide("exec", "comm", {"msg_type": t, "comm_id": comm_id}, {"data": data})
        if crossing.allowed:  # BoxKernel.send tracks the comm the frontend opened (or closed) toward the box
            k.kernel.send(channel, msg, msg.get("buffers") or [])

    # -- from the box ----------------------------------------------------------------------------------------------
    def from_box(self, msg) -> bool:
        """Whether a comm message from the box goes on to the frontend. One naming a host comm is a protocol
        violation and ends the box (signed as its last word); a comm_msg or comm_close naming a comm the box does
        not hold is refused and signed as a fault."""
        k = self.k
        comm_id = msg.content.get("comm_id")
        if k.host_comms.owns(comm_id):
            k.box_violated = True
            if k.nb.box is not None:
                k.nb.box.fail_closed(f"door protocol violation: a {msg.msg_type} from the box names a host comm")
            return False
        if msg.unknown_comm:
            self.fault({"msg_type": msg.msg_type, "comm_id": comm_id[:128], "from": "box",
                        "fault": "a comm the box does not hold"})
            return False
        return True
