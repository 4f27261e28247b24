"""Jupyter messages from the box's kernel, checked before anything on the host signs, records or forwards them.

A pure function (`check_box_message`) of one decoded message: hostile input, so every field the host reads is checked
for type and size. Three outcomes: the message is well-formed and passes (maybe with parts removed, each named in
`dropped`); its type is not one a kernel sends on that channel, and it is dropped whole; or it is malformed, which is
a `ProtocolError` that ends the box.

What is removed, and why (docs/threat-model.md, I14):
- Script in outputs (JavaScript, and HTML, SVG or Markdown that carry it) would run in the notebook's origin, where
  it could type host-side magics (a looser `%%box_policy`) into the kernel: only an allowlist of inert MIME types
  passes, HTML and Markdown sanitised, in outputs, the pager and widget state alike (rules/output_sanitiser.py,
  rules/widget_state.py, which also refuses links between widgets and keys no standard model has).
- An `input_request`'s prompt is shown with `[box] ` at the start of each line, so the box cannot fake the host's
  own password prompt (%box_secret).
- `execute_reply` payloads act on the frontend: each keeps its plain-ipykernel meaning except where it could act on
  the host's side (`_payload`): a `set_next_input` whose text names a host-side magic (say, a `%%box_policy` that
  loosens the policy) is dropped, `page` keeps its text/plain only, unknown sources are dropped.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from collections.abc import Container
from typing import Any

from tkbox_nb.rules import output_sanitiser as box_outputs
from tkbox_nb.rules import widget_state as box_widgets
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.guest.protocol import ProtocolError

CHANNEL_TYPES: dict[str, frozenset[str]] = {
    "iopub": frozenset({"status", "stream", "display_data", "update_display_data", "execute_input", "execute_result",
                        "error", "clear_output", "comm_open", "comm_msg", "comm_close"}),
    "shell": frozenset({"execute_reply", "complete_reply", "inspect_reply", "is_complete_reply", "history_reply",
                        "kernel_info_reply", "comm_info_reply"}),
    "control": frozenset({"shutdown_reply", "interrupt_reply", "kernel_info_reply"}),
    "stdin": frozenset({"input_request"}),
    "bridge": frozenset({"ready"}),
}
MESSAGE_KEYS = frozenset({"channel", "header", "parent_header", "metadata", "content", "buffers"})
HEADER_STR_LIMIT = 256
MAX_BUFFERS = 64
MAX_PAYLOADS = 16
MAX_NEXT_INPUT = 1 << 20
MAX_USER_EXPRESSIONS = 64  # a request's user_expressions, and a reply's results
MAX_EXPRESSION_CHARS = 4096  # one expression's text
MAX_EXPRESSION_NAME = 256  # one expression's name (its key)


def user_expressions_request(value: Any) -> dict[str, str]:
    """A frontend's (or a caller's) `user_expressions`, read strictly before anything is decided: names and
    expressions as text, at most MAX_USER_EXPRESSIONS of them, each within its limit; None or {} is none. Anything
    else is a TkboxError of one line, and nothing is decided or sent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TkboxError("user_expressions must map names to expressions (text)")
    if len(value) > MAX_USER_EXPRESSIONS:
        raise TkboxError(f"{len(value)} user_expressions asked, at most {MAX_USER_EXPRESSIONS}: none evaluated")
    for name, expr in value.items():
        if not isinstance(name, str) or not name or len(name) > MAX_EXPRESSION_NAME or "\x00" in name:
            raise TkboxError(f"a user_expressions name must be text of 1 to {MAX_EXPRESSION_NAME} characters")
        if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS or "\x00" in expr:
            raise TkboxError(f"user_expressions[{name[:40]!r}] must be text of at most {MAX_EXPRESSION_CHARS} "
                             "characters")
    return dict(value)


