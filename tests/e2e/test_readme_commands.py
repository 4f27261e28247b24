"""Every command the README shows is run here, in the order it shows them, against a real run: a box that changed
its workspace, so the patch commands have something to review. `make demo` and `make test` are the two commands CI
and tests/e2e/test_bwrap_box.py::test_quickstart_notebook_executes_in_a_box_and_verifies already run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tkbox_nb import Box

ROOT = Path(__file__).resolve().parents[2]
RUN_ELSEWHERE = {"make demo", "make test"}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command:
                out.append(command)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)  # boots VMs under emulation (doctor's test VM, a cold `tkbox run --backend qemu`)
def test_every_readme_command_runs(signer, tmp_path):
    commands = readme_commands()
    assert RUN_ELSEWHERE <= set(commands)
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("one\n")
    with Box(backend="bwrap", workspace=project, bundle_path=tmp_path / "run.tkb") as box:
        box.run(["sh", "-c", "echo two >> notes.txt; echo new > added.txt"])
    (tmp_path / "box.toml").write_text('[box]\nisolation = "vm"\n')
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = []
    for command in commands:
        if command in RUN_ELSEWHERE:
            continue
        argv = shlex.split(command)
        if argv[0] == "unzip" and not shutil.which("unzip"):
            pytest.fail("unzip is not installed (the Makefile's APT_PACKAGES has it)")
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, f"{command}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
        ran.append((command, r.stdout))
    out = dict(ran)
    assert out["tkbox verify run.tkb"].startswith("VALID")
    assert "Integrity: VERIFIED" in out["tracekit verify run.tkb --trust trust.json"]
    assert "print(1)" not in out["tkbox run --backend qemu -- python3 -c 'print(1)'"]
    assert out["tkbox run --backend qemu -- python3 -c 'print(1)'"].strip() == "1"
    assert "2 file(s) in the patch: 2 allowed, 2 applied" in out["tkbox apply run.tkb -w project/"]
    assert (project / "notes.txt").read_text() == "one\ntwo\n" and (project / "added.txt").read_text() == "new\n"
    assert "+two" in out["unzip -p run.tkb box/patch.diff"]
