"""Every command docs/*.md shows. The ones in ```sh blocks run, in the order shown, against a real notebook run made
in a box; where a line shows optional flags in brackets it runs once without them and once with all of them. The ones
named inline (`tkbox ...` in backticks, in docs/ and the README) go through the CLI's own parser, so a flag renamed or
removed in the code breaks this test rather than the reader. (README's ```sh commands run in test_readme_commands.py.)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.cli.main import build_parser
from tkbox_nb.bundle.verify import verify_bundle

from .test_replay import notebook_run

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PLACEHOLDERS = {"BUNDLE": "run.tkb", "DIR": "out", "FILE": "sanitizer.tsv", "PKG": "linux-image-cloud-amd64",
                "PKG,...": "python3", "REQ,...": "rich", "P": "prefix", "RUN.ipynb": "run.ipynb", "NEW.tkb": "new.tkb",
                "A.tkb": "run.tkb", "B.tkb": "again.tkb", "REPORT.html": "report.html"}


def sh_commands(paths=DOCS) -> list[tuple[str, str]]:
    out = []
    for path in paths:
        for block in re.findall(r"```sh\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.splitlines():
                command = line.split("  #")[0].split(" # ")[0].strip()
                if command:
                    out.append((path.name, command))
    return out


def inline_tkbox_commands() -> list[tuple[str, str]]:
    out = []
    for path in [*DOCS, ROOT / "README.md"]:
        out += [(path.name, c) for c in re.findall(r"`(tkbox [^`\n]*)`", path.read_text())]
    return out


def variants(command: str) -> list[str]:
    """The line without its bracketed options, and with all of them."""
    bare = re.sub(r"\s*\[[^\]]*\]", "", command)
    full = re.sub(r"\[([^\]]*)\]", r"\1", command)
    return [bare] if bare == full else [bare, full]


def concrete(argv: list[str]) -> list[str]:
    return [PLACEHOLDERS.get(a, a) for a in argv if a != "..."]


def test_the_docs_show_commands_to_check():
    assert len(sh_commands()) >= 5 and len(inline_tkbox_commands()) >= 15


def alternatives(argv: list[str]) -> list[list[str]]:
    """`start|stop|status` (a table's `\\|`): one argv per alternative."""
    for i, a in enumerate(argv):
        if "|" in a:
            return [argv[:i] + [alt] + argv[i + 1:] for alt in a.split("|")]
    return [argv]


def is_bare(argv: list[str]) -> bool:
    """A command named in prose ("`tkbox replay`"): subcommand words only, checked through its --help."""
    return 0 < len(argv) <= 2 and all(re.fullmatch(r"[a-z]+", a) for a in argv)


@pytest.mark.parametrize("doc,command", inline_tkbox_commands())
def test_every_tkbox_command_named_in_the_docs_parses(doc, command, capsys):
    parser = build_parser()
    for variant in variants(command):
        for argv in alternatives(concrete(shlex.split(variant)[1:])):
            argv = [{"D": "egress"}.get(a, a) for a in argv]
            if is_bare(argv) and argv[0] != "doctor":
                with pytest.raises(SystemExit) as e:
                    parser.parse_args(argv + ["--help"])
                assert e.value.code == 0, f"{doc}: `{variant}` names no command"
                continue
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{doc}: `{variant}` does not parse (exit {e.code}): {capsys.readouterr().err[-300:]}")


@pytest.mark.slow
@pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])
def test_every_sh_command_in_the_docs_runs(signer, tmp_path):
    commands = sh_commands()
    notebook_run(tmp_path / "run.tkb", cells=["y = 6", "print('y is', y)", "y * 7"])
    (tmp_path / "sanitizer.tsv").write_text("y is \\d+\ty is N\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "JUPYTER_PATH": str(ROOT), "TKBOX_BUNDLE_DIR": str(tmp_path / "bundles")}
    ran = {}
    for doc, command in commands:
        for variant in variants(command):
            argv = concrete(shlex.split(variant))
            if argv[:3] == ["tkbox", "kernel", "install"] and "--sys-prefix" in argv:
                # the documented --prefix form, so the test changes nothing outside its directory
                argv[argv.index("--sys-prefix"):argv.index("--sys-prefix") + 1] = ["--prefix", str(tmp_path / "k")]
            if argv[0] == "pytest":
                argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv[1:]]
            r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"{doc}: {variant}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
            ran[variant] = r.stdout
    assert len(ran) >= 5
    assert (tmp_path / "k" / "share" / "jupyter" / "kernels" / "tkbox" / "kernel.json").is_file()
    assert (tmp_path / "run.ipynb").is_file() and verify_bundle(tmp_path / "again.tkb").valid
    import json
    audits = [v for k, v in ran.items() if k.startswith("tkbox audit")]
    assert audits[0].startswith("EQUIVALENT") and json.loads(audits[1])["equivalent"] is True
    assert (tmp_path / "report.html").read_text().lstrip().lower().startswith("<!doctype html")
