"""What the host end of the door stream hands the reader of one stream: one small class per kind of event.

They were tuples tagged with strings (`("data", channel, payload)`, `("close", body)`, `("violation", reason)`), and
every reader compared the tag with a string of its own: a misspelt tag (`event[0] == "dta"`) is a comparison that is
never true, so the event silently took the other branch, and a reader of the wrong tuple's fields got another field.
A misspelt class is a name that does not exist, which the linter (and the first event) reports; a field read off the
wrong event is an AttributeError, not another field's value. The stream's queue takes only these three
(`connection._Events`), so nothing else reaches a reader.

The set is closed: every stream's events are some `Data`, then at most one `Close` or one `Lost`, its last. A reader
that takes anything but `Data` as the stream's end (the doors do) keeps failing closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True)
class Data:
    """A DATA frame's payload on one of the stream's channels (`guest/protocol.py` CH_*). A small payload is a
    bytearray that the queue joins later small frames of the same channel onto while it waits unread, so it is read
    only once taken from the queue."""
    channel: int
    payload: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Close:
    """The box's CLOSE of the stream: it sends no more on it. `body` is the frame's JSON object (a command's result,
    the kernel's error; `{}` when the frame had none)."""
    body: dict


@dataclass(frozen=True, slots=True)
class Lost:
    """The door stream ended under the stream before the box closed it: a violation (its reason) or the box gone."""
    reason: str


Event = Union[Data, Close, Lost]
EVENTS = (Data, Close, Lost)
