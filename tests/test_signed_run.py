"""The signed run: one run per box on the machine signer, its .tkb, and both verifiers."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import VENV_BIN, record_run, run_cli

from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import UNAVAILABLE_RULE, RunRecorder
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.bundle.verify import verify_bundle


@pytest.fixture(scope="module")
def bundle(signer, tmp_path_factory):
    return record_run(signer, tmp_path_factory.mktemp("b") / "run.tkb")


def test_bundle_verifies_with_tkbox_verify(bundle, signer):
    r = run_cli("verify", str(bundle))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("VALID")
    assert "pinned trust" in r.stderr  # says which trust it used


def test_the_verdict_says_in_plain_words_what_was_checked_with_tracekit_s_terms_behind_verbose(bundle, signer):
    """Before, the line was Tracekit's jargon (`VALID: VERIFIED; dev; records ed25519; checkpoint Ed25519 only ...`)."""
    origin = open_run(bundle).origin
    n, d = len(open_run(bundle).records), len(open_run(bundle).crossings())  # box start and stop, a cell, a command
    r = run_cli("verify", str(bundle))
    assert r.stdout == (f"VALID: {n} records signed by {origin}, the chain intact, every disclosed cell and file "
                        f"matches its signed digest, all {d} decisions follow from the run's policy\n"), r.stdout
    assert d == 4 and origin.startswith("tkbox.local/") and "ed25519" not in r.stdout
    v = run_cli("verify", "--verbose", str(bundle))
    lines = v.stdout.splitlines()
    assert v.returncode == 0 and lines[0] == r.stdout.strip() and lines[1].startswith("VALID: VERIFIED; "), v.stdout
    assert "records ed25519" in lines[1] and "  ok   disclosures: " in v.stdout and "    pass signatures: " in v.stdout
    data = json.loads(run_cli("verify", "--json", str(bundle)).stdout)  # --json as before: Tracekit's terms
    assert data["summary"] == lines[1] and set(data) == {"bundle", "valid", "exit_code", "summary", "integrity",
                                                          "assurance", "trust", "trust_source", "checks",
                                                          "tracekit_checks", "warnings", "records"}


def test_an_invalid_bundle_says_its_first_failing_check_and_verbose_lists_every_check(bundle, tmp_path):
    from conftest import tamper_content
    bad = tamper_content(bundle, tmp_path / "bad.tkb")
    r = run_cli("verify", str(bad))
    assert r.returncode == 1 and r.stdout.startswith("INVALID: content") and len(r.stdout.splitlines()) == 1
    v = run_cli("verify", "-v", str(bad))
    assert v.returncode == 1 and v.stdout.splitlines()[0] == r.stdout.strip()
    assert "  FAIL content: " in v.stdout and "  ok   tracekit: " in v.stdout, v.stdout


def test_bundle_verifies_with_tracekit_verify_unchanged(bundle, signer):
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(bundle), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    assert "Integrity: VERIFIED." in r.stdout


