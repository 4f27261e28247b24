"""`tkbox replay`, `tkbox rerun` and `tkbox audit`: a signed run back as a notebook, run again, and compared."""

from __future__ import annotations

import os
import sys

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.core.visible import visible, visible_lines


class UsageError(TkboxError):
    """Options that do not go together."""


def _verified(bundle: str, trust: str | None, why: str = "replaying it would show unproven content"):
    """The run, read from the very bytes that verified (a file swapped after the check is never the one used)."""
    from tkbox_nb.core.errors import BundleError
    from tkbox_nb.bundle.read_back import open_run
    try:
        run = open_run(bundle)
    except BundleError as e:
        raise BundleError(f"{bundle} does not verify (UNREADABLE: {e}); {why}") from None
    report = run.verify(trust)
    if not report.valid:
        raise BundleError(f"{bundle} does not verify ({report.summary()}); {why}")
    return run


def _run(bundle: str, trust: str | None, no_verify: bool, why: str = "replaying it would show unproven content"):
    from tkbox_nb.bundle.read_back import open_run
    return open_run(bundle) if no_verify else _verified(bundle, trust, why)


def _writable(path: str) -> None:
    """A report's path checked before the work that makes it: its directory exists."""
    from pathlib import Path
    if Path(path).name in ("", ".", ".."):
        raise TkboxError(f"cannot write {path}: not a file name")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise TkboxError(f"cannot write {path}: {parent} is not a directory")


def _not_an_input(path: str | None, *inputs: str) -> None:
    """An output is none of the bundles the command reads: writing over the run it replays, reruns or audits would
    lose it."""
    from pathlib import Path
    for given in inputs:
        try:
            same = path is not None and Path(path).samefile(given)
        except OSError:  # either does not exist (yet): not the same file
            same = False
        if same:
            raise TkboxError(f"cannot write {path}: it is the bundle {given} the command reads")


def _write_report(path: str, text: str) -> None:
    """A report written whole or not at all (a temporary file beside it, then a rename); one line if it cannot be."""
    from pathlib import Path
    out = Path(path)
    if out.name in ("", ".", ".."):
        raise TkboxError(f"cannot write {path}: not a file name")
    from tkbox_nb.core.atomic_file import write_atomic
    try:
        write_atomic(out, text.encode("utf-8"))
    except OSError as e:
        raise TkboxError(f"cannot write {path}: {e.strerror or e}") from None


def _cmd_replay(a) -> int:
    from tkbox_nb.audit.replay import replay
    _not_an_input(a.output, a.bundle)
    out = replay(_run(a.bundle, a.trust, a.no_verify), a.output)
    print(f"wrote {out}: open it in JupyterLab (kernel: Python 3 (Tracekit Box)); re-execute and compare with "
          f"pytest --nbval --nbval-kernel-name tkbox {out}")
    return 0


def _env_values(names: list[str] | None) -> dict[str, str]:
    """The values of the environment variables the run's commands set, read from this process's environment."""
    missing = [n for n in names or [] if n not in os.environ]
    if missing:
        raise UsageError(f"--env {missing[0]}: not set in this environment (export it first)")
    return {n: os.environ[n] for n in names or []}


def _cmd_rerun(a) -> int:
    if a.many:
        return _cmd_rerun_many(a)
    for opt in ("scheduler", "workers", "out_dir", "html", "rtol", "atol", "image_tolerance"):
        if getattr(a, opt) is not None:
            raise UsageError(f"--{opt.replace('_', '-')} goes with --many")
    if a.json:
        raise UsageError("--json goes with --many")
    if a.output is None or len(a.bundle) != 1:
        raise UsageError("give one bundle and -o NEW.tkb (or --many BUNDLES... for a batch)")
    a.bundle = a.bundle[0]
    from tkbox_nb.audit.replay import rerun
    _not_an_input(a.output, a.bundle)
    _writable(a.output)  # before the rerun: its bundle must have somewhere to go, as `tkbox run` checks
    if os.path.isdir(a.output):
        raise TkboxError(f"cannot write {a.output}: it is a directory")
    done = rerun(_run(a.bundle, a.trust, a.no_verify), a.output, policy=a.policy, backend=a.backend,
                 workspace=a.workspace, env=_env_values(a.env), allow_changed_data=a.allow_changed_data)
    for note in done.notes:
        print(f"tkbox rerun: {visible(note)}", file=sys.stderr)
    print(f"wrote {done.path}: a new signed run, naming the original ({visible(done.named)}) in its box manifest "
          "(rerun_of)")
    print(f"compare: tkbox audit {a.bundle} {done.path}")
    return 0


