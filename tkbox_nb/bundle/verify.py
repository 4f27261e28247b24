"""`tkbox verify`: Tracekit's verifier first, then the box layer checked against the signed records.

Tracekit's verifier proves the records are the signer's, whole and in order. On top of that this module proves that
each disclosed item (a decision's arguments, a result, cell code and outputs, the policy source) is the content the
record committed to, that every decision and result of the run is disclosed, that each decision follows from the
disclosed box policy, and that the box manifest says what the records say. The first failing check is the reason.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkbox_nb.bundle.archive import BOX_FORMAT, BundleContents, opens, parse, read_bundle_bytes, read_entries
from tkbox_nb.core.errors import BundleError, PolicyError
from tkbox_nb.bundle.mount_digest import check_disclosed
from tkbox_nb.policy import Policy, policy_hash
from tkbox_nb.bundle.verify_recount import connection_totals, model_totals, unstated_fetches

EXIT_VALID, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
BOX_FIELDS = ("box_id", "backend", "isolation", "image_digest", "tkbox_version", "boot",  # boot: a VM's cold or warm
              "workspace_digest",  # the starting workspace (core/tree_digest.py), when the box was given one
              "rerun_of",  # a rerun's original run
              "unenforced",  # policy limits the box could not enforce, comma-separated (bwrap with no pids cgroup)
              "memory_limit", "gpus",  # what held memory_mib (memory_limit.py); the GPUs a box was given (gpus.py)
              "environment",  # the digest of the environment manifest box.start commits to (bundle/environment.py)
              "notebook", "notebook_dropped")  # the kernel's notebook as its frontend named it, or why not recorded
BOX_OBJECTS = ("mounts",)  # box.start facts that are objects: each dataset mount's target, digest, files, bytes
SIGNED_SINCE = {"rerun_of": (0, 2, 0)}  # fields a box.start of an older tkbox did not sign (its manifest had them)
WHOLE_END_REASON_SINCE = (0, 2, 1)  # before, box.stop signed the first 200 characters of a longer end_reason


def _made_by(signed: dict) -> tuple[int, ...]:
    """The version of the tkbox that made the bundle, as its box.start signed it; () if unreadable."""
    try:
        return tuple(int(x) for x in str(signed.get("tkbox_version")).split(".")[:3])
    except ValueError:
        return ()


def _unsigned_then(field: str, signed: dict) -> bool:
    """A field the box.start of the tkbox that made the bundle (its version is signed there) did not yet sign."""
    made_by = _made_by(signed)
    return bool(made_by) and field in SIGNED_SINCE and field not in signed and made_by < SIGNED_SINCE[field]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class VerifyReport:
    """The verdict on one bundle. `record_status` maps run_seq to "valid" or the check that failed for that record."""

    path: str
    exit_code: int = EXIT_UNREADABLE
    checks: list[Check] = field(default_factory=list)
    tracekit: list[dict[str, Any]] = field(default_factory=list)
    integrity: str = ""
    assurance: str = ""
    trust_path: str = ""
    trust_source: str = ""
    record_status: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # Tracekit's warn-level checks (a signed gap, ...), shown
    records: int = 0  # the run's records the box layer read, for the plain line
    decisions: int = 0  # decisions re-derived from the disclosed policy
    signed_by: str = ""  # the log whose checkpoint Tracekit's verifier checked under the pinned key (its origin)

    @property
    def valid(self) -> bool:
        return self.exit_code == EXIT_VALID

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    def summary(self) -> str:
        """The verdict in plain words: what was checked, for a valid bundle (`detail()` is Tracekit's terms), or the
        first check that failed."""
        if not self.valid:
            return self.detail()
        opened = "" if self.integrity == "VERIFIED" else \
            "; the run is still open: what it holds so far is checked, not that it is complete"
        n, d = self.records, self.decisions
        return (f"VALID: {n} record{'s' * (n != 1)} signed by {self.signed_by or 'the pinned signer'}, the chain "
                "intact, every disclosed cell and file matches its signed digest, "
                f"{'all' if d != 1 else 'its'} {d} decision{'s' * (d != 1)} follow{'s' * (d == 1)} from the run's "
                f"policy{opened}") + self._warned()

    def detail(self) -> str:
        """The verdict in Tracekit's terms (integrity and assurance: `tkbox verify --verbose`, and `--json`'s
        summary), or the first check that failed."""
        if self.valid:
            return f"VALID: {self.integrity}; {self.assurance}".rstrip("; ") + self._warned()
        bad = self.first_failure
        word = "UNREADABLE" if self.exit_code == EXIT_UNREADABLE else "INVALID"
        return f"{word}: {bad.name}: {bad.detail}" if bad else word

    def _warned(self) -> str:
        return f"; WARNING: {'; '.join(self.warnings)}"[:400] if self.warnings else ""

    def as_dict(self) -> dict[str, Any]:
        return {"bundle": self.path, "valid": self.valid, "exit_code": self.exit_code, "summary": self.detail(),
                "integrity": self.integrity, "assurance": self.assurance, "trust": self.trust_path,
                "trust_source": self.trust_source, "checks": [c.as_dict() for c in self.checks],
                "tracekit_checks": self.tracekit, "warnings": self.warnings,
                "records": {str(k): v for k, v in sorted(self.record_status.items())}}


def verify_bundle(path: str | Path, trust: str | Path | None = None, data: bytes | None = None) -> VerifyReport:
    """Verify one `.tkb`. `trust`: a trust config; None uses this machine's pinned trust. `data`: the bundle's bytes
    already read (the ones a caller goes on to use), so that what is verified is what is used."""
    from tkbox_nb.core.home import trust_path
    report = VerifyReport(path=str(path))
    if trust is None:
        report.trust_path, report.trust_source = str(trust_path()), "this machine's pinned trust"
    else:
        report.trust_path, report.trust_source = str(trust), "given"
    if not Path(report.trust_path).is_file():
        report.add("trust", False, f"no trust config at {report.trust_path} (run `tkbox trust` or pass --trust)")
        return report
    from tracekit.verify.v2 import load_trust
    try:  # a bad trust config is the caller's input, not the bundle's fault: unreadable (2), never INVALID (1)
        load_trust(report.trust_path)
    except Exception as e:
        report.add("trust", False, f"{report.trust_path} is not a trust config ({type(e).__name__}: {str(e)[:200]})")
        return report
    try:
        data = read_bundle_bytes(path) if data is None else data
    except BundleError as e:
        report.add("bundle readable", False, str(e))
        return report
    return verify_bytes(data, report)


def verify_bytes(data: bytes, report: VerifyReport) -> VerifyReport:
    """The checks of `verify_bundle` on a bundle's bytes (pure but for reading `report.trust_path`; fuzzed)."""
    try:
        contents = parse(read_entries(data))
    except BundleError as e:
        report.add("bundle readable", False, str(e))
        return report
    report.add("bundle readable", True, f"{len(contents.files)} entries")
    report.signed_by = next((body.split(b"\n", 1)[0].decode("utf-8", "replace")[:200] for name, body in
                             sorted(contents.files.items()) if re.fullmatch(r"checkpoints/.*\.note", name)), "")
    _tracekit(report, io.BytesIO(data), report.trust_path)
    _box_layer(report, contents)
    report.exit_code = EXIT_VALID if all(c.ok for c in report.checks) else EXIT_INVALID
    return report


