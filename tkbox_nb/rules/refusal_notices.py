"""A crossing refused while a box runs, said where it happened: in the notebook cell that was running, or on `tkbox
run`'s stderr.

Before, a refusal was only in the run: `pip install` in a cell retried on `Tunnel connection failed: 403 Forbidden`
and the reason (`pypi.org:443 is not in [egress] allow`) was in the 403's body, which pip does not show. Now each
signed refusal of the doors a cell's code reaches (egress, secrets, model, patch, a command) is handed by the run's
recorder (`on_refused`) to `watch`, which makes one line naming what was refused, why, the rule and the signed record
(its number in the run, as the bundle shows it), from the signed statement, every character of the box's making
escaped (core/visible.py): the box cannot write the host's notice, and the kernel shows it with the host's mark
(relay.host_notice).

A flood is not shown as a flood: `Shown` lets the first `MAX_SHOWN` of a cell through and then one line saying the
rest are only counted (the run holds them all).
"""

from __future__ import annotations

import threading
from typing import Any

from tkbox_nb.core.visible import visible
from tkbox_nb.rules.door_table import BOX, EGRESS, EXEC, HOST, MODEL, PACKAGES, PATCH, SECRETS

MAX_SHOWN = 5
# refusals a cell shows already (its own decision, an error) or that are not the box's reaching out
NOT_SHOWN = {(EXEC, "cell"), (EXEC, "late_output"), (EXEC, "comm_fault"), (SECRETS, "bind")}


def _cut(value: Any, n: int = 120) -> str:
    text = visible(value)
    return text if len(text) <= n else text[:n] + "..."


def refusal_line(door: str, kind: str, args: dict[str, Any], seq: Any) -> str | None:
    """One line for a refused crossing (its signed statement `args`), or None for one not shown."""
    if (door, kind) in NOT_SHOWN or door in (HOST, BOX):
        return None
    if door == EGRESS:
        what = f"egress to {_cut(args.get('host'))}:{_cut(args.get('port'), 8)}"
    elif door == SECRETS:
        what = f"the secret {_cut(args.get('name'), 64)} ({_cut(kind, 16)}) toward {_cut(args.get('host'))}"
    elif door == MODEL:
        what = f"a model call to {_cut(args.get('provider'), 40)} ({_cut(args.get('model'), 60)})"
    elif door == PATCH:
        what = f"the patch file {_cut(args.get('path'))}" if kind == "file" else f"the patch ({_cut(kind, 16)})"
    elif door == PACKAGES:
        what = f"the package file {_cut(args.get('filename'))}" if kind == "file" else \
            f"the package {_cut(args.get('project'), 100)}"
    elif door == EXEC:
        argv = args.get("argv")
        what = f"the command {_cut(' '.join(map(str, argv)) if isinstance(argv, list) else argv)}"
    else:
        what = f"a {_cut(door, 16)} crossing ({_cut(kind, 16)})"
    why = _cut(args.get("verdict_reason") or "refused by the policy", 300)
    return f"{what} refused: {why} (rule {_cut(args.get('rule'), 60)}; signed, record {_cut(seq, 20)} of the run)"


class Shown:
    """How many refusals each cell (by a key) has shown: the first MAX_SHOWN pass, then one line, then none."""

    def __init__(self, limit: int = MAX_SHOWN):
        self.limit = limit
        self._counts: dict[Any, int] = {}
        self._lock = threading.Lock()

    def admit(self, key: Any, line: str) -> str | None:
        """The line to show for the next refusal of `key`, or None once the cell has shown its share."""
        with self._lock:
            if len(self._counts) > 64:  # old cells
                self._counts.clear()
            n = self._counts[key] = self._counts.get(key, 0) + 1
        if n <= self.limit:
            return line
        if n == self.limit + 1:
            return "more refusals in this cell are counted in the run, not shown here (%box_status, the bundle)"
        return None


def watch(recorder: Any, show: Any, skip: frozenset = frozenset()) -> None:
    """Hand each signed refusal of `recorder`'s run to `show(line)` (on the door's thread: `show` must be quick and
    thread-safe), less the (door, kind) in `skip` (said by the caller already). A failure here never reaches the
    door: the refusal stands, signed, whether or not it is shown."""
    def on_refused(door: str, kind: str, crossing: Any) -> None:
        if (door, kind) in skip:
            return
        try:
            line = refusal_line(door, kind, crossing.args, crossing.run_seq)
            if line is not None:
                show(line)
        except Exception:
            pass
    recorder.on_refused = on_refused