def test_tkbox_trust_writes_a_pin_that_both_verifiers_accept(bundle, signer, tmp_path):
    out = tmp_path / "trust.json"
    r = run_cli("trust", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["logs"][0].startswith("tkbox.local/")
    assert run_cli("verify", str(bundle), "--trust", str(out)).returncode == 0


def test_verify_json_lists_every_check(bundle):
    r = run_cli("verify", str(bundle), "--json")
    data = json.loads(r.stdout)
    assert data["valid"] is True and data["exit_code"] == 0
    names = {c["check"] for c in data["checks"]}
    assert {"tracekit", "manifest", "box manifest", "disclosures"} <= names
    assert all(v == "valid" for v in data["records"].values())


def test_every_decision_is_bound_to_the_box_policy(signer, tmp_path):
    policy = Policy.from_toml('[exec]\ncells = true\ncommands = ["ls"]\n')
    path = record_run(signer, tmp_path / "p.tkb", policy=policy, commands=(["ls"], ["curl", "x"]))
    run = open_run(path)
    exec_rows = [c for c in run.crossings() if c.door == "exec"]
    assert all(c.args["policy"] == policy.hash for c in exec_rows)
    curl = next(c for c in exec_rows if c.args.get("argv") == ["curl", "x"])
    assert curl.decision == "deny" and curl.rule_ids == ["TKB-POLICY-DENY"] and curl.args["rule"] == "exec.commands"
    assert run.box["policy"]["hash"] == policy.hash
    assert verify_bundle(path).valid


def test_dataframe_has_one_row_per_crossing_with_proper_dtypes(bundle):
    df = open_run(bundle).to_dataframe()
    assert list(df["door"]) == ["box", "exec", "exec", "box"]
    assert str(df["time"].dtype).startswith("datetime64") and str(df["door"].dtype) == "category"
    assert df["seq"].dtype == "int64" and df["seq"].is_monotonic_increasing
    assert df.loc[1, "summary"] == "print(1)" and df.loc[2, "summary"] == "ls -l"
    assert df.loc[1, "content"].startswith("sha256:")


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_show_formats(bundle, fmt):
    r = run_cli("show", str(bundle), "--format", fmt, "--door", "exec")
    assert r.returncode == 0, r.stderr
    if fmt == "json":
        rows = json.loads(r.stdout)
        assert [row["door"] for row in rows] == ["exec", "exec"]
    else:
        assert "print(1)" in r.stdout and "box.start" not in r.stdout


def test_signer_directory_is_host_only(signer):
    for path in (signer.home, signer.dir, signer.runs_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert "ack-on-fsync" in signer.config_path.read_text()
    assert "default: closed" in signer.config_path.read_text()


def test_salts_match_tracekits_reveal(bundle, signer):
    from tracekit.signer.service import reveal
    run = open_run(bundle)
    d = run.disclosure(run.crossings()[1].seq)
    e = next(e for e in run.records if e["run_seq"] == d["run_seq"])
    assert reveal(str(signer.data_dir), e["seq"])["salt"] == d["salt"]


def test_killed_signer_makes_every_door_refuse_from_then_on(private_signer):
    rec = RunRecorder(private_signer, Policy.default(), {"backend": "none", "isolation": "none",
                                                         "image_digest": "none"}).open()
    ok = rec.decide("exec", "command", {"argv": ["ls"]})
    assert ok.allowed
    os.kill(private_signer.pid(), signal.SIGKILL)
    time.sleep(0.2)
    refused = rec.decide("exec", "command", {"argv": ["ls"]})
    assert not refused.allowed and refused.rule_ids == [UNAVAILABLE_RULE]
    private_signer.ensure()  # the signer comes back: this run stays refused
    assert private_signer.answering()
    again = rec.decide("exec", "cell", {}, {"code": b"1"})
    assert not again.allowed and again.rule_ids == [UNAVAILABLE_RULE]
    rec.close("signer lost")


def _wait_all_threads_stopped(pid: int) -> None:
    """SIGSTOP stops a process's threads asynchronously: on a loaded machine one of them can still answer a frame
    after kill() returned. Wait until every thread is stopped."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"the signer's threads did not all stop: {states}")


def test_stalled_signer_is_refused_at_its_deadline(private_signer):
    rec = RunRecorder(private_signer, Policy.default(), {"backend": "none", "isolation": "none",
                                                         "image_digest": "none"}).open()
    rec._lanes.timeout = 1.0
    pid = private_signer.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_all_threads_stopped(pid)
        t = time.monotonic()
        refused = rec.decide("exec", "command", {"argv": ["ls"]})
        assert time.monotonic() - t < 5
        assert not refused.allowed and refused.rule_ids == [UNAVAILABLE_RULE]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not rec.decide("exec", "command", {"argv": ["ls"]}).allowed
    rec.close("signer stalled")


def test_bundle_from_another_signer_fails_key_substitution(private_signer, signer, tmp_path):
    other = record_run(private_signer, tmp_path / "other.tkb")
    assert verify_bundle(other, private_signer.trust_path).valid  # valid under its own pin
    r = run_cli("verify", str(other), "--trust", str(signer.trust_path))
    assert r.returncode == 1, r.stdout
    assert r.stdout.startswith("INVALID: tracekit")


def test_trust_output_path_is_relative_to_the_working_directory(signer, tmp_path):
    r = run_cli("trust", "-o", "pinned.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "pinned.json").read_text())["logs"]


def test_a_stale_pid_file_never_gets_another_process_killed(private_signer):
    """signer.pid left by a signer that died may name a process that reused the pid: that process is not the signer
    (its cmdline is not `tracekit signer serve --config OUR_CONFIG`), so ensure() and stop() never signal it."""
    private_signer.stop()
    victim = subprocess.Popen(["sleep", "60"])
    try:
        private_signer.pid_path.write_text(f"{victim.pid}\n")
        assert private_signer.pid() is None
        private_signer.ensure()
        signer_pid = private_signer.pid()
        assert signer_pid not in (None, victim.pid)
        private_signer.pid_path.write_text(f"{victim.pid}\n")
        private_signer.stop()
        time.sleep(0.1)
        assert victim.poll() is None
        private_signer.pid_path.write_text(f"{signer_pid}\n")  # the real one, for the fixture to stop
    finally:
        victim.kill()
        victim.wait()


HOLDER = """
import sys, time
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import MachineSigner
rec = RunRecorder(MachineSigner(sys.argv[1]), Policy.coerce(None), {"box_id": "x" * 32, "backend": "bwrap",
                                                                     "isolation": "namespace", "image_digest": None})
rec.open()
c = rec.decide("exec", "command", {"argv": ["echo", "hi"]})
rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"hi\\n", "stderr": b""})
print(rec.spool, flush=True)
time.sleep(120)
"""


def test_a_run_whose_holder_died_mid_line_is_recovered(private_signer, tmp_path):
    """The holder is killed while it writes a disclosure line (before that record's signer call): recovery cuts the
    torn line, closes the run and writes a bundle that verifies."""
    from tkbox_nb.signing.recovery import recover_orphans
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(private_signer.home)], stdout=subprocess.PIPE,
                              text=True)
    try:
        spool = Path(holder.stdout.readline().strip())
        with open(spool / "disclosures.jsonl", "a") as f:
            f.write('{"blobs": {"sha256:00": "QUFBQUFB')
    finally:
        holder.kill()
        holder.wait()
    written = recover_orphans(private_signer)
    assert len(written) == 1 and not (spool / "recover-error.txt").exists()
    assert verify_bundle(written[0], private_signer.trust_path).valid
    assert open_run(written[0]).box["end_reason"].startswith("recovered:")


def test_a_run_closed_by_a_holder_that_died_before_its_bundle_is_bundled_by_recovery(private_signer, tmp_path):
    """The holder closes its run (its stop record signed) and dies before the bundle is written, as a kernel killed
    by its frontend while the export waits for a checkpoint: recovery writes the bundle where it was meant to go, the
    run's own end reason kept, and then nothing is left to recover. While the holder lives, nothing is touched."""
    from tkbox_nb.signing.recovery import recover_orphans
    meant = tmp_path / "meant.tkb"
    closer = HOLDER.replace("print(rec.spool, flush=True)", f"rec.hint_bundle({str(meant)!r})\n"
                            "rec.close('kernel shutdown')\nprint(rec.spool, flush=True)")
    holder = subprocess.Popen([sys.executable, "-c", closer, str(private_signer.home)], stdout=subprocess.PIPE,
                              text=True)
    try:
        spool = Path(holder.stdout.readline().strip())
        assert not (spool / "handle.json").exists() and (spool / "unbundled.json").exists()
        assert recover_orphans(private_signer) == []  # its holder lives: it may still write the bundle
    finally:
        holder.kill()
        holder.wait()
    assert recover_orphans(private_signer) == [meant]
    assert verify_bundle(meant, private_signer.trust_path).valid
    run = open_run(meant)
    assert run.sealed and run.box["end_reason"] == "kernel shutdown"
    assert not (spool / "unbundled.json").exists() and recover_orphans(private_signer) == []
