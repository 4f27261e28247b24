"""`tkbox replay`, `tkbox rerun` and `tkbox audit`: a signed run back as a notebook, run again, and compared."""

from __future__ import annotations

import json


def _verified(bundle: str, trust: str | None) -> None:
    from .errors import BundleError
    from .verify import verify_bundle
    report = verify_bundle(bundle, trust)
    if not report.valid:
        raise BundleError(f"{bundle} does not verify ({report.summary()}); replaying it would show unproven content")


def _cmd_replay(a) -> int:
    from .replay import replay
    if not a.no_verify:
        _verified(a.bundle, a.trust)
    out = replay(a.bundle, a.output)
    print(f"wrote {out}: open it in JupyterLab (kernel: Python 3 (Tracekit Box)); re-execute and compare with "
          f"pytest --nbval --nbval-kernel-name tkbox {out}")
    return 0


def _cmd_rerun(a) -> int:
    from .replay import rerun
    if not a.no_verify:
        _verified(a.bundle, a.trust)
    out, named = rerun(a.bundle, a.output, policy=a.policy, backend=a.backend)
    print(f"wrote {out}: a new signed run, " + (f"replay_of {named}" if named else
                                                "naming the original in its box manifest (rerun_of): the original "
                                                "run is not in this machine's signer"))
    print(f"compare: tkbox audit {a.bundle} {out}")
    return 0


def _cmd_audit(a) -> int:
    from .replay import audit
    report = audit(a.a, a.b, a.sanitizer)
    if a.html:
        from pathlib import Path
        Path(a.html).write_text(report.html(), encoding="utf-8")
    print(json.dumps(report.as_dict(), indent=1) if a.json else report.table())
    return 0 if report.equivalent else 1


def add_commands(sub) -> None:
    r = sub.add_parser("replay", help="a signed run back as a notebook")
    r.add_argument("bundle")
    r.add_argument("-o", "--output", required=True, help="the notebook to write (.ipynb)")
    r.add_argument("--trust", help="trust config for the verification first (default: this machine's pin)")
    r.add_argument("--no-verify", action="store_true", help="replay without verifying first")
    r.set_defaults(fn=_cmd_replay)
    rr = sub.add_parser("rerun", help="execute a run's cells again in a fresh box; a new signed run")
    rr.add_argument("bundle")
    rr.add_argument("-o", "--output", required=True, help="the new .tkb")
    rr.add_argument("--policy", help="a policy instead of the run's own")
    rr.add_argument("--backend", default="auto")
    rr.add_argument("--trust")
    rr.add_argument("--no-verify", action="store_true")
    rr.set_defaults(fn=_cmd_rerun)
    au = sub.add_parser("audit", help="compare two runs: code, outputs (sanitized), egress, secrets, magics")
    au.add_argument("a")
    au.add_argument("b")
    au.add_argument("--json", action="store_true")
    au.add_argument("--html", help="write a self-contained HTML report here")
    au.add_argument("--sanitizer", help="a file of REGEX<TAB>REPLACEMENT lines, applied to outputs before comparing")
    au.set_defaults(fn=_cmd_audit)
