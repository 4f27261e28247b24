"""The `tkbox` command. Every error a user can cause is one line on stderr and a non-zero exit, never a traceback.
What it prints of a bundle (paths, summaries, reasons, error text) shows control and format characters escaped
(core/visible.py): a name holding a newline or an ANSI escape draws no forged row."""

from __future__ import annotations

import argparse
import json
import sys

from tkbox_nb.core.errors import SignerError, TkboxError
from tkbox_nb.core.visible import visible, visible_lines
from tkbox_nb.rules.door_table import names


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _cmd_verify(a) -> int:
    from tkbox_nb.bundle.verify import verify_bundle
    report = verify_bundle(a.bundle, a.trust)
    if a.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(visible_lines(report.summary()))
        if a.verbose:  # in Tracekit's terms, then each check (Tracekit's within its own) with what it found
            if report.valid:
                print(visible_lines(report.detail()))
            for c in report.checks:
                print(visible(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}"))
                for t in report.tracekit if c.name == "tracekit" else ():
                    print(visible(f"    {str(t.get('status', '?')):4s} {t.get('check')}: {t.get('detail') or ''}"))
        if report.trust_source != "given":
            print(f"(trust: {report.trust_source}, {report.trust_path})", file=sys.stderr)
    if a.inputs and report.valid:  # a signed audit verdict checked against the two bundles it names
        from tkbox_nb.audit.verdict import check_inputs
        from tkbox_nb.bundle.read_back import open_run
        problems = check_inputs(open_run(a.bundle), a.inputs[0], a.inputs[1], a.reaudit, a.trust)
        for line in problems or ["inputs: the verdict names these two bundles" +
                                 (" and auditing them again gives the same verdict" if a.reaudit else "")]:
            print(line)
        return 1 if problems else 0
    return report.exit_code


def _cmd_show(a) -> int:
    from tkbox_nb.bundle.read_back import open_run
    run = open_run(a.bundle)
    if a.environment:
        return _show_environment(run, a.format)
    df = run.to_dataframe()
    if a.door:
        df = df[df["door"] == a.door]
    if a.format != "json":  # JSON escapes them itself; a table or CSV row shows every control character escaped
        for col in ("tool", "kind", "rule_ids", "box_rule", "status", "summary", "content"):
            df[col] = df[col].map(visible, na_action="ignore").astype("string")
    if a.format == "csv":
        sys.stdout.write(df.to_csv(index=False))
    elif a.format == "json":
        sys.stdout.write(df.to_json(orient="records", date_format="iso", indent=1) + "\n")
    else:
        import pandas as pd
        from tkbox_nb.bundle.read_back import gpu_names
        gpus = f"  {gpu_names(run.box['gpus'])}" if "gpus" in run.box else ""
        print(visible(f"run {run.run_id}  box {run.box.get('box_id', '?')}  backend {run.box.get('backend', '?')} "
                      f"({run.box.get('isolation', '?')}){gpus}") + f"  {len(df)} crossing(s)")
        if "notebook" in run.box or "notebook_dropped" in run.box:  # a kernel's run: its notebook, as signed
            from tkbox_nb.rules.notebook_name import describe
            print(f"notebook {visible(describe(run.box))}")
        from tkbox_nb.audit.verdict import read as read_verdict, summary as verdict_summary
        verdict = read_verdict(run)
        if verdict:
            print(visible_lines(verdict_summary(*verdict)))
        with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 60):
            print(df.drop(columns=["content"]).to_string(index=False))
    return 0


def _show_environment(run, fmt: str) -> int:
    """`tkbox show --environment`: the manifest the box.start committed to (unverified: `tkbox verify` checks it)."""
    from tkbox_nb.bundle.environment import summary
    from tkbox_nb.bundle.installs import rows as install_rows, summary as installs_summary
    m = run.environment_manifest()
    installs = install_rows(run.crossings())
    if m is None and not installs:
        print(visible(f"run {run.run_id}: no environment recorded (made before tkbox recorded environments)"))
        return 0
    from tkbox_nb.rules.gpu_record import parse as parse_gpus, status_line as gpu_line
    gpus = {"gpus_from_box_start": parse_gpus(run.box["gpus"]) or "unreadable"} if "gpus" in run.box else {}
    if fmt == "json":  # the manifest as signed, what the package door let in, the GPUs box.start signed beside it
        print(json.dumps(dict(m or {}, installed_during_run=installs, **gpus), indent=1, sort_keys=True))
        return 0
    df = run.environment
    for col in df.columns:
        df[col] = df[col].map(visible, na_action="ignore").astype("string")
    if fmt == "csv":
        sys.stdout.write(df.to_csv(index=False))
        return 0
    import pandas as pd
    head = summary(m) if m else "no environment recorded at start"
    print(visible(f"run {run.run_id}  backend {(m or {}).get('backend', '?')}  image "
                  f"{(m or {}).get('image_digest', '?')}: {head}"))
    if gpus:  # not part of the manifest (the software the box runs): signed in box.start beside its digest
        print(visible(f"gpus (box.start): {gpu_line(run.box['gpus'])}"))
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 80):
        print(df.to_string(index=False))
        if installs:
            print(visible(f"package door: {installs_summary(installs)}"))
            print(visible_lines(run.installs.drop(columns=["got_sha256"]).to_string(index=False)))
    return 0


