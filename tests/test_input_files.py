"""Files a user names as input (a policy, a batch's bundles and trust config, an audit's sanitizer file) are read
only if they are regular files, and at most their cap plus one byte: a FIFO never hangs the reader, a huge file is
never read whole. The central signer's trust config is written to a fresh file renamed over the output, never
through a symlink planted there, and a failure is one line."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from conftest import record_run

from tkbox_nb.audit.compare import audit
from tkbox_nb.audit.batch import run_batch
from tkbox_nb.signing.central import CentralSigner
from tkbox_nb.core.errors import PolicyError, SignerError, TkboxError
from tkbox_nb.policy import Policy
from tkbox_nb.policy.core import MAX_POLICY_BYTES


def no_hang(fn):
    """fn() in a thread: what it returned or raised; the test fails if it blocks (a FIFO opened for reading)."""
    got: list = []

    def go():
        try:
            got.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            got.append(("raised", e))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(30)
    assert got, "the reader blocked on a FIFO"
    return got[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "named.pipe"
    os.mkfifo(path)
    return path


def test_a_policy_that_is_a_fifo_or_too_large_is_one_line(fifo, tmp_path):
    how, e = no_hang(lambda: Policy.load(fifo))
    assert how == "raised" and isinstance(e, PolicyError) and "not a regular file" in str(e), e
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_POLICY_BYTES + 1))
    with pytest.raises(PolicyError, match="larger than"):
        Policy.load(big)


def test_a_batch_bundle_or_trust_config_that_is_a_fifo_is_refused(signer, fifo, tmp_path):
    how, results = no_hang(lambda: run_batch([str(fifo)], tmp_path / "out"))
    assert how == "ok" and [r.status for r in results] == ["failed"] and "not a regular file" in results[0].reason
    good = record_run(signer, tmp_path / "good.tkb")
    how, e = no_hang(lambda: run_batch([str(good)], tmp_path / "out", trust=fifo))
    assert how == "raised" and isinstance(e, TkboxError) and "not a regular file" in str(e), e


def test_an_audit_sanitizer_file_that_is_a_fifo_is_refused(signer, fifo, tmp_path):
    good = record_run(signer, tmp_path / "good.tkb")
    how, e = no_hang(lambda: audit(good, good, sanitizer_file=fifo))
    assert how == "raised" and isinstance(e, TkboxError) and "not a regular file" in str(e), e


def test_the_central_trust_config_is_never_written_through_a_symlink(tmp_path):
    trust = tmp_path / "published.json"
    trust.write_text(json.dumps({"keys": ["k"]}))
    signer = CentralSigner("https://127.0.0.1:9", tmp_path / "t", tmp_path / "ca", tmp_path / "dsn", trust,
                           home=tmp_path / "home")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    out = tmp_path / "trust.json"
    out.symlink_to(victim)
    assert signer.write_trust(out) == {"keys": ["k"]}
    assert victim.read_text() == "the user's file\n" and not out.is_symlink()
    assert json.loads(out.read_text()) == {"keys": ["k"]}
    with pytest.raises(SignerError, match="cannot write") as e:
        signer.write_trust(tmp_path / "nowhere" / "trust.json")
    assert "\n" not in str(e.value)
    assert not Path(tmp_path / "nowhere").exists()