@dataclass
class BoxMessage:
    channel: str
    header: dict[str, Any]
    parent_header: dict[str, Any]
    metadata: dict[str, Any]
    content: dict[str, Any]
    buffers: list[bytes] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    unknown_comm: bool = False  # a comm_msg or comm_close naming no comm of the box's (when it was checked)
    refused: str | None = None  # why a comm message (a link's comm_open, a refused comm's later ones) is not forwarded

    @property
    def msg_type(self) -> str:
        return self.header["msg_type"]

    @property
    def parent_id(self) -> str | None:
        return self.parent_header.get("msg_id")

    def as_output(self) -> dict[str, Any] | None:
        """The nbformat output this message adds to a cell (or None). update_display_data and clear_output are kept
        as items of their own type, so a replay can apply them in order."""
        c, t = self.content, self.msg_type
        if t == "stream":
            return {"output_type": "stream", "name": c["name"], "text": c["text"]}
        if t in ("display_data", "update_display_data"):
            out = {"output_type": t, "data": c["data"], "metadata": c.get("metadata", {})}
            display_id = (c.get("transient") or {}).get("display_id")
            if isinstance(display_id, str):
                out["display_id"] = display_id
            return out
        if t == "execute_result":
            return {"output_type": t, "data": c["data"], "metadata": c.get("metadata", {}),
                    "execution_count": c["execution_count"]}
        if t == "error":
            return {"output_type": t, "ename": c["ename"], "evalue": c["evalue"], "traceback": c["traceback"]}
        if t == "clear_output":
            return {"output_type": t, "wait": bool(c.get("wait"))}
        return None

    def wire(self) -> dict[str, Any]:
        """The message as the host forwards it (without the channel and buffers)."""
        return {"header": self.header, "parent_header": self.parent_header, "metadata": self.metadata,
                "content": self.content}


def _fail(what: str) -> ProtocolError:
    return ProtocolError(f"a malformed kernel message: {what}")


def _str(value: Any, what: str, limit: int | None = HEADER_STR_LIMIT) -> str:
    if not isinstance(value, str) or (limit is not None and len(value) > limit) or "\x00" in value:
        raise _fail(what)
    return value


