"""`tkbox verify`: Tracekit's verifier first, then the box layer checked against the signed records.

Tracekit's verifier proves the records are the signer's, whole and in order. On top of that the box layer's checks
(bundle/box_checks.py, one invariant each) prove that each disclosed item (a decision's arguments, a result, cell
code and outputs, the policy source) is the content the record committed to, that every decision and result of the
run is disclosed, that each decision follows from the disclosed box policy, and that the box manifest says what the
records say. The first failing check is the reason (bundle/verify_report.py).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

from tkbox_nb.bundle.archive import BundleContents, parse, read_bundle_bytes, read_entries
from tkbox_nb.bundle.box_checks import check_box_layer
from tkbox_nb.bundle.verify_report import EXIT_INVALID, EXIT_VALID, VerifyReport
from tkbox_nb.core.errors import BundleError


def verify_bundle(path: str | Path, trust: str | Path | None = None, data: bytes | None = None) -> VerifyReport:
    """Verify one `.tkb`. `trust`: a trust config; None uses this machine's pinned trust. `data`: the bundle's bytes
    already read (the ones a caller goes on to use), so that what is verified is what is used."""
    from tkbox_nb.core.home import trust_path
    report = VerifyReport(path=str(path))
    if trust is None:
        report.trust_path, report.trust_source = str(trust_path()), "this machine's pinned trust"
    else:
        report.trust_path, report.trust_source = str(trust), "given"
    if not Path(report.trust_path).is_file():
        report.add("trust", False, f"no trust config at {report.trust_path} (run `tkbox trust` or pass --trust)")
        return report
    from tracekit.verify.v2 import load_trust
    try:  # a bad trust config is the caller's input, not the bundle's fault: unreadable (2), never INVALID (1)
        load_trust(report.trust_path)
    except Exception as e:
        report.add("trust", False, f"{report.trust_path} is not a trust config ({type(e).__name__}: {str(e)[:200]})")
        return report
    try:
        data = read_bundle_bytes(path) if data is None else data
    except BundleError as e:
        report.add("bundle readable", False, str(e))
        return report
    return verify_bytes(data, report)


def verify_bytes(data: bytes, report: VerifyReport) -> VerifyReport:
    """The checks of `verify_bundle` on a bundle's bytes (pure but for reading `report.trust_path`; fuzzed)."""
    try:
        contents = parse(read_entries(data))
    except BundleError as e:
        report.add("bundle readable", False, str(e))
        return report
    report.add("bundle readable", True, f"{len(contents.files)} entries")
    report.signed_by = next((body.split(b"\n", 1)[0].decode("utf-8", "replace")[:200] for name, body in
                             sorted(contents.files.items()) if re.fullmatch(r"checkpoints/.*\.note", name)), "")
    _tracekit(report, io.BytesIO(data), report.trust_path)
    _box_layer(report, contents)
    report.exit_code = EXIT_VALID if all(c.ok for c in report.checks) else EXIT_INVALID
    return report


def _tracekit(report: VerifyReport, bundle: io.BytesIO, trust_path: str) -> None:
    from tracekit.verify.v2 import verify as tracekit_verify
    # called as is: swapping sys.stdout around it (redirect_stdout) is process-wide, and two verifications in two
    # threads (boxes ending at once, a widget's Verify) left it pointing at a dead buffer
    rep, code = tracekit_verify(bundle, trust_path)
    report.tracekit = list(rep.checks)
    report.integrity = str(getattr(rep, "integrity", "") or "")
    report.assurance = str(rep.assurance or "")
    failed = [c for c in rep.checks if c.get("status") == "fail"]
    # a warning (a signed gap: an event the signer never received; held calls) leaves what the records prove intact,
    # but a reader must see it: it is named in the verdict, which stays VALID
    for c in rep.checks:
        if c.get("status") == "warn":
            problems = "; ".join(str(p) for p in c.get("problems") or [])[:200]
            report.warnings.append(f"{c.get('check')}: {c.get('detail') or ''} {problems}".strip()[:300])
    if code == 0 and not failed:
        report.add("tracekit", True, f"Integrity: {report.integrity}")
    else:
        c = failed[0] if failed else {"check": "verify", "detail": report.integrity}
        problems = "; ".join(str(p) for p in c.get("problems") or [])[:300]
        report.add("tracekit", False, f"{c['check']}: {c.get('detail') or ''} {problems}".strip())


def _box_layer(report: VerifyReport, b: BundleContents) -> None:
    try:
        check_box_layer(report, b)
    except Exception as e:  # a shape no check above foresaw: the bundle fails, never the verifier
        report.add("bundle structure", False, f"the box layer cannot be read ({type(e).__name__}: {str(e)[:120]})")