def _signer(a):
    """The machine signer, or the central one the `--policy` file's [signer] section names."""
    from tkbox_nb.signing.central import signer_for
    from tkbox_nb.policy import Policy
    return signer_for(Policy.load(a.policy) if getattr(a, "policy", None) else Policy.default())


def _cmd_trust(a) -> int:
    from pathlib import Path
    signer = _signer(a).ensure()
    trust = signer.write_trust(Path(a.output).resolve())  # relative to where the user is, not the signer's directory
    print(f"wrote {a.output}: pins log {trust['logs'][0].split('+')[0]}")
    return 0


def _cmd_signer(a) -> int:
    from tkbox_nb.signing.central import CentralSigner
    signer = _signer(a)
    central = isinstance(signer, CentralSigner)
    if a.action in ("start", "stop") and central:
        raise SignerError(f"the central signer at {signer.url} is its operator's to {a.action}, not a box host's")
    if a.action == "start":
        signer.ensure()
        print(f"signer answering at {signer.socket_path} (pid {signer.pid()})")
    elif a.action == "stop":
        signer.stop()
        print("signer stopped")
    elif a.action == "recover":
        from tkbox_nb.signing.recovery import recover_orphans
        signer.ensure()
        written = recover_orphans(signer)
        for path in written:
            print(f"recovered {path}")
        print(f"{len(written)} orphaned run(s) bundled (closed first where still open)")
    else:
        up = signer.answering()
        print(f"signer {'answering' if up else 'not running' if not central else 'not answering'} "
              f"({signer.url if central else signer.dir})")
        return 0 if up else 1
    return 0


def _cmd_export(a) -> int:
    """The bundle of a closed run whose spool is on this host, again (from the machine signer's store, or the
    central store through its reader role)."""
    import re
    from pathlib import Path

    from tkbox_nb.bundle.archive import write_bundle
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", a.run_id):
        raise TkboxError(f"{a.run_id!r} is not a run id")
    signer = _signer(a)
    spool = signer.runs_dir / a.run_id
    if not (spool / "disclosures.jsonl").is_file():
        raise TkboxError(f"no run {a.run_id} was boxed on this host for {signer!r} ({spool})")
    if (spool / "handle.json").exists():
        raise TkboxError(f"run {a.run_id} is not closed: `tkbox signer recover` closes it and writes its bundle")
    signer.ensure()
    out = write_bundle(signer, a.run_id, spool, Path(a.output).resolve())
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tkbox", description="Boxes for untrusted code, every way out decided and signed.")
    p.add_argument("--version", action="version", version=f"tkbox {__import__('tkbox_nb').__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    v = sub.add_parser("verify", help="verify a .tkb: Tracekit's verifier, then the box layer")
    v.add_argument("bundle")
    v.add_argument("--trust", help="trust config (default: this machine's pinned trust)")
    v.add_argument("--json", action="store_true", help="every check, as JSON")
    v.add_argument("-v", "--verbose", action="store_true", help="after the verdict in plain words: Tracekit's "
                   "integrity and assurance, and each check with what it found")
    v.add_argument("--inputs", nargs=2, metavar=("A", "B"), help="a signed audit verdict: check it names these "
                   "two bundles (by digest)")
    v.add_argument("--reaudit", action="store_true", help="with --inputs: audit them again, expecting the same verdict")
    v.set_defaults(fn=_cmd_verify)

    s = sub.add_parser("show", help="the crossings of a .tkb")
    s.add_argument("bundle")
    s.add_argument("--door", choices=names())  # every door of the table (rules/door_table.py), host too
    s.add_argument("--format", choices=["table", "csv", "json"], default="table")
    s.add_argument("--environment", action="store_true",
                   help="what the box ran (interpreter, distributions, Debian packages), as its box.start committed")
    s.set_defaults(fn=_cmd_show)

    central = "a box policy whose [signer] section names a central signer (default: the machine signer)"
    t = sub.add_parser("trust", help="write the trust config that pins this machine's signing identity")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--policy", help=central + "; its trust file is copied")
    t.set_defaults(fn=_cmd_trust)

    g = sub.add_parser("signer", help="the machine signer: start, stop, status")
    g.add_argument("action", choices=["start", "stop", "status", "recover"],
                   help="recover: close the runs of boxes whose process died, and write their bundles")
    g.add_argument("--policy", help=central)
    g.set_defaults(fn=_cmd_signer)

    x = sub.add_parser("export", help="write the bundle of a closed run boxed on this host again")
    x.add_argument("run_id")
    x.add_argument("-o", "--output", required=True)
    x.add_argument("--policy", help=central)
    x.set_defaults(fn=_cmd_export)

    from tkbox_nb.cli import box as cli_box
    from tkbox_nb.cli import patch as cli_patch
    from tkbox_nb.cli import replay as cli_replay
    cli_box.add_commands(sub)
    cli_patch.add_commands(sub)
    cli_replay.add_commands(sub)

    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except TkboxError as e:
        print(f"tkbox {a.command}: {visible_lines(e)}", file=sys.stderr)  # a bundle's text draws no line
        return e.exit_code
    except KeyboardInterrupt:
        print(f"tkbox {a.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug of ours: still one line, never a traceback for the user
        print(f"tkbox {a.command}: internal error ({type(e).__name__}): {visible(str(e)[:300])}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
