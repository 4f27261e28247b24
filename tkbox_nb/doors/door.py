"""Door: what each door offers the Box that composes it, so that starting and ending the doors is a loop.

A Box asks each door, in its order, for what the box's environment needs from it (`env`, before the box's processes
start), starts each once they are spawned (`start`: a door's own step at the box's start, e.g. the egress door signs
the secret bindings, the model door reads the providers' keys), and at the box's stop, once its processes are killed
and its door stream shut, ends each (`stop`) in the reverse order, and then the box's kernel (the cell door, which is
started on first use and so is not in that order), each even if one before it failed, before the run is closed: what
a door still holds open (a relayed connection, a cell in flight) is ended and its end signed while the run can still
sign it. What a door sees of its box is the DoorContext (doors/context.py); Door is the other side, what the box sees
of a door.

A door that needs none of a step may subclass Door and so have it do nothing; the Protocol names exactly these four.
"""

from __future__ import annotations

from typing import Iterable, Protocol


class Door(Protocol):
    """One door of a box, as the box starts and ends it."""

    name: str  # the door's name in the run's records ("exec", "egress", "model", "patch", "cell")

    def env(self) -> dict[str, str]:
        """What the box's environment needs from this door (empty: nothing), read before the box starts; a later
        door's setting of the same name wins."""
        return {}

    def start(self) -> None:
        """The door's own step at the box's start, once its processes are spawned and before its door stream opens;
        what it raises stops the box's start (the run closed, saying why)."""

    def stop(self, reason: str) -> None:
        """End what the door still holds, each end signed, before the run closes; `reason` is why the box ended."""


def environment(doors: "Iterable[Door]") -> dict[str, str]:
    """The box's environment from its doors, in their order: a later door's setting of a name wins (the model
    door's NO_PROXY, its endpoint on loopback, over the egress door's empty one)."""
    env: dict[str, str] = {}
    for door in doors:
        env.update(door.env())
    return env


def stop_all(doors: "Iterable[Door | None]", reason: str) -> None:
    """End each door in the order given, each even if one before it failed (an interruption included), and raise
    the first failure once all have ended: a door that fails to end never keeps the next from ending, signed."""
    failed: BaseException | None = None
    for door in doors:
        if door is None:
            continue
        try:
            door.stop(reason)
        except BaseException as e:
            failed = failed or e
    if failed is not None:
        raise failed