def _tracekit(report: VerifyReport, bundle: io.BytesIO, trust_path: str) -> None:
    from tracekit.verify.v2 import verify as tracekit_verify
    # called as is: swapping sys.stdout around it (redirect_stdout) is process-wide, and two verifications in two
    # threads (boxes ending at once, a widget's Verify) left it pointing at a dead buffer
    rep, code = tracekit_verify(bundle, trust_path)
    report.tracekit = list(rep.checks)
    report.integrity = str(getattr(rep, "integrity", "") or "")
    report.assurance = str(rep.assurance or "")
    failed = [c for c in rep.checks if c.get("status") == "fail"]
    # a warning (a signed gap: an event the signer never received; held calls) leaves what the records prove intact,
    # but a reader must see it: it is named in the verdict, which stays VALID
    for c in rep.checks:
        if c.get("status") == "warn":
            problems = "; ".join(str(p) for p in c.get("problems") or [])[:200]
            report.warnings.append(f"{c.get('check')}: {c.get('detail') or ''} {problems}".strip()[:300])
    if code == 0 and not failed:
        report.add("tracekit", True, f"Integrity: {report.integrity}")
    else:
        c = failed[0] if failed else {"check": "verify", "detail": report.integrity}
        problems = "; ".join(str(p) for p in c.get("problems") or [])[:300]
        report.add("tracekit", False, f"{c['check']}: {c.get('detail') or ''} {problems}".strip())


