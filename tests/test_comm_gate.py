"""The comm gate's faults (jupyter/kernel/comms.py), with a stand-in kernel: how many a run signs one by one, and the
count of the rest, signed as one record a side at the next cell boundary or as the kernel stops the box."""

from __future__ import annotations

from types import SimpleNamespace

from tkbox_nb.jupyter.kernel.comms import MAX_PENDING, MAX_SIGNED, CommGate


class Recorder:
    def __init__(self):
        self.records: list[dict] = []

    def decide(self, door, kind, facts, content=None):
        assert (door, kind) == ("exec", "comm_fault")
        self.records.append(facts)


def stand_in(live=True):
    box = SimpleNamespace(recorder=Recorder())
    kernel = SimpleNamespace(nb=SimpleNamespace(box=box, live=live), box_kernel=None, logged=[])
    kernel.log = kernel.logged.append
    return kernel, box


def spam(gate, n, side="box"):
    for i in range(n):
        gate.fault({"msg_type": "comm_msg", "comm_id": f"{i:032x}", "from": side,
                    "fault": "a comm the box does not hold"})


def test_a_run_signs_its_first_faults_then_one_count_at_the_next_cell_boundary():
    kernel, box = stand_in()
    gate = CommGate(kernel)
    spam(gate, MAX_SIGNED + 500)
    spam(gate, 3, "frontend")
    assert len(box.recorder.records) == MAX_SIGNED  # the signer is not asked again per message
    assert len(kernel.logged) == MAX_SIGNED + 1  # nor the log written to
    gate.flush(box)  # the next cell takes the box
    assert box.recorder.records[MAX_SIGNED:] == [
        {"msg_type": "comm_msg", "comm_id": "", "from": "box", "fault": "500 more, not each signed"},
        {"msg_type": "comm_msg", "comm_id": "", "from": "frontend", "fault": "3 more, not each signed"}]
    gate.flush(box)
    spam(gate, 2)  # still past the run's first MAX_SIGNED: counted
    assert len(box.recorder.records) == MAX_SIGNED + 2
    gate.end_run()  # the kernel stops the box: the count goes into its run
    assert box.recorder.records[-1]["fault"] == "2 more, not each signed"
    # a new run signs its own first faults one by one again
    kernel.nb.box = new = SimpleNamespace(recorder=Recorder())
    spam(gate, 1)
    assert len(new.recorder.records) == 1 and new.recorder.records[0]["comm_id"] == "0" * 32


def test_faults_while_no_run_is_open_are_held_then_counted():
    kernel, box = stand_in(live=False)
    gate = CommGate(kernel)
    spam(gate, MAX_PENDING + 10, "frontend")
    gate.end_run()  # no run open: nothing is signed
    assert box.recorder.records == []
    gate.flush(box)
    assert len(box.recorder.records) == MAX_PENDING + 1
    assert box.recorder.records[-1]["fault"] == "10 more, not each signed"


def frontend(gate, msg_type, comm_id, **content):
    gate.from_frontend("shell", {"header": {"msg_id": f"f-{msg_type}-{comm_id}", "msg_type": msg_type},
                                 "content": {"comm_id": comm_id, "data": {}, **content}})


def test_frontend_comm_housekeeping_is_answered_as_ipykernel_does_and_signs_no_fault():
    """What JupyterLab does at page load and unload signed a deny the user did not cause (issue 36): it opens the
    widget control comm before any run is open, asks it for the states, and closes comms the box never had. The open
    is answered with a comm_close (ipykernel's answer to a target it lacks), what was sent on that comm meanwhile and
    a close of a comm neither side holds are dropped; nothing is signed. A comm_msg to a comm nobody holds or closed
    is still a fault (I55)."""
    kernel, box = stand_in(live=False)
    kernel.sent = []
    kernel.send = lambda channel, msg_type, content, parent, *a, **kw: kernel.sent.append(
        (channel, msg_type, content, parent["msg_id"]))
    gate = CommGate(kernel)
    frontend(gate, "comm_open", "c" * 32, target_name="jupyter.widget.control")
    assert kernel.sent == [("iopub", "comm_close", {"comm_id": "c" * 32, "data": {}}, "f-comm_open-" + "c" * 32)]
    frontend(gate, "comm_msg", "c" * 32)  # request_states, sent before the close reached the page
    frontend(gate, "comm_close", "c" * 32)
    frontend(gate, "comm_close", "d" * 32)  # a comm the box never had
    gate.flush(box)
    assert box.recorder.records == [] and gate.pending == [] and len(kernel.sent) == 1
    frontend(gate, "comm_msg", "c" * 32)  # once closed both ways, the id is unknown again: a fault
    frontend(gate, "comm_msg", "e" * 32)
    gate.flush(box)
    assert [(r["msg_type"], r["comm_id"], r["from"]) for r in box.recorder.records] == [
        ("comm_msg", "c" * 32, "frontend"), ("comm_msg", "e" * 32, "frontend")]
