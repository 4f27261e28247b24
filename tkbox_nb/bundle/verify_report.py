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
        if self.valid:
            warned = f"; WARNING: {'; '.join(self.warnings)}"[:400] if self.warnings else ""
            return f"VALID: {self.integrity}; {self.assurance}".rstrip("; ") + warned
        bad = self.first_failure
        word = "UNREADABLE" if self.exit_code == EXIT_UNREADABLE else "INVALID"
        return f"{word}: {bad.name}: {bad.detail}" if bad else word

    def as_dict(self) -> dict[str, Any]:
        return {"bundle": self.path, "valid": self.valid, "exit_code": self.exit_code, "summary": self.summary(),
                "integrity": self.integrity, "assurance": self.assurance, "trust": self.trust_path,
                "trust_source": self.trust_source, "checks": [c.as_dict() for c in self.checks],
                "tracekit_checks": self.tracekit, "warnings": self.warnings,
                "records": {str(k): v for k, v in sorted(self.record_status.items())}}