def _shown_reason(box: dict[str, Any], start: dict) -> str:
    """The part of the manifest's end_reason the signed box.stop covers: all of it since WHOLE_END_REASON_SINCE."""
    shown = str(box.get("end_reason"))
    return shown if _made_by(start) >= WHOLE_END_REASON_SINCE else shown[:200]


def signed_content(body: Any) -> dict[str, tuple[str, int]]:
    """The content a disclosed statement commits to: each key K whose value is a sha256 digest with K_size (an
    integer) beside it, as the recorder states content (recorder._stated, complete): K -> (digest, size)."""
    if not isinstance(body, dict):
        return {}
    return {k: (v, body[k + "_size"]) for k, v in body.items() if isinstance(k, str) and isinstance(v, str)
            and _DIGEST.fullmatch(v) and isinstance(body.get(k + "_size"), int)
            and not isinstance(body.get(k + "_size"), bool)}


def box_manifest_types(box: dict[str, Any]) -> str:
    """What in box/manifest.json is not of the type the checks (and every reader of a run) take it to be, or ""."""
    if not isinstance(box.get("run_id"), str):
        return "run_id is not a string"
    for key in BOX_FIELDS + ("end_reason", "started", "ended", "broken"):
        if box.get(key) is not None and not isinstance(box[key], str):
            return f"{key} is not a string"
    policies = box.get("policies")
    if not isinstance(policies, list) or not all(isinstance(h, str) for h in policies):
        return "policies is not a list of policy hashes"
    if not isinstance(box.get("policy"), dict) or not isinstance(box["policy"].get("hash"), str):
        return "policy is not an object naming the starting policy's hash"
    return ""


def _box_layer(report: VerifyReport, b: BundleContents) -> None:
    try:
        _box_checks(report, b)
    except Exception as e:  # a shape no check above foresaw: the bundle fails, never the verifier
        report.add("bundle structure", False, f"the box layer cannot be read ({type(e).__name__}: {str(e)[:120]})")


