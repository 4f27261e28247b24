"""What the Tracekit Box kernel's helpers may use of the kernel: `KernelPort`, which `TkboxKernel` (app.py) provides.

The kernel is the one place that holds the frontend's sockets and key, the box's kernel, the requests open in the box
and the ids the host made for them (relay.Parents). Its helpers (cells.py, comms.py, stdin.py, box_wait.py) each keep
their own state and reach the kernel only through this port: send on a frontend channel, answer a cell here, wait on
the frontend while a cell waits on the host, send into the box under a header made here, end a box that broke the
protocol. A helper that reached past it (a private method, a field to assign) would tie its correctness to the
kernel's inside; tests/test_kernel_port.py checks on the source that none does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tkbox_nb.box.box import Box
    from tkbox_nb.box.notebook_box import NotebookBox
    from tkbox_nb.doors.cell import BoxKernel


class KernelPort(Protocol):
    @property
    def nb(self) -> NotebookBox:
        """The notebook's box (started, starting or none), and the host magics' state."""

    @property
    def running(self) -> bool:
        """False once the kernel is shutting down (a shutdown_request, SIGTERM)."""

    @property
    def box_kernel(self) -> BoxKernel | None:
        """The box's kernel whose messages are relayed now (it may have ended), else None."""

    def send(self, channel: str, msg_type: str, content: dict, parent: dict | None, idents: Any = None,
             metadata: dict | None = None, buffers: list | None = None) -> dict:
        """A message made and signed here onto a frontend channel (`idents`: its routing); the message sent."""

    def publish_status(self, state: str, parent: dict | None) -> None:
        """`busy`, `idle` on iopub, under the frontend's `parent`."""

    def host_reply(self, channel: str, idents: list[bytes], header: dict, status: str, silent: bool,
                   error: tuple | None = None) -> None:
        """An execute_request answered here, not by the box: its error shown, its execute_reply, its idle."""

    def log(self, text: str) -> None:
        """A line on the kernel's stderr."""

    def ready(self, channels: Iterable[str], timeout_ms: float) -> set[str]:
        """Which of the frontend's `channels` have a message waiting, within `timeout_ms`."""

    def receive(self, channel: str) -> tuple[list[bytes], dict] | None:
        """The next message on a frontend channel, and its identities; None if malformed or badly signed."""

    def serve_control(self) -> str | None:
        """One message of the control channel handled while a cell waits on the host; its msg_type, or None."""

    def check_deadlines(self) -> None:
        """The exec door's deadlines of the cells in the box enforced now."""

    def into_box(self, msg: dict, parent_header: dict | None = None, keep: bool = True) -> dict:
        """`msg` from the frontend as the box gets it, under a header made here (relay.Parents.into_box)."""

    def attach(self, box: Box) -> BoxKernel:
        """`box`'s kernel, from now the one whose messages are relayed."""

    def open_request(self, sent_id: str, channel: str, idents: list[bytes], header: dict) -> None:
        """A request sent into the box as `sent_id`: its reply goes to the frontend on `channel`, under `header`."""

    def request_open(self, sent_id: Any) -> bool:
        """Whether the request sent into the box as `sent_id` is still waiting for its reply."""

    def protocol_violation(self, why: str) -> None:
        """The box broke the protocol: it is ended (`why` signed), and nothing more of it reaches the frontend."""
