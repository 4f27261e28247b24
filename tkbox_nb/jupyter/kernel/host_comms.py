"""The host side's own comms: widgets made in the Tracekit Box kernel's host process (the run view of `%box_view`).

The frontend sees one kernel, but two comm managers stand behind it: the box's (the ipykernel in the box, reached
through the exec door) and this one. Their ids are kept apart by the kernel (comms.py): a message from the frontend
naming a comm of this manager is handled here and never reaches the box; one naming a comm the box holds goes to the
box; any other is refused and signed as a fault. The box never sees a host comm's messages (they go out on the
frontend's iopub only), and a box message naming a host comm ends the box.

ipywidgets makes its comms through the `comm` package's `create_comm` and `get_comm_manager`, which `install` points
at this manager when the kernel starts (the host process runs no IPython kernel of its own); making a HostComms
changes nothing of the process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import comm
from comm.base_comm import BaseComm, CommManager

Publish = Callable[[str, dict, dict, list], None]  # (msg_type, content, metadata, buffers) onto the frontend's iopub


class HostComm(BaseComm):
    """One comm of the host process; what it sends goes to the frontend only."""

    def __init__(self, *args: Any, publish: Publish, **kwargs: Any):
        self._publish = publish
        super().__init__(*args, **kwargs)

    def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None, buffers: Any = None,
                    **keys: Any) -> None:
        content = {"data": {} if data is None else data, "comm_id": self.comm_id, **keys}
        self._publish(msg_type, content, metadata or {}, list(buffers or []))


class HostComms:
    """The host process's comm manager, installed as the `comm` package's."""

    def __init__(self, publish: Publish):
        self.manager = CommManager()
        self._publish = publish

    def install(self) -> None:
        comm.create_comm = self.create
        comm.get_comm_manager = lambda: self.manager

    def create(self, **kwargs: Any) -> HostComm:
        return HostComm(publish=self._publish, **kwargs)

    def owns(self, comm_id: Any) -> bool:
        return isinstance(comm_id, str) and comm_id in self.manager.comms

    def info(self) -> dict[str, dict[str, str]]:
        return {cid: {"target_name": c.target_name} for cid, c in self.manager.comms.items()}

    def handle(self, msg: dict) -> None:
        """A comm_msg or comm_close from the frontend for one of this process's comms."""
        if msg["header"]["msg_type"] == "comm_msg":
            self.manager.comm_msg(None, None, msg)
        elif msg["header"]["msg_type"] == "comm_close":
            self.manager.comm_close(None, None, msg)