def _dict(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(f"{what} is not an object")
    return value


def _header(value: Any, what: str, required: bool) -> dict:
    h = _dict(value, what)
    if not h and not required:
        return h
    for key in ("msg_id", "msg_type"):
        _str(h.get(key), f"{what}.{key}")
    for key in ("session", "username", "date", "version"):
        if key in h:
            _str(h[key], f"{what}.{key}")
    return h


def _mimebundle(data: Any, what: str, dropped: list[str]) -> dict:
    data = _dict(data, what)
    for mime in data:
        _str(mime, f"{what} key")
    return box_outputs.mimebundle(data, what, dropped)


def check_box_message(raw: Any, comms: dict[str, str] | None = None,
                      requests: Container[str] = ()) -> BoxMessage | None:
    """The checked message, or None when its type is not one a kernel sends on its channel (dropped whole).
    `comms`: what each comm of the box is (`widget_state.widget_kind`), for the widget state a comm_msg carries;
    `requests`: the msg_ids of the requests the box was sent (the only ones an Output widget may capture)."""
    obj = _dict(raw, "message")
    if set(obj) != MESSAGE_KEYS:
        raise _fail(f"keys {sorted(obj)[:8]}")
    channel = obj["channel"]
    if not isinstance(channel, str) or channel not in CHANNEL_TYPES:
        raise _fail(f"channel {str(channel)[:40]!r}")
    if channel == "bridge":  # the bridge's own word (ready): only its type is read
        header = _dict(obj["header"], "header")
        _str(header.get("msg_type"), "header.msg_type")
    else:
        header = _header(obj["header"], "header", required=True)
    parent = _header(obj["parent_header"], "parent_header", required=False)
    metadata = _dict(obj["metadata"], "metadata")
    content = _dict(obj["content"], "content")
    if not isinstance(obj["buffers"], list) or len(obj["buffers"]) > MAX_BUFFERS:
        raise _fail("buffers")
    try:
        buffers = [base64.b64decode(_str(b, "buffer", None), validate=True) for b in obj["buffers"]]
    except (binascii.Error, ValueError):
        raise _fail("a buffer that is not base64") from None
    if header["msg_type"] not in CHANNEL_TYPES[channel]:
        return None
    msg = BoxMessage(channel, header, parent, metadata, content, buffers)
    _check_content(msg, comms, requests)
    return msg


def _check_content(m: BoxMessage, comms: dict[str, str] | None, requests: Container[str] = ()) -> None:
    c, t = m.content, m.msg_type
    if t == "status":
        if c.get("execution_state") not in ("busy", "idle", "starting"):
            raise _fail("status.execution_state")
    elif t == "stream":
        if c.get("name") not in ("stdout", "stderr"):
            raise _fail("stream.name")
        _str(c.get("text"), "stream.text", None)
    elif t in ("display_data", "update_display_data", "execute_result"):
        c["data"] = _mimebundle(c.get("data"), f"{t}.data", m.dropped)
        _dict(c.get("metadata", {}), f"{t}.metadata")
        if "transient" in c:
            _dict(c["transient"], f"{t}.transient")
        if t == "execute_result" and not _is_count(c.get("execution_count")):
            raise _fail("execute_result.execution_count")
    elif t == "execute_input":
        _str(c.get("code"), "execute_input.code", None)
    elif t == "error":
        _str(c.get("ename"), "error.ename", None)
        _str(c.get("evalue"), "error.evalue", None)
        if not (isinstance(c.get("traceback"), list) and all(isinstance(x, str) for x in c["traceback"])):
            raise _fail("error.traceback")
    elif t == "clear_output":
        if not isinstance(c.get("wait", False), bool):
            raise _fail("clear_output.wait")
    elif t in ("comm_open", "comm_msg", "comm_close"):
        _str(c.get("comm_id"), f"{t}.comm_id")
        data = _dict(c.get("data", {}), f"{t}.data")
        if t == "comm_open":
            _str(c.get("target_name"), "comm_open.target_name")
        state = data.get("state")
        m.unknown_comm = comms is not None and t != "comm_open" and c["comm_id"] not in comms
        known = (comms or {}).get(c["comm_id"], "") if t != "comm_open" else ""
        m.refused = "a comm refused before" if known == box_widgets.REFUSED else \
            box_widgets.refusal(state) if t == "comm_open" and isinstance(state, dict) else None
        if m.refused is not None:  # never forwarded: named in the cell's signed result
            m.dropped.append(f"{t} ({m.refused})")
            return
        kind = box_widgets.widget_kind(known, state)  # what the comm was and this message asks it to be
        if t != "comm_open":  # the frontend keeps the state sent before, unchecked for a kind the comm was not
            box_widgets.widget_names(known, state, f"{t}.data.state", m.dropped)
        # sanitised as what it asks to be; its keys, those of the models it may be (its names left after the above)
        models = box_widgets.widget_kind(known, state)
        box_widgets.widget_state(kind, state, f"{t}.data.state", m.dropped, requests, models)
        if isinstance(state, dict) and "buffer_paths" in data:
            m.buffers = box_widgets.widget_buffers(kind, data, m.buffers, f"{t}.data", m.dropped, models)
        if t == "comm_msg" and data.get("method") == "update_states":  # the control comm: every widget's state
            m.buffers = box_widgets.control_states(data, m.buffers, f"{t}.data", m.dropped, requests, comms)
    elif t == "execute_reply":
        if c.get("status") not in ("ok", "error", "aborted"):
            raise _fail("execute_reply.status")
        if "execution_count" in c and c["execution_count"] is not None and not _is_count(c["execution_count"]):
            raise _fail("execute_reply.execution_count")
        payloads = c.get("payload", [])
        if not isinstance(payloads, list) or len(payloads) > MAX_PAYLOADS:
            raise _fail("execute_reply.payload")
        m.content = _execute_reply(c, payloads, m.dropped)
    elif t == "input_request":
        c["prompt"] = box_outputs.box_prompt(_str(c.get("prompt"), "input_request.prompt", 4096))
        if not isinstance(c.get("password", False), bool):
            raise _fail("input_request.password")
    elif t in SHELL_REPLIES:
        if t == "complete_reply" and c.get("status") == "ok" and not (
                isinstance(c.get("matches"), list) and all(isinstance(x, str) for x in c["matches"])):
            raise _fail("complete_reply.matches")
        m.content = SHELL_REPLIES[t](c, m.dropped)


# -- shell replies: rebuilt from an allowlist, so nothing the box adds reaches the frontend unchecked (I14) -----------
def _error(c: dict, status: str = "error") -> dict[str, Any]:
    tb = c.get("traceback")
    return {"status": status, "ename": _text(c.get("ename")), "evalue": _text(c.get("evalue")),
            "traceback": [x for x in tb if isinstance(x, str)] if isinstance(tb, list) else []}


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _execute_reply(c: dict, payloads: list, dropped: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = _error(c) if c["status"] == "error" else {"status": c["status"]}
    out["execution_count"] = c.get("execution_count")
    out["payload"] = [p for p in (_payload(item, dropped) for item in payloads) if p is not None]
    exprs = c.get("user_expressions", {})
    out["user_expressions"] = {}
    if not isinstance(exprs, dict):
        dropped.append("execute_reply.user_expressions (not an object)")
        return out
    for key, value in list(exprs.items())[:MAX_USER_EXPRESSIONS]:
        value = value if isinstance(value, dict) else {}
        what = f"execute_reply.user_expressions[{str(key)[:40]}]"
        if not isinstance(key, str) or len(key) > MAX_EXPRESSION_NAME:
            dropped.append("execute_reply.user_expressions (a name that is not one asked)")
        elif value.get("status") == "ok" and isinstance(value.get("data"), dict):
            out["user_expressions"][key] = {"status": "ok", "data": _mimebundle(value["data"], what, dropped),
                                            "metadata": {}}
        elif value.get("status") == "error" and isinstance(value.get("ename"), str) \
                and isinstance(value.get("evalue"), str):
            out["user_expressions"][key] = _error(value)
        else:
            dropped.append(what)
    if len(exprs) > MAX_USER_EXPRESSIONS:
        dropped.append("execute_reply.user_expressions (past the first 64)")
    return out


def _inspect_reply(c: dict, dropped: list[str]) -> dict[str, Any]:
    if c.get("status") != "ok":
        return _error(c)
    data = c.get("data", {})
    return {"status": "ok", "found": c.get("found") is True,
            "data": _mimebundle(data, "inspect_reply.data", dropped) if isinstance(data, dict) else {},
            "metadata": {}}


def _complete_reply(c: dict, dropped: list[str]) -> dict[str, Any]:
    if c.get("status") != "ok":
        return _error(c)
    meta = c.get("metadata") if isinstance(c.get("metadata"), dict) else {}
    types = meta.get("_jupyter_types_experimental")
    kept = [{k: v for k, v in x.items() if k in ("start", "end", "text", "type", "signature")
             and (isinstance(v, str) if k in ("text", "type", "signature") else _is_int(v))}
            for x in (types if isinstance(types, list) else []) if isinstance(x, dict)]
    if set(meta) - {"_jupyter_types_experimental"}:
        dropped.append("complete_reply.metadata")
    out = {"status": "ok", "matches": list(c["matches"]), "metadata": {"_jupyter_types_experimental": kept}
           if kept else {}}
    for key in ("cursor_start", "cursor_end"):
        out[key] = c.get(key) if _is_int(c.get(key)) else 0
    return out


def _history_reply(c: dict, dropped: list[str]) -> dict[str, Any]:
    if c.get("status") != "ok":
        return _error(c)
    items = c.get("history") if isinstance(c.get("history"), list) else []
    kept = []
    for x in items:
        if isinstance(x, list) and len(x) == 3 and _is_int(x[0]) and _is_int(x[1]) and (
                isinstance(x[2], str) or (isinstance(x[2], list) and len(x[2]) == 2 and isinstance(x[2][0], str)
                                          and (x[2][1] is None or isinstance(x[2][1], str)))):
            kept.append(x)
    if len(kept) != len(items):
        dropped.append("history_reply.history")
    return {"status": "ok", "history": kept}


def _is_complete_reply(c: dict, dropped: list[str]) -> dict[str, Any]:
    status = c.get("status") if c.get("status") in ("complete", "incomplete", "invalid", "unknown") else "unknown"
    out: dict[str, Any] = {"status": status}
    if status == "incomplete":
        out["indent"] = c.get("indent") if isinstance(c.get("indent"), str) and len(c["indent"]) <= 256 else ""
    return out


def _comm_info_reply(c: dict, dropped: list[str]) -> dict[str, Any]:
    comms = c.get("comms") if isinstance(c.get("comms"), dict) else {}
    return {"status": "ok", "comms": {k: {"target_name": v["target_name"]} for k, v in comms.items()
                                      if isinstance(v, dict) and isinstance(v.get("target_name"), str)}}


SHELL_REPLIES = {"inspect_reply": _inspect_reply, "complete_reply": _complete_reply,
                 "history_reply": _history_reply, "is_complete_reply": _is_complete_reply,
                 "comm_info_reply": _comm_info_reply}


def _payload(item: Any, dropped: list[str]) -> dict[str, Any] | None:
    """One `execute_reply` payload as the frontend may see it, or None (named in `dropped`). Each keeps the meaning a
    plain ipykernel gives it, except where it could act on the host's side of the notebook:
    - `page` (the `obj?` pager): its text/plain only; rich data could carry markup into the page.
    - `set_next_input`: passes, unless its text names a host-side magic (`%box...`, `%%box...`): a box must not put
      a cell in front of the user that, run, would loosen its own policy or bind a secret.
    - `ask_exit`: passes (the box's own `exit`); the frontend asks the user, and a restart is a new box and run.
    Any other source (`edit_magic`, unknown ones) is dropped."""
    source = item.get("source") if isinstance(item, dict) else None
    if source == "page" and isinstance(item.get("data"), dict) and isinstance(item["data"].get("text/plain"), str):
        if set(item["data"]) - {"text/plain"}:
            dropped.append("execute_reply.payload:page rich data")
        return {"source": "page", "data": {"text/plain": item["data"]["text/plain"]},
                "start": item.get("start", 0) if _is_int(item.get("start", 0)) else 0}
    if source == "set_next_input" and isinstance(item.get("text"), str) and len(item["text"]) <= MAX_NEXT_INPUT \
            and isinstance(item.get("replace", False), bool):
        if names_host_magic(item["text"]):
            dropped.append("execute_reply.payload:set_next_input naming a host magic")
            return None
        return {"source": "set_next_input", "text": item["text"], "replace": item.get("replace", False)}
    if source == "ask_exit" and isinstance(item.get("keepkernel", False), bool):
        return {"source": "ask_exit", "keepkernel": item.get("keepkernel", False)}
    dropped.append(f"execute_reply.payload:{str(source)[:40]}")
    return None


def names_host_magic(text: str) -> bool:
    """Whether any line of `text` starts a host-side magic (the kernel's `%box_*`, the extension's `%%box`)."""
    return any(line.lstrip().startswith(("%box", "%%box")) for line in text.splitlines())


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v: Any) -> bool:
    """An execution count: signed in the cell's result, so within what the signer takes (not 2**60)."""
    return _is_int(v) and -(1 << 31) < v < 1 << 31
