"""What `tkbox verify` says of one bundle: each check in the order it ran, the first failure the reason, and each
record's status (the run view marks rows with it). Its own module so that the box layer's checks
(bundle/box_checks.py), which fill it in, and bundle/verify.py, which runs them, both use it without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EXIT_VALID, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class VerifyReport:
    """The verdict on one bundle. `record_status` maps run_seq to "valid" or the check that failed for that record."""

    path: str
    exit_code: int = EXIT_UNREADABLE
    checks: list[Check] = field(default_factory=list)
    tracekit: list[dict[str, Any]] = field(default_factory=list)
    integrity: str = ""
    assurance: str = ""
    trust_path: str = ""
    trust_source: str = ""
    record_status: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # Tracekit's warn-level checks (a signed gap, ...), shown
    records: int = 0  # the run's records the box layer read, for the plain line
    decisions: int = 0  # decisions re-derived from the disclosed policy
    signed_by: str = ""  # the log whose checkpoint Tracekit's verifier checked under the pinned key (its origin)

    @property
    def valid(self) -> bool:
        return self.exit_code == EXIT_VALID

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    def summary(self) -> str:
        """The verdict in plain words: what was checked, for a valid bundle (`detail()` is Tracekit's terms), or the
        first check that failed."""
        if not self.valid:
            return self.detail()
        opened = "" if self.integrity == "VERIFIED" else \
            "; the run is still open: what it holds so far is checked, not that it is complete"
        n, d = self.records, self.decisions
        return (f"VALID: {n} record{'s' * (n != 1)} signed by {self.signed_by or 'the pinned signer'}, the chain "
                "intact, every disclosed cell and file matches its signed digest, "
                f"{'all' if d != 1 else 'its'} {d} decision{'s' * (d != 1)} follow{'s' * (d == 1)} from the run's "
                f"policy{opened}") + self._warned()

    def detail(self) -> str:
        """The verdict in Tracekit's terms (integrity and assurance: `tkbox verify --verbose`, and `--json`'s
        summary), or the first check that failed."""
        if self.valid:
            return f"VALID: {self.integrity}; {self.assurance}".rstrip("; ") + self._warned()
        bad = self.first_failure
        word = "UNREADABLE" if self.exit_code == EXIT_UNREADABLE else "INVALID"
        return f"{word}: {bad.name}: {bad.detail}" if bad else word

    def _warned(self) -> str:
        return f"; WARNING: {'; '.join(self.warnings)}"[:400] if self.warnings else ""

    def as_dict(self) -> dict[str, Any]:
        return {"bundle": self.path, "valid": self.valid, "exit_code": self.exit_code, "summary": self.detail(),
                "integrity": self.integrity, "assurance": self.assurance, "trust": self.trust_path,
                "trust_source": self.trust_source, "checks": [c.as_dict() for c in self.checks],
                "tracekit_checks": self.tracekit, "warnings": self.warnings,
                "records": {str(k): v for k, v in sorted(self.record_status.items())}}
