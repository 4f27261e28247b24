"""What the Tracekit Box kernel forwards of a checked message from the box: rebuilt on the host, never relayed.

The box is hostile, and its headers are read by the frontend's client: jupyter_client parses a header's `date`, so a
date the box made up (`2024-13-45`) would crash nbclient, papermill or nbval. So the frontend never sees the box's
headers: each forwarded message gets a header made here (the host's msg_id, session, username, date and protocol
version; only the `msg_type`, checked by box_messages, is the box's), and as parent the stored header of the frontend
request the box's parent names (or `{}`): the box can neither break a client nor invent a parent.

A box's display ids are namespaced (`tkbox-BOX_ID-ID`), so an `update_display_data` from the box updates only that
box's own displays, never the host's (the run view) nor another box's. An `execute_reply`'s `user_expressions` are
never the box's: none was sent to it (only a cell's code is signed), so each key the frontend asked for is answered
as an error (`unsigned_expressions`), whatever the box's reply held there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..box_messages import BoxMessage
from ..box_outputs import box_display_id

MAX_PARENTS = 4096  # frontend requests whose headers are kept, newest last


def unsigned_expressions(names: list) -> dict:
    """The execute_reply's user_expressions: an error for each, as none is evaluated. Only a cell's code is decided and
    signed at the exec door, so an expression the frontend asks for would run in the box unsigned."""
    why = "user_expressions are not evaluated in a Tracekit box: only the cell's code is decided and signed"
    return {name: {"status": "error", "ename": "UnsignedExpression", "evalue": why, "traceback": [why]}
            for name in names}


class Parents:
    """The headers of the frontend's requests, by msg_id, the newest `MAX_PARENTS`."""

    def __init__(self, limit: int = MAX_PARENTS):
        self.limit = limit
        self._headers: OrderedDict[str, dict] = OrderedDict()

    def add(self, header: dict) -> None:
        msg_id = header.get("msg_id")
        if isinstance(msg_id, str):
            self._headers[msg_id] = header
            self._headers.move_to_end(msg_id)
            while len(self._headers) > self.limit:
                self._headers.popitem(last=False)

    def get(self, msg_id: Any) -> dict:
        return self._headers.get(msg_id, {}) if isinstance(msg_id, str) else {}


def rebuilt(msg: BoxMessage, header: dict, parents: Parents, box_id: str,
            asked: frozenset[str] | None = None) -> dict[str, Any]:
    """The message the frontend gets for `msg`: `header` made on the host (its msg_type the box's), the parent the
    frontend sent, the box's display ids namespaced, the user expressions asked for answered unevaluated."""
    content = msg.content
    if msg.msg_type in ("display_data", "update_display_data"):
        transient = content.get("transient")
        if isinstance(transient, dict) and "display_id" in transient:
            shown = box_display_id(box_id, str(transient["display_id"]))
            content = dict(content, transient=dict(transient, display_id=shown))
    elif msg.msg_type == "execute_reply" and ("user_expressions" in content or content.get("status") == "ok"):
        content = dict(content, user_expressions=unsigned_expressions(sorted(asked or ())))
    return {"header": header, "parent_header": parents.get(msg.parent_id), "metadata": msg.metadata,
            "content": content}