def _box_checks(report: VerifyReport, b: BundleContents) -> None:
    from tracekit.format.canon import canonical, event_hash

    listed = b.manifest["files"]
    unlisted = sorted(set(b.files) - set(listed) - {"manifest.json"})
    missing = sorted(set(listed) - set(b.files))
    wrong = sorted(n for n, h in listed.items() if n in b.files and hashlib.sha256(b.files[n]).hexdigest() != h)
    report.add("manifest", not (unlisted or missing or wrong),
               f"unlisted {unlisted[:3]}, missing {missing[:3]}, hash differs {wrong[:3]}"
               if unlisted or missing or wrong else "every file listed with its SHA-256")
    for p in b.problems:
        report.add("box content", False, p)
    if b.box is None:
        report.add("box manifest", False, "no box/manifest.json: not a tkbox bundle")
        return
    if b.box.get("format") != BOX_FORMAT:
        report.add("box manifest", False, f"format is {b.box.get('format')!r}, not {BOX_FORMAT}")
        return
    wrong_type = box_manifest_types(b.box)
    if wrong_type:
        report.add("box manifest", False, wrong_type)
        return
    present = sorted(n for n in b.files if re.fullmatch(r"box/content-[0-9]{4}\.jsonl", n))
    if "content_files" in b.box and b.box["content_files"] != present:
        report.add("box manifest", False, f"content_files names {str(b.box['content_files'])[:120]}; the bundle "
                   f"holds {present[:5]}")
    events = {}
    for r in b.records:  # only records of the shape the checks below read; Tracekit's verifier judges the rest
        e = r.get("event") if isinstance(r, dict) else None
        if isinstance(e, dict) and isinstance(e.get("run_seq"), int) and isinstance(e.get("run_id"), str) \
                and isinstance(e.get("type"), str) and isinstance(e.get("data"), dict):
            events[e["run_seq"]] = e
    run_ids = {e.get("run_id") for e in events.values()}
    if not report.add("run", len(run_ids) == 1 and b.box.get("run_id") in run_ids,
                      f"box/manifest.json names run {b.box.get('run_id')!r}; records hold {sorted(map(str, run_ids))}"):
        return
    for seq in events:
        report.record_status[seq] = "valid"
    report.records = len(events)

    def fail_record(seq: Any, check: str, detail: str) -> None:
        report.add(check, False, f"record {seq}: {detail}")
        if seq in report.record_status and report.record_status[seq] == "valid":
            report.record_status[seq] = f"{check}: {detail}"

    # policies: each disclosed source hashes to its name
    policies: dict[str, Policy] = {}
    for h, source in b.policies.items():
        if policy_hash(source) != h:
            report.add("policy source", False, f"box/policies/{h[7:19]}... does not hash to its name")
            continue
        try:
            policies[h] = Policy.from_toml(source, f"policy {h[7:19]}")
        except PolicyError as e:
            report.add("policy source", False, str(e))
    # disclosures: each opens its record's commitment
    disclosed: dict[tuple[int, str], dict] = {}
    for i, d in enumerate(b.disclosures):
        where = "%s line %d" % (b.disclosure_lines[i] if i < len(b.disclosure_lines)
                                else ("box/disclosures.jsonl", i + 1))
        if not (isinstance(d, dict) and isinstance(d.get("run_seq"), int) and isinstance(d.get("salt"), str)
                and _HEX64.fullmatch(d["salt"]) and d.get("type") in ("policy.decision", "tool.result")
                and isinstance(d.get("content"), dict)):
            report.add("disclosure", False, f"{where}: not a well-formed disclosure")
            continue
        seq, kind = d["run_seq"], d["type"]
        e = events.get(seq)
        if e is None or e.get("type") != kind:
            report.add("disclosure", False, f"{where}: run_seq {seq} is not a {kind} record of the run")
            continue
        if (seq, kind) in disclosed:
            fail_record(seq, "disclosure", "disclosed twice")
            continue
        disclosed[(seq, kind)] = d
        salt = bytes.fromhex(d["salt"])
        data = e.get("data") or {}
        try:
            if kind == "policy.decision":
                body = d.get("args")
                digest = event_hash({"tool": data.get("tool"), "args": body})
                commitment = data.get("args_commitment")
            else:
                body = d.get("result")
                digest = "sha256:" + hashlib.sha256(canonical({"result": body})).hexdigest()
                commitment = (data.get("output") or {}).get("hash")
        except Exception as ex:  # not canonical JSON
            fail_record(seq, "commitment", f"disclosed content cannot be canonicalized ({type(ex).__name__})")
            continue
        if not isinstance(body, dict):
            fail_record(seq, "commitment", "disclosed content is not an object")
            continue
        if not opens(salt, digest, commitment):
            fail_record(seq, "commitment", "the salt and disclosed content do not open the record's commitment")
            continue
        for key, ref in d["content"].items():
            if body.get(key) != ref or not isinstance(ref, str):
                fail_record(seq, "content", f"content {key!r} is not the digest the record commits to")
            elif ref not in b.content:
                fail_record(seq, "content", f"content {key!r} ({ref[:19]}...) is not in the bundle")
            elif "sha256:" + hashlib.sha256(b.content[ref]).hexdigest() != ref:
                fail_record(seq, "content", f"content {key!r} does not hash to {ref[:19]}... (altered)")
        for key, (ref, size) in signed_content(body).items():  # what the record commits to, whatever the index says
            if ref not in b.content:
                fail_record(seq, "content", f"content {key!r} ({ref[:19]}...) the record commits to is not in "
                            "the bundle")
            elif len(b.content[ref]) != size:
                fail_record(seq, "content", f"content {key!r} is {len(b.content[ref])} bytes, not the {size} signed")
    # every content item is the bytes its digest names, and is disclosed by some record: the `content` index of a
    # disclosure is not signed, so a blob left out of it must still be the bytes its name commits to
    referenced = {ref for d in disclosed.values() for ref in d["content"].values() if isinstance(ref, str)}
    referenced |= {ref for d in disclosed.values() for ref, _ in signed_content(d.get("args") if "args" in d
                                                                               else d.get("result")).values()}
    for ref, blob in sorted(b.content.items()):
        if "sha256:" + hashlib.sha256(blob).hexdigest() != ref:
            report.add("content", False, f"content {ref[:19]}... does not hash to its digest (altered)")
        elif ref not in referenced:
            report.add("content", False, f"content {ref[:19]}... is disclosed by no record")
    # completeness: every decision and result of the run is disclosed
    for seq, e in sorted(events.items()):
        if e.get("type") in ("policy.decision", "tool.result") and (seq, e["type"]) not in disclosed:
            fail_record(seq, "completeness", f"{e['type']} is not disclosed")
    # re-derivation: each decision follows from the disclosed box policy
    starts, stops = [], []
    for (seq, kind), d in sorted(disclosed.items()):
        if kind != "policy.decision" or report.record_status.get(seq) != "valid":
            continue
        args, data = d["args"], events[seq]["data"]
        if data.get("tool") == "box.start":
            starts.append((seq, args))
        elif data.get("tool") == "box.stop":
            stops.append((seq, args))
        pol = policies.get(args.get("policy"))
        if pol is None:
            fail_record(seq, "policy", f"names policy {str(args.get('policy'))[:19]}..., which the bundle lacks")
            continue
        facts = {k: v for k, v in args.items() if k not in ("policy", "verdict", "rule", "verdict_reason")}
        why = unstated_fetches(args, b.content)
        if why:
            fail_record(seq, "model fetches", why)
        v = pol.decide(facts)
        stated = (args.get("verdict"), args.get("rule"), args.get("verdict_reason", ""))
        if (v.verdict, v.rule, v.reason[:500]) != stated:
            fail_record(seq, "re-derivation", f"the policy gives {v.verdict} by {v.rule}, the record states "
                                              f"{stated[0]} by {stated[1]}")
        elif v.verdict == "deny" and data.get("decision") != "deny":
            fail_record(seq, "re-derivation", f"the box policy denies it but the signer decided {data.get('decision')}")
    model_totals(events, disclosed, fail_record)
    connection_totals(events, disclosed, fail_record)
    # the readable diff is exactly what the last patch summary committed to
    summaries = [d for (seq, kind), d in sorted(disclosed.items()) if kind == "policy.decision"
                 and isinstance(d.get("args"), dict) and d["args"].get("door") == "patch"
                 and d["args"].get("kind") == "summary" and report.record_status.get(seq) == "valid"]
    if "box/patch.diff" in b.files:
        want = summaries[-1]["args"].get("diff") if summaries else None
        got = "sha256:" + hashlib.sha256(b.files["box/patch.diff"]).hexdigest()
        report.add("patch diff", want == got, "box/patch.diff is the diff the last patch summary commits to"
                   if want == got else "box/patch.diff is not the diff the last signed patch summary commits to")
    # the box manifest against the records
    if not starts:
        report.add("box manifest", False, "no disclosed box.start record")
    else:
        seq, args = starts[0]
        differs = [k for k in BOX_FIELDS + BOX_OBJECTS if b.box.get(k) != args.get(k) and not _unsigned_then(k, args)]
        mounts_problem = check_disclosed(args.get("mounts"), b.files)
        first_policy = (b.box.get("policy") or {}).get("hash") if isinstance(b.box.get("policy"), dict) else None
        if differs:
            report.add("box manifest", False, f"{', '.join(differs)} disagree with the signed box.start record {seq}")
        elif first_policy != args.get("policy"):
            report.add("box manifest", False, f"policy.hash disagrees with the signed box.start record {seq}")
        elif stops and _shown_reason(b.box, args) != str(stops[-1][1].get("reason")):
            report.add("box manifest", False, f"end_reason disagrees with the signed box.stop record {stops[-1][0]}")
        elif stops and b.box.get("mounts_changed") != stops[-1][1].get("mounts_changed"):
            report.add("box manifest", False, f"mounts_changed disagrees with the signed box.stop {stops[-1][0]}")
        elif mounts_problem:
            report.add("mounts", False, mounts_problem)
        elif not set(b.box.get("policies") or []) >= {d["args"].get("policy") for (s, k), d in disclosed.items()
                                                     if k == "policy.decision" and isinstance(d.get("args"), dict)}:
            report.add("box manifest", False, "the policies list lacks a policy the records name")
        else:
            report.add("box manifest", True, f"box {args.get('box_id')} ({args.get('backend')}, "
                                             f"{args.get('isolation')}) agrees with record {seq}")
            if isinstance(args.get("mounts"), dict) and args["mounts"]:
                report.add("mounts", True, f"{len(args['mounts'])} mount list(s) open their signed digests")
            changed = stops[-1][1].get("mounts_changed") if stops else None
            if isinstance(changed, dict) and changed:  # signed by the box's stop: shown with the verdict
                report.warnings.append("data changed under a mount while the box ran: " + "; ".join(
                    f"{n}: {', '.join(map(str, p[:3] if isinstance(p, list) else []))}" for n, p in changed.items()))
    n_dec = sum(1 for k in disclosed if k[1] == "policy.decision")
    report.decisions = n_dec
    if all(c.ok for c in report.checks):
        report.add("disclosures", True, f"{len(disclosed)} item(s) open their commitments; {n_dec} decision(s) "
                                        "re-derived from the disclosed policy")
