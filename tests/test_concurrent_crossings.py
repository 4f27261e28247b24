"""Crossings decided together (RunRecorder.decide_many over several signer connections, signing/lanes.py): each passes
on its own signed decision only, and a signer killed mid-batch leaves every crossing that passed recorded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from conftest import VENV_BIN
from tracekit.sdk.client import SignerUnavailable

from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import UNAVAILABLE_RULE, RunRecorder
from tkbox_nb.signing.recovery import recover_orphans
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.signing.lanes import LIMIT, DirectClient
from tkbox_nb.bundle.verify import verify_bundle

BOX = {"backend": "none", "isolation": "none", "image_digest": "none"}


def _signed(bundle) -> tuple[dict[str, dict], set[str]]:
    """(tool_use_id -> its policy.decision record's data, decision ids that have a tool.result) of a bundle."""
    records = open_run(bundle).records
    decisions = {e["data"]["tool_use_id"]: e["data"] for e in records if e["type"] == "policy.decision"}
    completed = {e["data"]["decision_id"] for e in records if e["type"] == "tool.result"}
    return decisions, completed


def _tracekit_verifies(bundle, trust) -> None:
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(bundle), "--trust", str(trust)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_batch_of_mixed_crossings_each_pass_on_their_own_decision(signer, tmp_path):
    policy = Policy.from_toml('[exec]\ncells = true\ncommands = ["ls"]\n')
    rec = RunRecorder(signer, policy, BOX).open()
    argvs = [["ls", str(i)] if i % 3 else ["curl", str(i)] for i in range(96)]
    crossings = rec.decide_many([("exec", "command", {"argv": argv}, None) for argv in argvs])
    assert rec._lanes.opened > 1  # really in flight together, over several connections
    assert all(isinstance(lane.client, DirectClient) for lane in rec._lanes._lanes)  # no pipelining client
    done = rec.complete_many([(c, "ok", {"exit_code": 0}, {"stdout": c.call_id.encode()})
                              for c in crossings if c.allowed])
    assert all(done) and not rec.broken
    rec.close("test done")
    bundle = rec.write_bundle(tmp_path / "mixed.tkb")
    assert verify_bundle(bundle, signer.trust_path).valid
    _tracekit_verifies(bundle, signer.trust_path)

    decisions, completed = _signed(bundle)
    ids = [c.decision_id for c in crossings]
    assert len(set(ids)) == len(ids)  # no crossing holds another's decision
    for argv, c in zip(argvs, crossings):
        assert c.args["argv"] == argv  # results come back in the order asked, each with its own statement
        signed = decisions[c.call_id]
        assert signed["decision_id"] == c.decision_id and signed["decision"] == c.decision
        assert c.allowed == (argv[0] == "ls")
        if c.allowed:
            assert c.decision_id in completed
        else:
            assert c.rule_ids == ["TKB-POLICY-DENY"] and c.decision_id not in completed


def test_a_lane_sends_again_on_a_dropped_connection_and_never_connects_once_closed(signer):
    lane = signer.lane_client()
    lane.status({})
    lane._sock.shutdown(socket.SHUT_RDWR)  # the connection drops under the lane
    lane.status({})  # sent again on a new connection
    lane.close()
    with pytest.raises(SignerUnavailable):
        lane.status({})


def test_a_signer_killed_mid_batch_leaves_every_crossing_that_passed_recorded(private_signer, tmp_path):
    rec = RunRecorder(private_signer, Policy.default(), BOX).open()
    rec.hint_bundle(tmp_path / "killed.tkb")
    n = 3000
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(
        rec.decide_many([("exec", "command", {"argv": ["echo", str(i)]}, None) for i in range(n)])))
    worker.start()
    deadline = time.monotonic() + 120
    while rec.counts.get(("exec", "allow"), 0) < 100 and time.monotonic() < deadline and worker.is_alive():
        time.sleep(0.005)
    os.kill(private_signer.pid(), signal.SIGKILL)  # mid-batch: crossings are in flight on several lanes
    worker.join()

    passed = [c for c in out if c.allowed]
    refused = [c for c in out if not c.allowed]
    assert len(out) == n and passed and refused  # the kill did land mid-batch
    assert all(c.rule_ids == [UNAVAILABLE_RULE] for c in refused) and rec.broken
    assert not rec.decide("exec", "command", {"argv": ["echo", "after"]}).allowed  # fail closed from then on
    rec.close("signer killed")

    private_signer.ensure()
    [bundle] = recover_orphans(private_signer)
    assert verify_bundle(bundle, private_signer.trust_path).valid
    _tracekit_verifies(bundle, private_signer.trust_path)
    decisions, _ = _signed(bundle)
    for c in passed:  # every crossing that passed has its durable, signed allow
        signed = decisions.get(c.call_id)
        assert signed is not None and signed["decision_id"] == c.decision_id and signed["decision"] == "allow"
    # a record the signer made durable but never answered is one that was in flight, and it did not pass
    unanswered = [c for c in refused if c.call_id in decisions]
    assert len(unanswered) <= LIMIT
