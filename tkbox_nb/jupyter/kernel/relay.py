"""What the Tracekit Box kernel forwards of a checked message from the box: rebuilt on the host, never relayed.

The box is hostile, and its headers are read by the frontend's client: jupyter_client parses a header's `date`, so a
date the box made up (`2024-13-45`) would crash nbclient, papermill or nbval. So the frontend never sees the box's
headers: each forwarded message gets a header made here (the host's msg_id, session, username, date and protocol
version; only the `msg_type`, checked by jupyter_messages, is the box's), and as parent the stored header of the
frontend request the box's parent names: the box can neither break a client nor invent a parent.

Nor does the box ever see the frontend's headers, so it cannot name the frontend's other requests (a host cell's
`%box_status`, whose jupyter_client msg_id `<session>_<pid>_<counter>` is easy to guess): each request, comm message
and input reply goes into the box under a header made here (`Parents.into_box`: a random msg_id and the host's own
session), and `Parents` maps only those ids back to the frontend's headers. A box message whose parent is none of
them is dropped and counted (doors/cell.py), never forwarded.

A box's display ids are namespaced (`tkbox-BOX_ID-ID`), so an `update_display_data` from the box updates only that
box's own displays, never the host's (the run view) nor another box's. An `execute_reply`'s `user_expressions` are
the results the host kept and signed (doors/cell.py: rebuilt from an allowlist by jupyter_messages, for exactly the keys
sent, in the cell's signed end), and only for the keys the frontend asked for; a key with no result there is
answered as an error (`unevaluated`), never with anything else of the box's.
"""

from __future__ import annotations

import html
import uuid
from collections import OrderedDict
from typing import Any

from tkbox_nb.doors.cell import new_header
from tkbox_nb.rules.jupyter_messages import BoxMessage
from tkbox_nb.rules.output_sanitiser import box_display_id

MAX_PARENTS = 4096  # requests sent into the box whose frontend headers are kept, newest last


HOST_CELL = "not evaluated: this cell ran only host-side magics, nothing in the box"


NOTICE_MIME = "application/vnd.tkbox.notice+json"  # never passes the box's mimebundle allowlist (INERT)
NOTICE_STYLE = ("border-left:4px solid #c77700;background:#fff4e0;color:#222;padding:2px 8px;"
                "font-family:monospace;white-space:pre-wrap")


def host_notice(lines: list[str]) -> dict:
    """A `display_data` content for the host's own notice (`[tkbox] ...`): with a mark no output of the box can
    carry, its MIME type `NOTICE_MIME` (a box's display keeps only allowlisted types) and, as shown, an HTML block
    with an inline style (the box's HTML is sanitised of every `style`); its `text/plain` for the rest."""
    text = "".join(f"[tkbox] {line}\n" for line in lines)
    return {"data": {"text/plain": text.rstrip("\n"), NOTICE_MIME: {"notice": lines},
                     "text/html": f'<div style="{NOTICE_STYLE}">{html.escape(text.rstrip(chr(10)))}</div>'},
            "metadata": {}}


def unevaluated(names: list, why: str = HOST_CELL) -> dict:
    """An error for each of the user_expressions `names`, none evaluated (a cell of host-side magics only, or a key
    the box gave no signed result for)."""
    return {name: {"status": "error", "ename": "NotEvaluated", "evalue": why, "traceback": [why]} for name in names}


class Parents:
    """The frontend's messages the host sent into the box, by the msg_id the host made for each (the newest
    `MAX_PARENTS`): what the box's replies and outputs under that id are forwarded under."""

    def __init__(self, limit: int = MAX_PARENTS):
        self.limit = limit
        self.session = uuid.uuid4().hex  # the host's session toward the box: never the frontend's
        self._headers: OrderedDict[str, dict] = OrderedDict()

    def into_box(self, msg: dict, parent_header: dict | None = None, keep: bool = True) -> dict:
        """`msg` from the frontend as the box gets it: under a header made here (its msg_type the frontend's),
        `parent_header` (default none), its metadata, content and buffers as they came. `keep`: what the box sends
        under it goes to the frontend under `msg`'s header (an input reply asks the box for nothing: not kept)."""
        header = new_header(str(msg["header"].get("msg_type", "")), self.session)
        if keep:
            self._headers[header["msg_id"]] = msg["header"]
            while len(self._headers) > self.limit:
                self._headers.popitem(last=False)
        return dict(msg, header=header, parent_header=parent_header or {})

    def get(self, msg_id: Any) -> dict:
        """The frontend's header of the message the host sent into the box as `msg_id`, else `{}`."""
        return self._headers.get(msg_id, {}) if isinstance(msg_id, str) else {}


def rebuilt(msg: BoxMessage, header: dict, parents: Parents, box_id: str,
            asked: frozenset[str] | None = None) -> dict[str, Any]:
    """The message the frontend gets for `msg`: `header` made on the host (its msg_type the box's), the parent the
    frontend sent, the box's display ids namespaced, the user expressions asked for answered with the signed results
    (doors/cell.py set them in the reply), any other key dropped."""
    content = msg.content
    if msg.msg_type in ("display_data", "update_display_data"):
        transient = content.get("transient")
        if isinstance(transient, dict) and "display_id" in transient:
            shown = box_display_id(box_id, str(transient["display_id"]))
            content = dict(content, transient=dict(transient, display_id=shown))
    elif msg.msg_type in ("comm_open", "comm_msg"):
        content = output_ids_for_frontend(content, parents)
    elif msg.msg_type == "execute_reply" and ("user_expressions" in content or content.get("status") == "ok"):
        results = content.get("user_expressions") if isinstance(content.get("user_expressions"), dict) else {}
        missing = unevaluated([k for k in sorted(asked or ()) if k not in results],
                              "not evaluated: the box's reply has no signed result for it") \
            if content.get("status") == "ok" else {}  # as ipykernel: a cell that failed evaluates none
        content = dict(content, user_expressions={k: results[k] for k in sorted(asked or ()) if k in results} | missing)
    return {"header": header, "parent_header": parents.get(msg.parent_id), "metadata": msg.metadata,
            "content": content}


def output_ids_for_frontend(content: dict, parents: Parents) -> dict:
    """`content` of a checked widget message with each Output widget's `msg_id` (widget_state let through only ids of
    requests the box was sent, which are the host's ids toward the box) named as the frontend knows that request, so
    `with out:` still captures its outputs in the page; an id the host no longer maps becomes "" (capture nothing)."""
    data = content.get("data")
    if not isinstance(data, dict):
        return content

    def mapped(state: Any) -> Any:
        if not isinstance(state, dict) or not isinstance(state.get("msg_id"), str) or not state["msg_id"]:
            return state
        return dict(state, msg_id=str(parents.get(state["msg_id"]).get("msg_id", "")))

    if isinstance(data.get("state"), dict):
        data = dict(data, state=mapped(data["state"]))
    if isinstance(data.get("states"), dict):
        data = dict(data, states={k: dict(v, state=mapped(v.get("state"))) if isinstance(v, dict) else v
                                  for k, v in data["states"].items()})
    return dict(content, data=data)
