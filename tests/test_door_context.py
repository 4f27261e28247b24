"""The doors see the box only through DoorContext (doors/context.py), and Box provides all of it.

Checked on the source, as test_layers.py is: a door that reached for something else of the box (a private helper,
the backend, the kernel) would type-check against nothing at run time, so the check is what keeps the interface
the whole of what a door may use.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tests.source_scan import attributes_of, set_in
from tkbox_nb.box.box import Box
from tkbox_nb.doors.context import DoorContext

PACKAGE = Path(__file__).resolve().parent.parent / "tkbox_nb"
DOORS = ["doors/egress.py", "doors/exec.py", "doors/intercept.py", "doors/model.py", "doors/patch.py", "doors/cell.py",
         "doors/exec_transport.py", "doors/packages.py"]
MEMBERS = set(DoorContext.__annotations__) | {
    name for name, value in vars(DoorContext).items() if inspect.isfunction(value) and not name.startswith("_")}


def used_of_the_box(path: Path) -> set[str]:
    """Each attribute read off the box in a door: `box.X`, and `self.box.X` in its classes."""
    return attributes_of(path.read_text(), "box", str(path))


def test_the_interface_is_what_the_doors_were_given():
    assert MEMBERS == {"box_id", "policy", "bindings", "ca", "workspace", "recorder", "conn", "ended",
                       "fail_closed", "exchange", "memory_kills"}


@pytest.mark.parametrize("door", DOORS)
def test_a_door_uses_only_door_context(door):
    used = used_of_the_box(PACKAGE / door)
    assert used, f"{door} reads nothing off its box: the walk missed its name for it"
    assert used - MEMBERS == set(), f"{door} reaches past DoorContext"


def test_box_provides_every_member():
    """Methods on the class; attributes as Box.__init__ sets them (a Box is the context of its doors)."""
    assigned = set_in(Box.__init__)
    missing = {m for m in MEMBERS if not callable(getattr(Box, m, None)) and m not in assigned}
    assert missing == set()
    for name in ("fail_closed", "exchange"):
        assert list(inspect.signature(getattr(Box, name)).parameters) == \
            list(inspect.signature(getattr(DoorContext, name)).parameters)
