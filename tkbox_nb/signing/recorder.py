"""One box's signed run: every crossing of every door goes through `RunRecorder.decide` and, once done, `complete`.

A crossing passes only on a signed allow. The recorder states the box policy's verdict in the decision's arguments;
the signer's box pack turns it (and its own invariant rules) into the signed decision. Any failure to reach the
signer, a refusal, or a reply that does not fit makes the recorder *broken*: it refuses every crossing from then on,
whether or not the signer comes back (fail closed, no gaps that look like silence).

Content a replay needs (cell code, outputs, commands) never goes to the signer: the arguments hold its SHA-256, the
bytes go to the run's host-only spool (signing/spool.py, which also keeps what recovery needs and writes the bundle),
and the bundle discloses both with the record's salt. A run whose holder died is taken over by signing/recovery.py.

What a box can make its run record is bounded (signing/refusal_caps.py): refusals past a cap counted, a run near full
ended.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tkbox_nb._version import __version__
from tkbox_nb.core.errors import SignerError
from tkbox_nb.policy import Policy, Verdict
from tkbox_nb.policy.refusals import KIND as COUNT_KIND
from tkbox_nb.rules.door_table import BOX, TABLE, Door, tool_of
from tkbox_nb.signing.refusal_caps import COUNTED_RULE, FULL_RULE, RECORD_BYTES, RunBounds
from tkbox_nb.signing.signer import MachineSigner
from tkbox_nb.signing.lanes import RunLanes, lanes_for as _lanes, together
from tkbox_nb.signing.spool import RunSpool, sha256_digest
from tkbox_nb.bundle.box_checks import BOX_FIELDS, BOX_OBJECTS

if TYPE_CHECKING:
    from tkbox_nb.signing.central import CentralSigner

UNAVAILABLE_RULE = "TKB-SIGNER-UNAVAILABLE"
MAX_ARGS_BYTES = 512 * 1024
STOP_WAIT_S = 30.0  # how long a closing run waits for crossings in flight on other lanes


@dataclass
class Crossing:
    """One decided crossing. `allowed` is true only for a signed allow."""

    call_id: str
    tool: str
    args: dict[str, Any]
    verdict: Verdict
    decision: str = "deny"
    rule_ids: list[str] = field(default_factory=list)
    decision_id: str | None = None
    run_seq: int | None = None
    reason: str = ""
    args_digest: str | None = None  # what the signer's commitment opens to; `complete` names it


    @property
    def allowed(self) -> bool:
        return self.decision == "allow" and self.decision_id is not None


class RunRecorder(RunBounds):
    """Opens one run on the machine signer for one box and records its crossings."""

    doors: tuple[Door, ...] = TABLE  # the tool each door's crossings are signed as (rules/door_table.py)

    def __init__(self, signer: "MachineSigner | CentralSigner", policy: Policy, box: dict[str, Any],
                 agent: str = "tkbox", replay_of: str | None = None):
        self.signer = signer
        self.policy = policy
        self.start_policy = policy  # the box manifest names the policy the box started with; later ones are listed
        self.box = dict(box)
        self.agent = agent
        self.broken: str | None = None
        self.on_broken: Any = None  # called with the reason when the run stops taking records (a Box ends itself)
        self.on_refused: Any = None  # called with (door, kind, crossing) for each signed refusal (refusal_notices)
        self.closed = False
        # closing: a crossing that fails after close_run was asked for is "the run is closed", not a lost signer;
        # stopping: the box's stop is the last decision, after those in flight on other lanes, and before no other
        self._closing = self._stopping = False
        self._in_flight = 0
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._seq = 0
        self._client = self._run = None
        self._lanes: RunLanes | None = None  # every call on the run goes through these (signing/lanes.py says why)
        self.run_id: str | None = None
        self.run_spool: RunSpool | None = None  # the run's host-only files (signing/spool.py)
        self.policies: dict[str, Policy] = {}
        self.replay_of = replay_of
        self.bundle_hint: Path | None = None
        self.start_content: dict[str, bytes] = {}  # content box.start commits to (the environment manifest)
        self.counts: dict[tuple[str, str], int] = {}  # (door, decision) -> crossings, for status lines
        self._init_bounds()

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def open(self) -> "RunRecorder":
        self.signer.ensure()
        self._client = self.signer.client()
        agent = {"name": self.agent, "version": __version__}
        try:
            # a rerun names its original in the box manifest (rerun_of), never as Tracekit's replay_of: that registers
            # a `tracekit why` replay arm (an analyzer identity, no decisions), not a rerun; the signer refuses it
            if self.replay_of:
                self.box["rerun_of"] = self.replay_of
            self._run = self._client.run(agent=agent)
        except Exception as e:
            self._client.close()
            raise SignerError(f"the signer refused to open a run: {e}") from None
        self.run_id = self._run.run_id
        self._lanes = _lanes(self.signer, self.run_id, self._run.run_token, self._client)
        self.run_spool = RunSpool(self.signer.runs_dir / self.run_id).create()
        self._write_handle()
        self.box.setdefault("box_id", uuid.uuid4().hex)
        self.box.update(run_id=self.run_id, tkbox_version=__version__, started=_now())
        self._keep_policy(self.policy)
        start = self.decide(BOX, "start", {k: self.box[k] for k in BOX_FIELDS + BOX_OBJECTS if k in self.box},
                            self.start_content or None)
        if not start.allowed:
            self.close("the signer refused the box start")
            raise SignerError(f"the signer refused the box start: {start.reason or start.rule_ids}")
        self.complete(start, "ok", {})
        self._write_box_manifest()
        return self

    @property
    def spool(self) -> Path | None:
        """The run's spool directory (host-only, 0700), once the run is open."""
        return self.run_spool.path if self.run_spool is not None else None

    def _write_handle(self, abandoned: str | None = None) -> None:
        """What another process needs to close this run if this one dies first (RunSpool.write_handle)."""
        self.run_spool.write_handle(self._run.run_token, self.bundle_hint, abandoned)

    def hint_bundle(self, path: str | Path) -> None:
        """Where this run's bundle is meant to go (used if the run has to be recovered)."""
        self.bundle_hint = Path(path)
        if self.run_spool is not None and self._run is not None:
            self._write_handle()

    def resume(self, run: Any, client: Any, spool: RunSpool) -> "RunRecorder":
        """Go on with a run another process opened (`run`: its RunHandle on `client`; `spool`: its spool, reopened):
        signing/recovery.py `adopt` takes over a dead holder's run with it, to close it and write its bundle."""
        self.run_id, self.run_spool = run.run_id, spool
        self._client, self._run = client, run
        self._lanes = _lanes(self.signer, run.run_id, run.run_token, client)
        self._seq = 10**9  # call ids of the adopter never meet the dead process's
        return self

    def set_policy(self, policy: Policy) -> None:
        """Later crossings are decided under `policy`; its source goes into the bundle."""
        self._keep_policy(policy)
        self.policy = policy

    def close(self, reason: str = "box stopped", stop_facts: dict[str, Any] | None = None) -> None:
        """Sign the box's stop (with `stop_facts`: the mounts that changed while it ran) and close the run."""
        if self.closed:
            return
        with self._settled:
            self._stopping = True
            self._settled.wait_for(lambda: self._in_flight == 0, timeout=STOP_WAIT_S)
            if self._timer is not None:
                self._timer.cancel()
        if self._run is not None and not self.broken:
            self._sign_counts(final=True)  # the refusals counted since the last count record, before the stop
            with self._settled:  # and any count a timer took as the box began to stop
                self._settled.wait_for(lambda: self._in_flight == 0, timeout=STOP_WAIT_S)
            stop = self.decide(BOX, "stop", {"reason": reason[:500], **(stop_facts or {})})  # all the manifest shows
            if stop.allowed:
                self.complete(stop, "ok", {})
        self.box.update(ended=_now(), end_reason=reason[:500], broken=self.broken, **(stop_facts or {}))
        self._write_box_manifest()
        self._closing = True
        if self._lanes is not None:
            tails = self._lanes.tails()  # every lane's stream, so an event lost on any of them is a signed gap
            try:
                self._lanes.call("close_run", reason=reason[:200], **({"last_client_seq": tails} if tails else {}))
            except Exception as e:
                self._fail(f"close_run failed: {e}")
        if self.run_spool is not None:
            self.run_spool.close()
        if self._lanes is not None:
            self._lanes.close()
        elif self._client:
            self._client.close()
        self.closed = True
        if self.run_spool is not None and self.broken and self._run is not None:
            self._write_handle(abandoned=self.broken)  # closed here but not in the signer: recover it once it answers
        elif self.run_spool is not None:  # closed: nothing left to close, only its bundle to write (recovery)
            self.run_spool.mark_unbundled(self.bundle_hint)

    # -- crossings -----------------------------------------------------------------------------------------------
    def decide(self, door: str, kind: str, facts: dict[str, Any],
               content: dict[str, bytes] | None = None) -> Crossing:
        """Decide one crossing. `content` maps a fact name to bytes that the record commits to by digest."""
        facts, digests, content = self._stated(door, kind, facts, content)
        verdict = self.policy.decide(facts)
        args = dict(facts, policy=self.policy.hash, verdict=verdict.verdict, rule=verdict.rule)
        if verdict.reason:
            args["verdict_reason"] = verdict.reason[:500]
        tool = tool_of(door, kind, self.doors)
        stop_tool = tool_of(BOX, "stop", self.doors)  # a box's stop is signed even while it stops or is full
        with self._lock:
            self._seq += 1
            call_id = f"{door}-{self._seq}"
        crossing = Crossing(call_id, tool, args, verdict)
        if self.broken or self.closed:
            crossing.rule_ids, crossing.reason = [UNAVAILABLE_RULE], self.broken or "the run is closed"
            return crossing
        with self._lock:
            stopping = self._stopping and tool != stop_tool and kind != COUNT_KIND
            if not stopping:
                self._in_flight += 1
        if stopping:
            crossing.rule_ids, crossing.reason = [UNAVAILABLE_RULE], "the box is stopping"
            return crossing
        try:
            if self.full and tool != stop_tool and kind != COUNT_KIND:
                crossing.rule_ids, crossing.reason = [FULL_RULE], self.full
                return crossing
            if verdict.verdict == "deny" and not self._admit(door, kind, verdict):
                crossing.rule_ids, crossing.reason = [COUNTED_RULE], verdict.reason or "refused by the box policy"
                return crossing
            crossing = self._decide_signed(crossing, door, args, digests, content, verdict)
        finally:
            with self._settled:
                self._in_flight -= 1
                self._settled.notify_all()
        if self.on_refused is not None and crossing.decision_id is not None and not crossing.allowed:
            self.on_refused(door, kind, crossing)  # said where it happened (rules/refusal_notices.py); never raises
        return crossing

    def _decide_signed(self, crossing: Crossing, door: str, args: dict[str, Any], digests: dict[str, str],
                       content: dict[str, bytes], verdict: Any) -> Crossing:
        call_id, tool = crossing.call_id, crossing.tool
        raw = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if len(raw) > MAX_ARGS_BYTES:
            crossing.rule_ids, crossing.reason = ["TKB-ARGS-TOO-LARGE"], "the crossing's statement is too large"
            return crossing
        # written ahead of the signer call: if this process dies just after it, the record still has its disclosure
        self._spool({"kind": "decision", "call_id": call_id, "tool": tool, "args": args, "content": digests}, content)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reply = self._lanes.call("decide", tool_call_id=call_id, tool=tool, args=raw, args_source="raw")
        except Exception as e:  # RPCError: refused; anything else (SignerUnavailable, no lane): not usable
            if self._closing:
                crossing.rule_ids, crossing.reason = [UNAVAILABLE_RULE], "the run is closed"
                return crossing
            from tracekit.sdk.client import SignerUnavailable
            lost = isinstance(e, (SignerUnavailable, SignerError))
            self._fail(f"{'signer unavailable' if lost else 'decide failed'}: {e}")
            crossing.rule_ids, crossing.reason = [UNAVAILABLE_RULE], self.broken
            return crossing
        if reply.get("unavailable") or not isinstance(reply.get("decision_id"), str):
            self._fail(f"signer unavailable: {reply.get('reason', 'no decision id')}")
            crossing.rule_ids, crossing.reason = [UNAVAILABLE_RULE], self.broken
            return crossing
        crossing.decision = reply["decision"] if reply.get("decision") in ("allow", "deny", "ask") else "deny"
        if crossing.decision == "ask":  # the box pack holds nothing for a person: a hold is a refusal here
            crossing.decision = "deny"
        crossing.rule_ids = list(reply.get("rule_ids") or [])
        crossing.decision_id = reply["decision_id"]
        crossing.run_seq = reply.get("run_seq")
        if crossing.decision == "allow":  # the digest the signer's commitment opens to, which `complete` must name
            # json.loads, not Tracekit's loads_strict (4x slower here): an allow means the signer parsed `raw` with
            # loads_strict, and for text it accepts both give the same value, so the same JCS digest
            from tracekit.format.canon import event_hash
            crossing.args_digest = event_hash({"tool": tool, "args": json.loads(raw)})
        with self._lock:
            self.counts[(door, crossing.decision)] = self.counts.get((door, crossing.decision), 0) + 1
        self._account(len(raw) + RECORD_BYTES)
        crossing.reason = reply.get("reason", verdict.reason)
        return crossing

    def complete(self, crossing: Crossing, status: str, result: dict[str, Any],
                 content: dict[str, bytes] | None = None) -> bool:
        """Record the end of an allowed crossing. False (and the recorder broken) when the signer did not take it."""
        if not crossing.allowed:
            return False
        content = content or {}
        result = dict(result, status=status)
        digests = {}
        for key, data in content.items():
            result[key] = digests[key] = sha256_digest(data)
            result[key + "_size"] = len(data)
        if self.broken or self.closed:
            return False
        self._spool({"kind": "result", "call_id": crossing.call_id, "result": result, "content": digests}, content)
        self._account(RECORD_BYTES + len(json.dumps(result)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._lanes.call("complete", tool_call_id=crossing.call_id, status="ok" if status == "ok" else "error",
                                 decision_id=crossing.decision_id, args_digest=crossing.args_digest, result=result)
        except Exception as e:
            if not self._closing:
                self._fail(f"complete of {crossing.call_id} was not recorded: {e}")
            return False
        return True

    def decide_many(self, items: list[tuple[str, str, dict[str, Any], dict[str, bytes] | None]]) -> list[Crossing]:
        """Decide crossings that are ready together, (door, kind, facts, content) each, up to lanes.LIMIT at
        once so the signer writes their records under one fsync. Each is `decide` on its own: its own statement, its
        own signed decision (never one shared with another crossing), durable before it is returned. In the order
        given."""
        return together(lambda item: self.decide(*item), items)

    def complete_many(self, items: list[tuple[Crossing, str, dict[str, Any], dict[str, bytes] | None]]) -> list[bool]:
        """`complete` for several crossings at once, (crossing, status, result, content) each; as decide_many."""
        return together(lambda item: self.complete(*item), items)

    def verdict(self, door: str, kind: str, facts: dict[str, Any], content: dict[str, bytes] | None = None) -> Verdict:
        """What the box policy says of this crossing, exactly as `decide` will state it (nothing is signed): for a
        door whose later facts depend on earlier verdicts (a running total) and which decides them together."""
        return self.policy.decide(self._stated(door, kind, facts, content)[0])

    @staticmethod
    def _stated(door: str, kind: str, facts: dict[str, Any], content: dict[str, bytes] | None):
        """(the facts the verdict reads, the content digests, the content): `content` enters as digest and size."""
        content = content or {}
        facts = dict(facts, door=door, kind=kind)
        digests = {}
        for key, data in content.items():
            facts[key] = digests[key] = sha256_digest(data)
            facts[key + "_size"] = len(data)
        return facts, digests, content

    def model_event(self, crossing: Crossing, phase: str, provider: str, model: str, **fields: Any) -> bool:
        """Tracekit's own record of one model exchange (phase request or response), tied to the call's decision by
        its exchange id: provider, model, content digest, usage, stop reason, streamed, error. False (and the
        recorder broken) when the signer did not take it."""
        if not crossing.allowed or self.broken or self.closed:
            return False
        req = {"provider": provider[:64], "model": model[:128], "phase": phase, "exchange_id": crossing.call_id}
        for key, value in fields.items():
            if value is None:
                continue
            req[key] = value[:1000] if key == "error" else value[:100] if key == "stop_reason" else value
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._lanes.call("model_event", **req)
            self._account(RECORD_BYTES + len(json.dumps(req)))
        except Exception as e:
            if not self._closing:
                self._fail(f"model_event of {crossing.call_id} was not recorded: {e}")
            return False
        return True

    # -- failure and spool ---------------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        if not self.broken:
            self.broken = reason[:500]
            if self.on_broken is not None:
                self.on_broken(self.broken)

    def _spool(self, entry: dict, content: dict[str, bytes]) -> None:
        """The record's disclosure into the spool, before the record is asked for (RunSpool.append)."""
        self._account(self.run_spool.append(entry, content))

    def _keep_policy(self, policy: Policy) -> None:
        self.policies[policy.hash] = policy
        if self.run_spool is not None:
            self.run_spool.keep_policy(policy)

    def _write_box_manifest(self) -> None:
        self.run_spool.write_box_manifest(dict(self.box, policy={"hash": self.start_policy.hash,
                                                                 "name": self.start_policy.name},
                                               policies=sorted(self.policies)))

    # -- bundle --------------------------------------------------------------------------------------------------
    def write_bundle(self, out_path: str | Path) -> Path:
        """Export the (closed) run from the signer and add the box layer: one `.tkb`, written atomically."""
        if not self.closed:
            raise SignerError("close the run before writing its bundle")
        return self.run_spool.write_bundle(self.signer, out_path)  # bundled: nothing left for recovery

    def write_snapshot(self, out_path: str | Path) -> Path:
        """The run so far, still open, as a `.tkb` (verifies as open: `VERIFIED TO HEAD n`)."""
        self.run_spool.flush()
        self._write_box_manifest()
        return self.run_spool.write_bundle(self.signer, out_path, final=False)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
