"""An audit as a signed run of its own (`tkbox audit A B --sign -o verdict.tkb`), and its check against the bundles.

Why: a verdict printed on a screen is nothing an artifact-evaluation committee can publish; one signed by the
machine's signer is. The verdict is a RunRecorder run with no box behind it (backend, isolation and image "none"),
with one crossing on the host door (the user's own act, as a host magic is): `tkbox_audit`, stating in its signed
arguments each bundle's name, run id, sha256 and verification result, the tolerances, the sanitizers' digest, the
verdict and the number of differences; its content (committed by digest in the record, disclosed in the bundle) is
the whole report (`Audit.as_dict`: every difference) and the sanitizer file's text. So `tkbox verify` and
`tracekit verify` check it as any run, `tkbox show` prints it, and `tkbox verify verdict.tkb --inputs A B` checks it
names these very bundles (by digest) and, with `--reaudit`, that auditing them again gives the same verdict.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.rules.door_table import HOST

MAGIC = "tkbox_audit"
VERDICT_BOX = {"backend": "none", "isolation": "none (an audit: no box ran)", "image_digest": "none"}


def bundle_digest(run) -> str:
    """The sha256 of the bytes the run was read (and verified) from."""
    data = getattr(run, "_data", None)
    if data is None:
        from tkbox_nb.bundle.archive import read_bundle_bytes
        data = read_bundle_bytes(run.path)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _side(run, trust: str | None) -> dict[str, Any]:
    report = run.verify(trust)
    return {"name": Path(run.path).name, "run_id": str(run.run_id), "bundle": bundle_digest(run),
            "verified": report.summary()[:300], "valid": bool(report.valid)}


def sign(report, ra, rb, out: str | Path, trust: str | None = None, sanitizer_text: str = "", signer=None) -> Path:
    """Write `report` (an audit.Audit of the runs ra and rb) as a signed run at `out`; returns its path."""
    from tkbox_nb.signing.central import signer_for
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    policy = Policy.default()
    rec = RunRecorder(signer or signer_for(policy), policy, dict(VERDICT_BOX), agent="tkbox-audit").open()
    body = json.dumps(report.as_dict(), sort_keys=True).encode()
    facts = {"magic": MAGIC, "a": _side(ra, trust), "b": _side(rb, trust), "tolerance": report.tolerance.as_dict(),
             "tolerance_text": report.tolerance.describe(), "audit_verdict": report.status,
             "differences": len(report.differences), "coverage": report.covered()[:2000]}
    c = rec.decide(HOST, "magic", facts, {"report": body, "sanitizers": sanitizer_text.encode()})
    if not c.allowed:
        rec.close("the signer refused the audit's verdict")
        raise TkboxError(f"the signer refused the audit's verdict: {c.reason or c.rule_ids}")
    rec.complete(c, "ok", {"audit_verdict": report.status}, {"report": body})
    rec.close("audit done")
    return rec.write_bundle(Path(out).resolve())


def read(run) -> tuple[dict, dict] | None:
    """(the verdict's signed facts, its report) if `run` is a signed audit verdict, else None."""
    for c in run.crossings():
        a = c.args or {}
        if c.door == HOST and a.get("magic") == MAGIC and isinstance(a.get("a"), dict) \
                and isinstance(a.get("b"), dict):
            try:
                report = json.loads(run.content(a.get("report")) or b"{}")
            except ValueError:
                report = {}
            return a, report if isinstance(report, dict) else {}
    return None


def summary(facts: dict, report: dict) -> str:
    """The verdict in a few lines, naming the two runs."""
    verdict = str(facts.get("audit_verdict")).upper()
    lines = [f"signed audit verdict: {verdict}, {facts.get('differences')} difference(s); "
             f"tolerance: {facts.get('tolerance_text')}"]
    for side in "ab":
        s = facts.get(side) if isinstance(facts.get(side), dict) else {}
        lines.append(f"  {side.upper()}: {s.get('name')} run {s.get('run_id')} {s.get('bundle')} "
                     f"({s.get('verified')})")
    for d in (report.get("differences") or [])[:50]:
        if isinstance(d, dict):
            lines.append(f"  {d.get('what')}: A {str(d.get('a'))[:80]!r}, B {str(d.get('b'))[:80]!r}")
    return "\n".join(lines)


def check_inputs(verdict_run, a: str, b: str, reaudit: bool = False, trust: str | None = None) -> list[str]:
    """What is wrong with the verdict as the audit of bundles `a` and `b` ([] when nothing): each bundle's digest
    is the one the verdict names; with `reaudit`, auditing them again (with the verdict's tolerance and
    sanitizers) gives the same verdict and the same differences."""
    from tkbox_nb.bundle.read_back import open_run
    found = read(verdict_run)
    if found is None:
        raise TkboxError(f"{verdict_run.path} is not a signed audit verdict (no {MAGIC} record)")
    facts, report = found
    runs = [open_run(p) for p in (a, b)]
    problems = [f"{side.upper()}: {path} is {got}, the verdict names {facts[side].get('bundle')}"
                for side, path, run in zip("ab", (a, b), runs)
                if (got := bundle_digest(run)) != facts[side].get("bundle")]
    if reaudit and not problems:
        again = _reaudit(verdict_run, facts, runs, trust)
        if again.status != facts.get("audit_verdict"):
            problems.append(f"auditing again gives {again.status}, the verdict says {facts.get('audit_verdict')}")
        elif [d.what for d in again.differences] != [d.get("what") for d in report.get("differences") or []]:
            problems.append("auditing again gives other differences than the verdict lists")
    return problems


def _reaudit(verdict_run, facts: dict, runs: list, trust: str | None):
    import tempfile

    from tkbox_nb.audit.compare import audit
    tol = facts.get("tolerance") if isinstance(facts.get("tolerance"), dict) else {}
    text = verdict_run.content(facts.get("sanitizers")) or b""
    with tempfile.NamedTemporaryFile(suffix=".sanitizer") as f:
        f.write(text)
        f.flush()
        return audit(runs[0], runs[1], f.name if text else None, rtol=tol.get("rtol"), atol=tol.get("atol"),
                     image_tolerance=tol.get("image_tolerance"))
