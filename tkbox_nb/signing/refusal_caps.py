"""Bounded records for what a box causes but is not granted: each door's refusals in a run, capped, then counted.

A box can ask as often as it likes, and each refusal the host signs one by one is a record in the signer's store, a
line of the run's disclosures and bytes of its bundle: 32 threads opening refused CONNECTs for 8 minutes made 202,280
records (the signer's store 315 MB, its memory 355 MB, the bundle near the 512 MiB it may hold, past which the run
has none). So every door's refusals go through one gate (RunRecorder.decide): the first `[box] max_refusals` of a
door in a run are signed one by one, as before; past them a refusal is only counted, by door, kind and box-policy
rule, and the counts are signed as one record per door (kind `refused_count`, policy/refusals.py) at most once every
`FLUSH_S`, and as the box stops. A flood then makes at most one record a second per door, and the signer's memory
does not grow with it. (Comm faults and late outputs keep their own caps as well: jupyter/kernel/comms.py,
rules/late_outputs.py.)

Allowed crossings are bounded per run by the run's size instead (signing/recorder.py: `[box] max_run_mib`), and by each
door's own budgets (`[egress] max_connections`, model calls, output bytes, patch files), a crossing past one refused.

And a run is bounded as a whole: as its estimated bundle size (what it disclosed, and `RECORD_BYTES` a signed record)
passes `[box] max_run_mib` (384 MiB by default, at most 448: the bundle may hold 512) the run is *full*: the box is
ended fail-closed (`on_full`), every crossing but its stop and the last counts is refused unsigned (`FULL_RULE`),
and its bundle is written. So no box can make its own run too large to bundle.

`RefusalCaps` is pure state (sans-IO); `RunBounds`, the part of RunRecorder that applies it, holds the recorder's
lock while it changes it and signs what `take` returns through the recorder's `decide`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tkbox_nb.policy.refusals import COUNTED_DOORS, KIND, MAX_NAME, MAX_NAMES

FLUSH_S = 1.0
COUNTED_RULE = "TKB-REFUSAL-COUNTED"  # refused past [box] max_refusals: in the door's next count record
FULL_RULE = "TKB-RUN-FULL"  # refused unsigned: the run reached [box] max_run_mib and the box is ending
RECORD_BYTES = 1536  # what one signed record adds besides its statement and disclosure (its event: ~1,400 measured)
OTHER = "other"


@dataclass
class Tally:
    """Refusals of one door counted since its last count record."""

    count: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, rule: str) -> None:
        self.count += 1
        for names, name in ((self.kinds, kind), (self.rules, rule)):
            name = str(name)[:MAX_NAME] or OTHER
            if name not in names and len(names) >= MAX_NAMES - 1:
                name = OTHER  # a bounded statement: past 16 names, the rest are summed under "other"
            names[name] = names.get(name, 0) + 1

    def facts(self) -> dict:
        return {"count": self.count, "kinds": dict(self.kinds), "rules": dict(self.rules)}


class RefusalCaps:
    """Which refusals of a run are signed one by one and which only counted, and when a count is due."""

    def __init__(self, flush_s: float = FLUSH_S):
        self.flush_s = flush_s
        self.signed: dict[str, int] = {}  # door -> refusals admitted to be signed one by one
        self.counted: dict[str, int] = {}  # door -> refusals counted, all of the run (for status lines)
        self.pending: dict[str, Tally] = {}  # door -> counted and not yet in a count record
        self.last_take: float | None = None

    def admit(self, door: str, kind: str, rule: str, cap: int) -> bool:
        """One refusal of `door`: True when it is to be signed one by one (the door's first `cap` of the run);
        False when it is counted instead. Doors a box does not drive (box, host, patch) are never capped."""
        if door not in COUNTED_DOORS or kind == KIND:
            return True
        n = self.signed.get(door, 0)
        if n < cap:
            self.signed[door] = n + 1
            return True
        self.pending.setdefault(door, Tally()).add(kind, rule)
        self.counted[door] = self.counted.get(door, 0) + 1
        return False

    def due_in(self, now: float) -> float | None:
        """Seconds until `take` would hand out counts (0: now); None when nothing is counted."""
        if not self.pending:
            return None
        if self.last_take is None:
            return 0.0
        return max(0.0, self.last_take + self.flush_s - now)

    def take(self, now: float, final: bool = False) -> list[tuple[str, dict]]:
        """The count records due: (door, facts) each, in door order, when at least `flush_s` has passed since the
        last (or `final`, as the box stops); the counts are then reset."""
        wait = self.due_in(now)
        if wait is None or (wait > 0 and not final):
            return []
        self.last_take = now
        out = [(door, self.pending[door].facts()) for door in sorted(self.pending)]
        self.pending = {}
        return out


class RunBounds:
    """RunRecorder's bounds: its refusal caps, the timer that signs their counts, and its size (signing/recorder.py)."""

    _lock: threading.Lock
    _settled: threading.Condition
    _in_flight: int
    start_policy: Any  # [box] is fixed as the box starts (docs/policy.md)
    counts: dict

    def _init_bounds(self) -> None:
        self.caps = RefusalCaps()  # which refusals are signed one by one, which counted
        self._timer: threading.Timer | None = None  # signs the counts once due
        self.run_bytes = 0  # the run's bundle as estimated from what it signed and disclosed
        self.full: str | None = None  # why the run takes no more crossings (its size); on_full ends the box
        self.on_full: Any = None

    def _admit(self, door: str, kind: str, verdict: Any) -> bool:
        """A refusal by the box policy: True to sign it one by one; False when it is counted instead (past the
        door's `[box] max_refusals` in this run), its count signed now if due, else by a timer once due."""
        with self._lock:
            if self.caps.admit(door, kind, verdict.rule, self.start_policy.get("box", "max_refusals")):
                return True
            self.counts[(door, "deny")] = self.counts.get((door, "deny"), 0) + 1
            wait = self.caps.due_in(time.monotonic())
            self._schedule(wait)
        if wait == 0:
            self._sign_counts()
        return False

    def _sign_counts(self, final: bool = False) -> None:
        """Sign the counts due: one record per door (policy/refusals.py), each a refusal re-derived by verify."""
        with self._lock:
            self._timer = None
            due = self.caps.take(time.monotonic(), final)
            if not final:
                self._schedule(self.caps.due_in(time.monotonic()))  # counted since, or not yet due: later
            self._in_flight += bool(due)  # taken counts are in flight: a closing run signs its stop after them
        try:
            for door, facts in due:
                self.decide(door, KIND, facts)  # type: ignore[attr-defined]
        finally:
            if due:
                with self._settled:
                    self._in_flight -= 1
                    self._settled.notify_all()

    def _schedule(self, wait: float | None) -> None:
        """(Under the lock.) Sign the counts in `wait` seconds, unless a timer will already."""
        if wait and self._timer is None and not getattr(self, "_stopping", False):
            self._timer = threading.Timer(wait + 0.01, self._sign_counts)
            self._timer.daemon = True
            self._timer.start()

    def _account(self, size: int) -> None:
        """Add `size` bytes to the run's estimated bundle; past `[box] max_run_mib` the run is full."""
        limit = self.start_policy.get("box", "max_run_mib") << 20
        with self._lock:
            self.run_bytes += size
            full = self.run_bytes > limit and not self.full
            if full:
                self.full = (f"the run reached [box] max_run_mib ({limit >> 20} MiB, estimated): ended before "
                             "its bundle could pass the size a bundle may hold")
        if full and self.on_full is not None:
            self.on_full(self.full)
