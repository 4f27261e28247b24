"""The exec transport: one request to the box and its answer, on a stream of its own, within one deadline.

The exec door (a command) and the patch door (the workspace's changes) ask the box the same way: open a stream with
the request, send its stdin and close the host's side, then take the box's data frames until it closes the stream
(its closing body is the answer), all within one deadline from before the stdin is sent, so a box that stops reading
cannot hold the host past it. A lost stream, a protocol violation, the deadline, or a box whose processes died while
the host waited ends the box fail-closed, and then this raises BoxEnded: the door that asked has nothing left to
decide. Doors reach it as `DoorContext.exchange`; the Box that composes them holds one ExecTransport and hands the
call on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from tkbox_nb.core.errors import BoxEnded
from tkbox_nb.guest import protocol as p
from tkbox_nb.stream.connection import StreamClosed
from tkbox_nb.stream.events import Close, Data, Lost

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext


class ExecTransport:
    """The exchanges of one box. `died()` says why the box's processes are gone (the backend's word), or None."""

    def __init__(self, box: "DoorContext", died: Callable[[], str | None]):
        self.box = box
        self.died = died

    def exchange(self, request: dict, timeout: float, on_data: Callable[[int, bytes], None],
                 stdin: bytes | None = None) -> dict:
        """Open one stream for `request`, send stdin and close our side, collect until the box closes it, all
        within `timeout`: one deadline for the whole exchange, stdin included. A lost stream or a protocol
        violation ends the box."""
        box = self.box
        deadline = time.monotonic() + timeout

        def timed_out() -> None:
            box.fail_closed(f"exec timed out after {timeout:g}s")
        try:
            stream = box.conn.open(request)
            if stdin:
                box.conn.send_data(stream.sid, p.CH_STDIN, stdin, deadline=deadline, on_deadline=timed_out)
            box.conn.close(stream.sid)
            return self._collect(stream, deadline, timeout, on_data)
        except (StreamClosed, OSError) as e:
            box.fail_closed(f"door stream lost: {e}")
        except p.ProtocolError as e:
            box.fail_closed(f"door protocol violation: {e}")
        raise BoxEnded(f"the box has ended: {box.ended}")

    def _collect(self, stream, deadline: float, timeout: float, on_data: Callable[[int, bytes], None]) -> dict:
        box = self.box
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                box.fail_closed(f"exec timed out after {timeout:g}s")
                raise BoxEnded(f"the box has ended: {box.ended}")
            try:
                event = stream.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check the box is still there
                died = self.died()
                if died:
                    box.fail_closed(died)
                if box.ended:
                    raise BoxEnded(f"the box has ended: {box.ended}") from None
                continue
            if isinstance(event, Data):
                on_data(event.channel, event.payload)
            elif isinstance(event, Close):
                return event.body
            else:
                reason = event.reason if isinstance(event, Lost) else f"not a door stream event: {event!r}"
                died = self.died()
                if died and not box.ended:
                    reason = died
                box.fail_closed(reason)
                raise BoxEnded(f"the box has ended: {box.ended}")
