"""Shared fixtures: a real machine signer in a temporary TKBOX_HOME, stopped when the session ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import MachineSigner

VENV_BIN = Path(sys.executable).parent


def short_tmp(prefix: str) -> Path:
    """A short temporary directory: Unix socket paths must stay under 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture(scope="session")
def tkbox_home():
    home = short_tmp("tkh-")
    old = os.environ.get("TKBOX_HOME")
    os.environ["TKBOX_HOME"] = str(home)
    yield home
    MachineSigner(home).stop()
    if old is None:
        os.environ.pop("TKBOX_HOME", None)
    else:
        os.environ["TKBOX_HOME"] = old
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def signer(tkbox_home):
    return MachineSigner(tkbox_home).ensure()


@pytest.fixture
def private_signer():
    """A signer of its own (own key, own home) for tests that kill, stall or compare signers."""
    home = short_tmp("tkp-")
    s = MachineSigner(home).ensure()
    yield s
    s.stop()
    shutil.rmtree(home, ignore_errors=True)


def record_run(signer: MachineSigner, out: Path, policy: Policy | None = None, cells=("print(1)\n",),
               commands=(["ls", "-l"],), egress=()) -> Path:
    """A run with real signed crossings but no box behind them: for the bundle, verifier and view tests.
    `egress`: (host, address) pairs stated to the signer as connections, which this version refuses."""
    rec = RunRecorder(signer, policy or Policy.default(),
                      {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    for host, address in egress:
        rec.decide("egress", "connect", {"host": host, "port": 80, "address": address})
    for i, code in enumerate(cells, 1):
        c = rec.decide("exec", "cell", {}, {"code": code.encode()})
        rec.complete(c, "ok", {"execution_count": i}, {"outputs": b'[{"output_type": "stream", "text": "1\\n"}]'})
    for argv in commands:
        c = rec.decide("exec", "command", {"argv": list(argv)})
        if c.allowed:
            rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"out\n", "stderr": b""})
    rec.close("test done")
    return rec.write_bundle(out)


def run_cli(*args: str, cwd: str | Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "tkbox"), *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120)


def tamper_content(src: Path, out: Path) -> Path:
    """A copy of `src` with one disclosed content item altered and the manifest recomputed (a forger's best)."""
    import base64
    import json

    from tkbox_nb.bundle.archive import read_bundle_file
    files = read_bundle_file(src)
    lines = files["box/content-0001.jsonl"].split(b"\n")
    item = json.loads(lines[0])
    item["b64"] = base64.b64encode(base64.b64decode(item["b64"]) + b" tampered").decode()
    lines[0] = json.dumps(item).encode()
    files["box/content-0001.jsonl"] = b"\n".join(lines)
    return forged_bundle(files, out)


def forged_bundle(files: dict[str, bytes], out: Path) -> Path:
    """`files` (a bundle's, changed) written back as a bundle at `out`, the manifest's digests recomputed to match
    them (a forger's best: only the signatures can tell). `files` gets the new manifest."""
    import hashlib
    import json

    from tkbox_nb.bundle.archive import write_zip
    m = json.loads(files["manifest.json"])
    m["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in files.items() if n != "manifest.json"}
    files["manifest.json"] = json.dumps(m, indent=1).encode()
    write_zip(out, files)
    return out
