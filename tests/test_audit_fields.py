"""The audit compares every digest whole (a patch file's content, a model call's request and response) and a patch
entry's rename source, mode, type and target, and a mid-run policy change: pairs of real signed runs (a real signer
and recorder, no box behind them) each differing in exactly one of these, each found with its kind at its seq."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tkbox_nb.audit.compare import audit
from tkbox_nb.audit.report import readable
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder

# two contents whose SHA-256 share the first 12 hex digits (found by brute force): what the audit used to compare
SAME12 = (b"m16745892\n", b"m27994257\n")
POLICY = "[exec]\ncells = true\n"
OTHER = "[exec]\ncells = true\ntimeout_s = 601\n"
FILE = {"path": "out.txt", "op": "modify", "type": "file", "mode": 0o644, "size": 10}


def record(signer, out: Path, patch: dict | None = None, content: bytes = SAME12[0], model: bytes = SAME12[0],
           body: str = OTHER) -> tuple[Path, dict[str, int]]:
    """A cell, a %%box_policy, a model call and a patch file, as the doors state them; (bundle, seq of each)."""
    rec = RunRecorder(signer, Policy.from_toml(POLICY), {"backend": "none", "isolation": "none",
                                                         "image_digest": "none"}).open()
    seqs = {}
    c = rec.decide("exec", "cell", {}, {"code": b"print(1)\n"})
    rec.complete(c, "ok", {"execution_count": 1}, {"outputs": b"[]"})
    rec.set_policy(Policy.from_toml(body, "%%box_policy"))
    c = rec.decide("host", "magic", {"magic": "box_policy", "line": ""}, {"body": body.encode()})
    rec.complete(c, "ok", {})
    seqs["host magics"] = c.run_seq
    c = rec.decide("model", "call", {"provider": "openai", "model": "m", "endpoint": "/v1/chat/completions"},
                   {"request": model})
    seqs["model calls"] = c.run_seq
    c = rec.decide("patch", "file", dict(FILE, **(patch or {})), {"content": content})
    seqs["patch"] = c.run_seq
    rec.close("test done")
    return rec.write_bundle(out), seqs


def test_the_pair_of_contents_shares_its_first_12_hex_digits():
    a, b = (hashlib.sha256(x).hexdigest() for x in SAME12)
    assert a[:12] == b[:12] and a != b


@pytest.mark.parametrize("name,kw,kind", [
    ("patch-content", dict(content=SAME12[1]), "patch"),
    ("model-request", dict(model=SAME12[1]), "model calls"),
    ("rename-source", dict(patch={"op": "rename", "from": "b.txt"}), "patch"),
    ("mode", dict(patch={"mode": 0o755}), "patch"),
    ("type-target", dict(patch={"type": "symlink", "target": "elsewhere"}), "patch"),
    ("policy-body", dict(body=OTHER + "max_output_bytes = 1000\n"), "host magics"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_each_single_difference_is_found_with_its_kind_and_seq(signer, tmp_path, name, kw, kind):
    base = {"rename-source": dict(patch={"op": "rename", "from": "a.txt"}),
            "type-target": dict(patch={"type": "symlink", "target": "there"})}.get(name, {})
    a, _ = record(signer, tmp_path / "a.tkb", **base)
    b, seqs = record(signer, tmp_path / "b.tkb", **kw)
    assert audit(a, a).equivalent
    report = audit(a, b)
    assert [(d.kind, d.seq_a, d.seq_b) for d in report.differences] == [(kind, seqs[kind], seqs[kind])], \
        report.differences
    d = report.differences[0]
    assert len(d.a) < 400 and "sha256:" not in d.a  # shown short, compared whole
    # the readable report shows a patch file's difference by its path (audit/report.py reads the door's section)
    assert readable(d) == ([f"file out.txt: A {d.a[:160]}, B {d.b[:160]}"] if kind == "patch" else [])
