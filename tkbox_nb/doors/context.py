"""DoorContext: all a door sees of the box it serves.

A door (egress, intercept, model, patch, and the host end of the box's kernel) needs the box's facts (its policy,
its secret bindings, its CA, its host workspace), the run's recorder to sign its crossings on, the door stream to
answer on, and a way to end the box fail-closed. This Protocol names exactly those, and nothing else of `Box`, so a
door can be read, tested and added without box/box.py, and box/box.py can change without its doors: `Box` provides them
(a Box is a DoorContext) and composes the doors; the doors never import box/box.py.

It sits in the doors layer and imports only lower layers, and those only as types.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from tkbox_nb.stream.connection import HostConnection
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    from tkbox_nb.rules.box_ca import BoxCA
    from tkbox_nb.rules.secrets import Binding


class DoorContext(Protocol):
    """The box as its doors see it. The attributes are read, never set, by a door."""

    box_id: str                      # the box's id (the kernel's Jupyter session)
    policy: "Policy"                 # the box policy every crossing is decided under
    bindings: "list[Binding]"        # the box's secret bindings (values read on the host; never sent in)
    ca: "BoxCA | None"               # the per-box CA the secrets door terminates TLS with (None: no bindings)
    workspace: Path | None           # the host workspace a patch is applied to (None: the box has none)
    recorder: "RunRecorder | None"   # the run: every crossing is decided, then completed, on it
    conn: "HostConnection | None"    # the door stream: each crossing's bytes go back on its own stream
    ended: str | None                # why the box ended, once it has (then nothing more is decided)

    def fail_closed(self, reason: str) -> None:
        """End the box now; `reason` becomes the run's last word. What a door does on a protocol violation or a
        lost signer: a door never carries on for a box it cannot trust or sign for."""

    def memory_kills(self) -> int:
        """How many of the box's processes the host has killed for its memory limit (the host's count, never the
        box's word): a command's result says `killed_by` only when this grew while it ran."""

    def exchange(self, request: dict, timeout: float, on_data: Callable[[int, bytes], None],
                 stdin: bytes | None = None) -> dict:
        """Open one stream to the box for `request`, send `stdin`, and collect its answer until the box closes the
        stream (its closing body is returned). A lost stream, a violation or the timeout ends the box, and then
        this raises: the door that asked has nothing left to decide."""
