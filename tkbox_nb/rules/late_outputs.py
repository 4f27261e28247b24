"""Late outputs: what the box's kernel sends naming a cell whose end is already signed (a background thread's
print, a display update), as a plain ipykernel would show it under that cell.

Nothing of it reaches the frontend unsigned: doors/cell.py holds each late output here (already checked and
sanitised by jupyter_messages, as a cell's outputs are), and signs the outputs held for a cell as one record (exec, kind
`late_output`, naming the cell's decision by its seq) at most every `FLUSH_S`, or at the next crossing, or as the box
stops, whichever comes first; only then are they forwarded. The box gets no unbounded way to make records: per cell
at most `MAX_CELL_MESSAGES` messages and `MAX_CELL_BYTES` of outputs are kept, per box `MAX_BOX_MESSAGES`; past
them a late output is dropped and counted, and the count is signed at the next crossing or as the box stops (never
on the timer), so a flood makes at most one record per cell per `FLUSH_S` while under the cap, and none after it.

Pure state with limits (sans-IO): the caller serialises access (BoxKernel's lock) and does the signing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FLUSH_S = 0.2
MAX_CELL_MESSAGES = 1000
MAX_CELL_BYTES = 1 << 20
MAX_BOX_MESSAGES = 10_000


@dataclass
class LateCell:
    seq: int | None  # the run_seq of the cell's signed decision
    messages: int = 0  # kept so far (signed or waiting)
    size: int = 0
    dropped: int = 0  # past a cap, not yet in a signed record
    waiting: list[Any] = field(default_factory=list)


@dataclass
class Batch:
    """What one record signs: the outputs kept for one cell since the last, and the drops not yet signed."""

    msg_id: str
    seq: int | None
    items: list[Any]
    dropped: int


class LateOutputs:
    def __init__(self, cell_messages: int = MAX_CELL_MESSAGES, cell_bytes: int = MAX_CELL_BYTES,
                 box_messages: int = MAX_BOX_MESSAGES):
        self.cell_messages, self.cell_bytes, self.box_messages = cell_messages, cell_bytes, box_messages
        self.cells: dict[str, LateCell] = {}
        self.kept = 0  # late messages kept in this box, all cells

    def cell_ended(self, msg_id: str, seq: int | None) -> None:
        """A cell's end was signed: what names it from now on is late."""
        self.cells.setdefault(msg_id, LateCell(seq))

    def add(self, msg_id: str, item: Any, size: int) -> bool:
        """Hold `item` (of `size` bytes) for the cell `msg_id`; False when it is dropped (past a cap, counted) or
        names no ended cell."""
        cell = self.cells.get(msg_id)
        if cell is None:
            return False
        if cell.messages >= self.cell_messages or cell.size + size > self.cell_bytes or self.kept >= self.box_messages:
            cell.dropped += 1
            return False
        cell.messages += 1
        cell.size += size
        self.kept += 1
        cell.waiting.append(item)
        return True

    def waiting(self) -> bool:
        return any(c.waiting for c in self.cells.values())

    def take(self, boundary: bool = False) -> list[Batch]:
        """The batches to sign now, in the order the cells ended: each cell's waiting outputs and, at a boundary (the
        next crossing, the box's stop), its drops not yet signed (a cell with only drops makes a record only then)."""
        out = []
        for msg_id, cell in self.cells.items():
            dropped = cell.dropped if boundary or cell.waiting else 0
            if cell.waiting or dropped:
                out.append(Batch(msg_id, cell.seq, cell.waiting, dropped))
                cell.waiting, cell.dropped = [], cell.dropped - dropped
        return out

    def discard(self) -> int:
        """Drop everything not yet signed (the box broke the protocol); the count of messages dropped so."""
        n = 0
        for cell in self.cells.values():
            n += len(cell.waiting) + cell.dropped
            cell.waiting, cell.dropped = [], 0
        return n
