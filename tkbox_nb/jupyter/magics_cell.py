"""A `%%box` cell of the IPython extension while it runs, and the names `%box_pull` never replaces.

The host kernel (a plain ipykernel) publishes whatever is written or displayed under the parent it has *now*: output
shown from another thread after the `%%box` cell stopped waiting (Ctrl-C) would land in whichever host cell runs
then, unmarked, and a box's `clear_output` would erase it. So the box's outputs are never shown from the box
kernel's reader thread: they are queued, and the cell's own thread (the one IPython runs the cell in, under the
cell's own parent) shows them while it waits. An interrupt of that wait interrupts the box's cell (SIGINT to the
box's kernel) and shows nothing more of it: what the box still sends for it is collected and signed with the cell,
or as its late output once it has ended (rules/late_outputs.py), as every output of the run is, and not shown in this
notebook (replay shows it under that cell).

`Box.execute` runs in a thread of its own, so the cell keeps being watched once the host stopped waiting: `[exec]
timeout_s` ends the box of a cell that outlives it (one that ignores its interrupt) on time, whether or not a later
cell comes.

`%box_pull` assigns into the host's namespace, where IPython keeps its own names (`__builtins__`, `get_ipython`,
`In`, `Out`, `exit`, `_`, `_i1`, ...): a value the box chose must never replace one of those. Refused: every name
IPython put in the namespace itself (`user_ns_hidden`), every name starting with `_` (Python's and IPython's own, the
output and input caches, and private by convention: none is a variable worth pulling), and the few IPython adds
under any shell. Python's builtins (`print`, `id`, `sum`) are not refused: naming one pulls a box variable of that
name, as assigning it in the notebook would.
"""

from __future__ import annotations

import keyword
import queue
import threading
from collections.abc import Callable
from typing import Any

from tkbox_nb.box.box import Box

HOST_NAMES = frozenset({"get_ipython", "In", "Out", "exit", "quit"})


def pull_refusal(name: str, hidden: dict[str, Any] | None = None) -> str | None:
    """Why `%box_pull` may not assign `name` in the host's namespace, or None. `hidden`: the shell's
    `user_ns_hidden` (the names IPython itself put there)."""
    if keyword.iskeyword(name):
        return "is a Python keyword"
    if name.startswith("_"):
        return "starts with _ (Python's and IPython's own names, the input and output caches)"
    if name in HOST_NAMES or name in (hidden or {}):
        return "is the host kernel's own name"
    return None


class BoxCell:
    """One `Box.execute` run in a thread of its own; `wait` shows its outputs from the caller's thread."""

    def __init__(self, box: Box, code: str, with_outputs: bool):
        self.box = box
        self.queue: queue.Queue = queue.Queue()
        self.showing = threading.Event()
        self.showing.set()
        on_output = self._collect if with_outputs else None
        threading.Thread(target=self._run, args=(code, on_output), daemon=True, name="tkbox-box-cell").start()

    def _collect(self, output: dict) -> None:
        """From the box kernel's reader thread: queued for the cell's thread, only while it still shows them."""
        if self.showing.is_set():
            self.queue.put(("output", output))

    def _run(self, code: str, on_output) -> None:
        try:  # Box.execute watches the cell ([exec] timeout_s, the box dying) until it ends, waited for or not
            self.queue.put(("ok", self.box.execute(code, on_output=on_output)))
        except BaseException as e:  # handed to the cell's thread, which raises it (or is gone: then it is dropped)
            self.queue.put(("error", e))

    def wait(self, show: Callable[[dict], None]) -> tuple[str, Any]:
        """Show the outputs as they come, in the caller's thread, until the cell ends: ("ok", CellResult) or
        ("error", the exception Box.execute raised). A KeyboardInterrupt here is the caller's to handle
        (`interrupt`)."""
        while True:
            try:
                kind, value = self.queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if kind == "output":
                show(value)
            else:
                return kind, value

    def interrupt(self) -> None:
        """The host stopped waiting: nothing more of the cell is shown, and the box's kernel gets an interrupt."""
        self.showing.clear()
        try:
            self.box.kernel().interrupt()
        except Exception:  # the box ended meanwhile: nothing left to interrupt
            pass
