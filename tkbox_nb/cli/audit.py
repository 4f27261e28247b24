"""`tkbox audit`'s own options and run: tolerances (audit/tolerance.py) and the signed verdict (audit/verdict.py).

Kept apart from cli/replay.py, which parses the command's older options (the bundles, --json, --html, --sanitizer,
--trust, --no-verify) and calls `run_audit`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tkbox_nb.core.visible import visible_lines
from tkbox_nb.core.errors import TkboxError



def add_audit_options(au, prefix: str = "") -> None:
    au.add_argument("--rtol", type=float, help=prefix + "numbers with a fraction or exponent in outputs compare "
                    "within this relative tolerance (math.isclose); integers, strings and structure stay "
                    "exact (default 0)")
    au.add_argument("--atol", type=float, help="... and within this absolute tolerance (default 0)")
    au.add_argument("--image-tolerance", type=float, help="PNG and JPEG outputs compare by decoded pixels: equal "
                    "when no channel of any pixel differs by more than this (0..255; default: by digest)")


def add_sign_options(au) -> None:
    au.add_argument("--sign", action="store_true", help="write the audit as a signed run of its own (-o), signed by "
                    "this machine's signer: `tkbox verify` and `tracekit verify` check it, `tkbox show` prints it")
    au.add_argument("-o", "--output", help="with --sign: the verdict's .tkb")


def run_audit(a, read, write_report, not_an_input) -> int:
    """`read(path)`: a bundle as a verified run (or unverified with --no-verify); `write_report(path, text)`;
    `not_an_input(path, *bundles)`: refuses to write over a bundle read (all from cli/replay.py)."""
    from tkbox_nb.audit.compare import audit
    from tkbox_nb.audit.tolerance import Tolerance
    Tolerance(a.rtol or 0.0, a.atol or 0.0, a.image_tolerance)  # a bad tolerance is said before any bundle is read
    not_an_input(a.html, a.a, a.b)
    if bool(a.sign) != bool(a.output):
        raise TkboxError("--sign and -o go together: tkbox audit A B --sign -o verdict.tkb")
    if a.sign:
        not_an_input(a.output, a.a, a.b)
        if Path(a.output).name in ("", ".", "..") or not Path(a.output).resolve().parent.is_dir():
            raise TkboxError(f"cannot write {a.output}: not a file name in a directory that exists")
    ra, rb = read(a.a), read(a.b)
    report = audit(ra, rb, a.sanitizer, rtol=a.rtol, atol=a.atol, image_tolerance=a.image_tolerance)
    if a.html:
        write_report(a.html, report.html())
    print(json.dumps(report.as_dict(), indent=1) if a.json else visible_lines(report.table()))
    if a.sign:
        from tkbox_nb.core.atomic_file import read_capped
        from tkbox_nb.audit.compare import MAX_SANITIZER_BYTES
        from tkbox_nb.audit.verdict import sign
        text = read_capped(Path(a.sanitizer), MAX_SANITIZER_BYTES).decode("utf-8") if a.sanitizer else ""
        out = sign(report, ra, rb, a.output, a.trust, text)
        print(f"wrote {out}: the audit as a signed run (tkbox verify {a.output} --inputs {a.a} {a.b})",
              file=sys.stderr)
    return report.exit_code
