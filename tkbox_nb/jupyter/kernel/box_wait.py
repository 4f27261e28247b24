"""A cell that waits for its box to start in the background (NotebookBox.start_early at the kernel's start or after
%box_restart, NotebookBox.start_for_cell for any other start: a retry, a changed policy, a bound secret,
TKBOX_EARLY_BOX=0, a VM slow to boot), with the kernel's control channel answered meanwhile (docs/jupyter.md, "A box
slow to start, or one that does not start")."""

from __future__ import annotations

from tkbox_nb.jupyter.kernel.port import KernelPort


def wait_for_box(port: KernelPort, channel: str, idents: list[bytes], header: dict, silent: bool) -> bool:
    """The cell waits for the box still starting in the background (a signer slow to answer, a VM), the control
    channel answered meanwhile: an interrupt, or a shutdown, ends the waiting cell, which then runs nothing (never
    decided, so not in the run). False when the cell was ended here. The cell's `busy` was published already."""
    while port.nb.starting():
        if not port.ready(("control",), 10):  # the start's end is seen within 10 ms: the cell goes on at once
            continue
        handled = port.serve_control()  # an interrupt is answered there, a shutdown handled
        if handled is None:  # malformed, or a bad signature: not from our frontend
            continue
        interrupt = handled == "interrupt_request"
        if interrupt or not port.running:
            port.host_reply(channel, idents, header, "error", silent, (
                "KeyboardInterrupt" if interrupt else "BoxEnded",
                f"{'interrupted' if interrupt else 'the kernel shut down'} while the box was starting: "
                "the cell did not run"))
            return False
    return True
