"""Recorded model responses, read back from a verified bundle, for the model door's replay mode.

A call made in `record` (or `replay`) mode discloses its response body in the bundle, bound to the signed result, and
its request body, bound to the signed decision. Replay serves the response of the call whose provider, endpoint and
request digest match, with no network at all; the same request made again gets the next recording of it, in the
order they were made. The bundle is verified first (`tkbox verify`): content from a bundle that does not verify is
never served, and what is served comes from the very bytes that verified (read once, never opened again).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.bundle.read_back import Run, open_run
from tkbox_nb.rules.door_table import MODEL


@dataclass(frozen=True)
class Recorded:
    status_code: int
    content_type: str
    body: bytes
    streamed: bool


class Recordings:
    """Responses keyed by (provider, endpoint, request digest); `take` hands each out once, in recorded order."""

    def __init__(self, source: str, entries: dict[tuple[str, str, str], list[Recorded]]):
        self.source = source
        self._left = {k: deque(v) for k, v in entries.items()}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(v) for v in self._left.values())

    def has(self, key: tuple[str, str, str]) -> bool:
        with self._lock:
            return bool(self._left.get(key))

    def take(self, key: tuple[str, str, str]) -> Recorded | None:
        with self._lock:
            left = self._left.get(key)
            return left.popleft() if left else None


def recordings_from_run(run: Run) -> Recordings:
    """The model responses a run disclosed (a Run from `open_run`; verify it before calling this)."""
    entries: dict[tuple[str, str, str], list[Recorded]] = defaultdict(list)
    for c in run.crossings():
        a, r = c.args or {}, c.result or {}
        if a.get("door") != MODEL or a.get("kind") != "call" or c.decision != "allow":
            continue
        body = run.content(r.get("response", "")) if isinstance(r.get("response"), str) else None
        status = r.get("status_code")
        if body is None or not isinstance(status, int) or not all(isinstance(a.get(k), str) for k in
                                                                  ("provider", "endpoint", "request")):
            continue
        entries[(a["provider"], a["endpoint"], a["request"])].append(
            Recorded(status, str(r.get("content_type") or "application/json"), body, bool(r.get("streamed"))))
    return Recordings(str(run.path), dict(entries))


def recordings_from_bundle(path: str | Path, trust: str | Path | None = None) -> Recordings:
    """Read the bundle's bytes once, verify those, then take the recordings from those same bytes (a file swapped
    after the check is never the one served, I7); TkboxError (one line) when it does not verify."""
    run = open_run(path)
    report = run.verify(trust)
    if not report.valid:
        raise TkboxError(f"{path}: the bundle does not verify ({report.summary()}); its model responses are not "
                         "served")
    return recordings_from_run(run)
