"""The audit as a signed run (audit/verdict.py): `tkbox audit A B --sign -o verdict.tkb` writes a run that both
verifiers accept, `tkbox show` names the verdict and the two runs, `tkbox verify --inputs A B [--reaudit]` checks it
against the very bundles, and a verdict whose disclosed report was altered is refused."""

from __future__ import annotations

import json
import subprocess

from conftest import VENV_BIN, forged_bundle, record_run, run_cli, tamper_content

from tkbox_nb.audit.verdict import read
from tkbox_nb.bundle.read_back import open_run


def test_a_signed_verdict_verifies_names_its_runs_and_checks_against_them(signer, tmp_path):
    a = record_run(signer, tmp_path / "a.tkb")
    b = record_run(signer, tmp_path / "b.tkb", cells=("print(2)\n",))
    v = tmp_path / "verdict.tkb"
    r = run_cli("audit", str(a), str(b), "--rtol", "1e-6", "--sign", "-o", str(v))
    assert r.returncode == 1 and r.stdout.startswith("DIFFERENT: 1 difference"), r.stdout + r.stderr
    assert run_cli("verify", str(v)).stdout.startswith("VALID")
    t = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(v), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True)
    assert t.returncode == 0, t.stdout + t.stderr
    facts, report = read(open_run(v))
    assert facts["audit_verdict"] == "different" and facts["tolerance"]["rtol"] == 1e-6
    assert facts["a"]["name"] == "a.tkb" and facts["a"]["valid"] and facts["b"]["run_id"] == open_run(b).run_id
    assert [d["what"] for d in report["differences"]] == ["cell code #1"]
    show = run_cli("show", str(v)).stdout
    assert "signed audit verdict: DIFFERENT, 1 difference(s)" in show and "A: a.tkb run" in show \
        and "B: b.tkb run" in show
    ok = run_cli("verify", str(v), "--inputs", str(a), str(b), "--reaudit")
    assert ok.returncode == 0 and "auditing them again gives the same verdict" in ok.stdout, ok.stdout + ok.stderr
    swapped = run_cli("verify", str(v), "--inputs", str(b), str(a))
    assert swapped.returncode == 1 and "the verdict names sha256:" in swapped.stdout
    c = record_run(signer, tmp_path / "c.tkb", cells=("print(3)\n",))
    other = run_cli("verify", str(v), "--inputs", str(a), str(c))
    assert other.returncode == 1 and "B: " in other.stdout


def _forge(src, out, old: bytes, new: bytes):
    """A copy of `src` with `old` replaced by `new` in its disclosures, the manifest recomputed (a forger's best)."""

    from tkbox_nb.bundle.archive import read_bundle_file
    files = read_bundle_file(src)
    names = [n for n in files if n.startswith("box/disclosures") and old in files[n]]
    assert names
    files[names[0]] = files[names[0]].replace(old, new)
    return forged_bundle(files, out)


def test_a_tampered_verdict_is_refused(signer, tmp_path):
    """Its disclosed report altered, or its verdict turned: tkbox verify refuses both (Tracekit's verifier checks
    the signed records, which commit to the disclosures by digest; the box layer checks the disclosures)."""
    a = record_run(signer, tmp_path / "a.tkb")
    b = record_run(signer, tmp_path / "b.tkb", cells=("print(2)\n",))
    v = tmp_path / "verdict.tkb"
    assert run_cli("audit", str(a), str(b), "--sign", "-o", str(v)).returncode == 1
    for bad in (tamper_content(v, tmp_path / "report.tkb"),
                _forge(v, tmp_path / "turned.tkb", b'"audit_verdict": "different"', b'"audit_verdict": "equivalent"')):
        r = run_cli("verify", str(bad))
        assert r.returncode == 1 and r.stdout.startswith("INVALID"), r.stdout
        assert run_cli("verify", str(bad), "--inputs", str(a), str(b)).returncode == 1


def test_sign_goes_with_o_and_a_verdict_is_not_an_input(signer, tmp_path):
    a = record_run(signer, tmp_path / "a.tkb")
    r = run_cli("audit", str(a), str(a), "--sign")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--sign and -o go together" in r.stderr
    r = run_cli("audit", str(a), str(a), "--sign", "-o", str(a))
    assert r.returncode == 2 and "the bundle" in r.stderr
    r = run_cli("verify", str(a), "--inputs", str(a), str(a))
    assert r.returncode == 2 and "is not a signed audit verdict" in r.stderr, r.stdout + r.stderr
    assert json.loads(run_cli("audit", str(a), str(a), "--json").stdout)["tolerance"]["rtol"] == 0.0