def _cmd_rerun_many(a) -> int:
    """Each bundle rerun and audited on Dask (audit/batch.py); exit 0 all equivalent, 1 any different, 2 any failed."""
    import sys

    from tkbox_nb.audit import batch
    if a.output is not None:
        raise UsageError("-o names one rerun; with --many each rerun goes to --out-dir")
    if not a.bundle:
        raise UsageError("--many needs at least one bundle")
    if a.allow_changed_data:
        raise UsageError("--allow-changed-data goes with one rerun (-o), not --many: a batch refuses changed data")
    if a.workspace is not None or a.env:
        raise UsageError("--workspace and --env go with one rerun (-o), not --many: a batch's workers start each "
                         "rerun from an empty workspace and send no host environment")
    if a.html:
        _writable(a.html)
    say = (lambda r, done, total: print(visible(batch.progress_line(r, done, total)), file=sys.stderr, flush=True)) \
        if a.json else (lambda r, done, total: print(visible(batch.progress_line(r, done, total)), flush=True))
    results = batch.run_batch(a.bundle, a.out_dir or "reruns", scheduler=a.scheduler, workers=a.workers,
                              policy=a.policy, trust=a.trust, backend=a.backend, verify=not a.no_verify,
                              progress=say, tolerance={"rtol": a.rtol, "atol": a.atol,
                                                       "image_tolerance": a.image_tolerance})
    if a.html:
        _write_report(a.html, batch.html_report(results))
    print(batch.as_json(results) if a.json else "\n" + visible_lines(batch.table(results)))
    return batch.exit_code(results)


def _cmd_audit(a) -> int:
    from tkbox_nb.cli.audit import run_audit  # tolerances, the signed verdict: cli/audit.py
    # what is compared must be what was signed: a bundle edited since is not audited
    why = "auditing it would compare unproven content"
    return run_audit(a, lambda path: _run(path, a.trust, a.no_verify, why), _write_report, _not_an_input)


def add_commands(sub) -> None:
    r = sub.add_parser("replay", help="a signed run back as a notebook")
    r.add_argument("bundle")
    r.add_argument("-o", "--output", required=True, help="the notebook to write (.ipynb)")
    r.add_argument("--trust", help="trust config for the verification first (default: this machine's pin)")
    r.add_argument("--no-verify", action="store_true", help="replay without verifying first")
    r.set_defaults(fn=_cmd_replay)
    rr = sub.add_parser("rerun", help="execute a run's cells and commands again in a fresh box; a new signed run "
                        "(--many: a batch on Dask, each rerun audited against its original)")
    rr.add_argument("bundle", nargs="*", help="the bundle (with --many: the bundles)")
    rr.add_argument("-o", "--output", help="the new .tkb")
    rr.add_argument("--many", action="store_true",
                    help="rerun and audit every bundle given on Dask; exit 0 all equivalent, 1 any different, "
                         "2 any failed")
    rr.add_argument("--scheduler", help="a Dask scheduler, tcp://HOST:PORT (default: a local cluster)")
    rr.add_argument("--workers", type=int, help="worker processes of the local cluster (default: CPUs)")
    rr.add_argument("--out-dir", help="where the reruns go, one path per bundle (default: ./reruns)")
    rr.add_argument("--html", help="with --many: write a self-contained HTML report here")
    rr.add_argument("--json", action="store_true", help="with --many: the results as JSON (progress on stderr)")
    rr.add_argument("--policy", help="a policy instead of the run's own")
    rr.add_argument("--workspace", help="the directory the original started from, copied into the box as /workspace "
                    "(a different one is said, and the audit reports it)")
    rr.add_argument("--env", action="append", metavar="NAME", help="an environment variable the run's commands "
                    "set, its value read from this environment (a bundle holds the names only)")
    rr.add_argument("--allow-changed-data", action="store_true", help="rerun even when a dataset mount's data "
                    "differs from the original's (refused by default, naming the first differing file); the "
                    "difference is signed in the rerun's start record")
    rr.add_argument("--backend", default="auto")
    rr.add_argument("--trust")
    rr.add_argument("--no-verify", action="store_true")
    from tkbox_nb.cli.audit import add_audit_options
    add_audit_options(rr, "with --many, each audit: ")
    rr.set_defaults(fn=_cmd_rerun)
    au = sub.add_parser("audit", help="compare two runs door by door: cells, commands, egress, secrets, magics, "
                        "model calls, the patch; exit 0 equivalent, 1 different, 3 nothing to compare")
    au.add_argument("a")
    au.add_argument("b")
    au.add_argument("--json", action="store_true")
    au.add_argument("--html", help="write a self-contained HTML report here")
    au.add_argument("--sanitizer", help="a file of REGEX<TAB>REPLACEMENT lines, applied to outputs before comparing")
    au.add_argument("--trust", help="trust config for verifying both bundles first (default: this machine's pin)")
    au.add_argument("--no-verify", action="store_true", help="compare without verifying the bundles first")
    from tkbox_nb.cli.audit import add_audit_options, add_sign_options
    add_audit_options(au)
    add_sign_options(au)
    au.set_defaults(fn=_cmd_audit)
