"""binder/ builds an environment where the bundle-reading notebooks run even where no box can start (Binder has no
KVM and may refuse namespaces). Built here the same way, in a fresh virtualenv, on a PATH without bubblewrap."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def binder_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("binder")
    repo = tmp / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", ".git", "out", "__pycache__", "*.egg-info",
                                                              ".pytest_cache", "build"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin", "HOME": str(tmp / "home"),
           "TKBOX_HOME": str(tmp / "tkbox-home"), "LANG": "C.UTF-8",
           **{k: v for k, v in os.environ.items() if k.startswith(("PIP_", "http", "HTTP", "no_proxy", "NO_PROXY"))}}
    (tmp / "home").mkdir()
    for step in ([str(venv / "bin" / "pip"), "install", "-q", "-r", "binder/requirements.txt"],
                 ["sh", "binder/postBuild"]):
        r = subprocess.run(step, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
    # on Binder no box can start: here, no bubblewrap on the PATH (a shell, for the notebooks' `!` lines)
    shell = tmp / "shell-only"
    shell.mkdir()
    (shell / "sh").symlink_to("/bin/sh")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{shell}"
    yield repo, venv, env
    subprocess.run([str(venv / "bin" / "tkbox"), "signer", "stop"], env=env, capture_output=True, timeout=60)


def test_the_kernel_is_installed_and_a_box_refuses_to_start_saying_why(binder_env):
    repo, venv, env = binder_env
    spec = Path(env["HOME"]) / ".local/share/jupyter/kernels/tkbox/kernel.json"
    assert str(venv) in spec.read_text()
    r = subprocess.run([str(venv / "bin" / "tkbox"), "run", "--", "echo", "hi"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "can start here (" in r.stderr and "bwrap: bwrap is not installed" in r.stderr
    assert "bundles can still be read, verified, replayed and audited" in r.stderr


def test_the_bundle_notebook_runs_without_a_box(binder_env):
    repo, venv, env = binder_env
    r = subprocess.run([str(venv / "bin" / "tkbox"), "verify", "notebooks/samples/quickstart.tkb", "--trust",
                        "notebooks/samples/trust.json"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("VALID"), r.stdout + r.stderr
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "--nbval-lax", "-p", "no:cacheprovider",
                        "04-replay-and-audit.ipynb"], cwd=repo / "notebooks", env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert (repo / "notebooks" / "replayed.ipynb").exists() and not (repo / "notebooks" / "rerun.tkb").exists()
