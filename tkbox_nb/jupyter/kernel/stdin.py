"""The stdin channel of the Tracekit Box kernel: the host's own prompt (`%box_secret`) and the box's prompts.

A secret typed into the host's password prompt must never reach the box. So each `input_reply` is matched to the
prompt it answers by its `parent_header.msg_id`:
- the host's prompt takes only the reply naming its own input_request; the ids of the host's prompts are kept
  (answered, interrupted or timed out alike), and a reply naming one is never forwarded to the box;
- a reply goes to the box only when it answers an input_request the box sent that is still pending (the box's
  prompt is forwarded under a header made on the host, jupyter/kernel/relay.py; the reply goes in under the box's own);
- any other reply is dropped.
A reply with no parent (jupyter_client's `input()`, jupyter_console) answers the host's prompt whenever one waits,
whatever prompts of the box are pending (the box can keep one pending by asking under a request it never answers);
with no host prompt waiting, it answers the box's prompt if exactly one is pending; but once a host prompt has gone
unanswered (interrupted, timed out), the next parentless reply may be its late answer, the secret: it is dropped,
never forwarded to the box.

While the host's prompt waits (at most `PROMPT_TIMEOUT_S`), the control channel is served (an interrupt or a
shutdown ends the wait, and the magic, without a secret) and the exec deadlines are enforced.
"""

from __future__ import annotations

import time

from tkbox_nb.rules.output_sanitiser import BOX_PROMPT
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.jupyter.kernel.port import KernelPort

PROMPT_TIMEOUT_S = 300.0
MAX_HOST_PROMPTS = 4096


class Stdin:
    def __init__(self, port: KernelPort):
        self.port = port  # the kernel (app.py), only through KernelPort
        self.host_prompts: set[str] = set()  # msg_ids of the host's own input_requests, never the box's business
        self.box_prompts: dict[str, tuple[dict, str]] = {}  # msg_id the frontend saw -> (the box's header, request)
        self.unanswered = False  # a host prompt ended unanswered: the next parentless reply may be its answer

    # -- the box's prompts -----------------------------------------------------------------------------------------
    def box_prompt(self, sent_id: str, box_header: dict, request_id: str) -> None:
        """The box's input_request, for the frontend's request `request_id`, went to the frontend as `sent_id`."""
        self.box_prompts[sent_id] = (box_header, request_id)
        while len(self.box_prompts) > 64:  # a box cannot make this grow: only its latest prompts are answerable
            self.box_prompts.pop(next(iter(self.box_prompts)))

    def box_ended(self) -> None:
        self.box_prompts.clear()

    def _pending(self) -> list[str]:
        """The box's prompts still pending: of a request the box has not answered yet."""
        for sent_id, (_, request_id) in list(self.box_prompts.items()):
            if not self.port.request_open(request_id):
                del self.box_prompts[sent_id]
        return list(self.box_prompts)

    def from_frontend(self, msg: dict) -> None:
        """An input_reply outside the host's prompt: to the box only if it answers the box's pending prompt."""
        if msg["header"].get("msg_type") != "input_reply":
            return
        parent = (msg.get("parent_header") or {}).get("msg_id")
        pending = self._pending()
        if not parent:  # no parent: the one prompt pending, unless it may be a host prompt's late answer
            if self.unanswered:
                self.unanswered = False
                return
            parent = pending[0] if len(pending) == 1 else None
        if isinstance(parent, str) and parent in self.host_prompts:
            self.unanswered = False  # the late answer to a host prompt, dropped here
            return
        if not isinstance(parent, str) or parent not in pending:
            return
        box_header = self.box_prompts.pop(parent)[0]
        port = self.port
        box_kernel = port.box_kernel
        if box_kernel is not None and not box_kernel.ended:
            value = str(msg["content"].get("value", ""))
            reply = {"header": msg["header"], "metadata": {}, "content": {"value": value}}
            box_kernel.send("stdin", port.into_box(reply, parent_header=box_header, keep=False))  # header made here

    # -- the host's prompt -----------------------------------------------------------------------------------------
    def read_secret(self, prompt: str, cell: tuple[list[bytes], dict, bool] | None) -> str:
        """The host's password prompt for the cell whose magic asks (Cells.host: idents, header, allow_stdin)."""
        if cell is None or not cell[2]:
            raise TkboxError("%box_secret: this frontend takes no input (allow_stdin is false); "
                             "use --env VAR to read the value from the host's environment")
        idents, header, _ = cell
        while prompt.startswith(BOX_PROMPT):  # the box's mark: a host prompt never wears it
            prompt = prompt[len(BOX_PROMPT):]
        request = self.port.send("stdin", "input_request", {"prompt": prompt, "password": True}, header, idents)
        own = request["header"]["msg_id"]  # kept before any reply is read (_wait)
        self.host_prompts.add(own)
        if len(self.host_prompts) > MAX_HOST_PROMPTS:  # a frontend's replies to the oldest come no more
            self.host_prompts.discard(next(iter(self.host_prompts)))
        try:
            value = self._wait(own, time.monotonic() + PROMPT_TIMEOUT_S)
        except BaseException:
            self.unanswered = True
            raise
        self.unanswered = False
        return value

    def _wait(self, own: str, deadline: float) -> str:
        port = self.port
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TkboxError("%box_secret: no answer to the prompt")
            ready = port.ready(("stdin", "control"), min(left, 0.5) * 1000)
            if not port.running:  # SIGTERM: the kernel is ending
                raise TkboxError("%box_secret: the kernel shut down; no secret was bound")
            port.check_deadlines()
            if "control" in ready:
                self._control()
            if "stdin" in ready:
                got = port.receive("stdin")
                if got is None:
                    continue
                reply = got[1]
                parent = (reply.get("parent_header") or {}).get("msg_id")
                if reply["header"].get("msg_type") == "input_reply" and (parent == own or not parent):
                    return str(reply["content"].get("value", ""))  # parentless: the host's, never the box's
                self.from_frontend(reply)

    def _control(self) -> None:
        """A control message while the host's prompt waits: an interrupt or a shutdown ends the wait."""
        handled = self.port.serve_control()  # an interrupt answered there: no cell runs in the box meanwhile
        if handled is None:
            return
        if handled == "interrupt_request":
            raise TkboxError("%box_secret: interrupted; no secret was bound")
        if not self.port.running:
            raise TkboxError("%box_secret: the kernel shut down; no secret was bound")
