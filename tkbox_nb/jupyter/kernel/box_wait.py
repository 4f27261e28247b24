"""A cell that waits for its box to start in the background (NotebookBox.start_early at the kernel's start or after
%box_restart, NotebookBox.start_for_cell for any other start: a retry, a changed policy, a bound secret,
TKBOX_EARLY_BOX=0, a VM slow to boot), with the kernel's control channel answered meanwhile (docs/jupyter.md, "A box
slow to start, or one that does not start")."""

from __future__ import annotations


def wait_for_box(kernel, channel: str, idents: list[bytes], header: dict, silent: bool) -> bool:
    """The cell waits for the box still starting in the background (a signer slow to answer, a VM), the control
    channel answered meanwhile: an interrupt, or a shutdown, ends the waiting cell, which then runs nothing (never
    decided, so not in the run). False when the cell was ended here. The cell's `busy` was published already."""
    control = kernel.sockets["control"]
    while kernel.nb.starting():
        if not control.poll(10):  # the start's end is seen within 10 ms: the cell goes on at once
            continue
        got = kernel.receive(control)
        if got is None:  # malformed, or a bad signature: not from our frontend
            continue
        c_idents, msg = got
        interrupt = msg["header"]["msg_type"] == "interrupt_request"
        if interrupt:
            kernel.send("control", "interrupt_reply", {"status": "ok"}, msg["header"], c_idents)
        else:
            kernel._dispatch("control", c_idents, msg)
        if interrupt or not kernel.running:
            kernel._host_reply(channel, idents, header, "error", silent, (
                "KeyboardInterrupt" if interrupt else "BoxEnded",
                f"{'interrupted' if interrupt else 'the kernel shut down'} while the box was starting: "
                "the cell did not run"))
            return False
    return True
