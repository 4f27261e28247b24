"""The box layer of `tkbox verify`: what a bundle adds to Tracekit's records, checked against them, one invariant of
docs/threat-model.md per function.

Tracekit's verifier (bundle/verify.py runs it first) proves the records are the signer's, whole and in order. These
checks prove that each disclosed item is the content its record committed to, that nothing is withheld, that each
decision follows from the disclosed box policy, and that the box manifest says what the records say. They run in the
order of `BOX_CHECKS`, each adding its named checks to the report; the first failing one is the reason. A check
returns False where nothing after it can be read (no box manifest, records of another run): the layer ends there.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from tkbox_nb.bundle.archive import BOX_FORMAT, BundleContents, opens
from tkbox_nb.bundle.mount_digest import check_disclosed
from tkbox_nb.bundle.verify_recount import connection_totals, model_totals, unstated_fetches
from tkbox_nb.bundle.verify_report import VerifyReport
from tkbox_nb.rules.door_table import BOX, PATCH, tool_of
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy, policy_hash

_HEX64 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
START_TOOL, STOP_TOOL = tool_of(BOX, "start"), tool_of(BOX, "stop")  # the box's own decisions (rules/door_table.py)
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


@dataclass
class BoxLayer:
    """One bundle's box layer as the checks read it, and what earlier checks found that later ones use."""

    report: VerifyReport
    b: BundleContents
    events: dict[int, dict] = field(default_factory=dict)  # run_seq -> record, of the shape the checks read
    policies: dict[str, Policy] = field(default_factory=dict)  # hash -> each disclosed source that hashes to it
    disclosed: dict[tuple[int, str], dict] = field(default_factory=dict)  # (run_seq, type) -> opened disclosure
    starts: list[tuple[int, dict]] = field(default_factory=list)  # (run_seq, args) of each valid box.start
    stops: list[tuple[int, dict]] = field(default_factory=list)  # and of each valid box.stop

    def fail_record(self, seq: Any, check: str, detail: str) -> None:
        """A failed check of one record: the report's reason, and the record's status unless an earlier one failed."""
        self.report.add(check, False, f"record {seq}: {detail}")
        if seq in self.report.record_status and self.report.record_status[seq] == "valid":
            self.report.record_status[seq] = f"{check}: {detail}"


def _files_listed(s: BoxLayer) -> bool:
    """I5, I8: every file is listed in Tracekit's manifest with its SHA-256, and nothing else is in the bundle."""
    b = s.b
    listed = b.manifest["files"]
    unlisted = sorted(set(b.files) - set(listed) - {"manifest.json"})
    missing = sorted(set(listed) - set(b.files))
    wrong = sorted(n for n, h in listed.items() if n in b.files and hashlib.sha256(b.files[n]).hexdigest() != h)
    s.report.add("manifest", not (unlisted or missing or wrong),
                 f"unlisted {unlisted[:3]}, missing {missing[:3]}, hash differs {wrong[:3]}"
                 if unlisted or missing or wrong else "every file listed with its SHA-256")
    return True


def _content_files_read(s: BoxLayer) -> bool:
    """I5: each content item is a well-formed {digest, b64} item, in the bundle once."""
    for p in s.b.problems:
        s.report.add("box content", False, p)
    return True


def _box_manifest_readable(s: BoxLayer) -> bool:
    """I6: a box manifest of this format, of the types every reader takes it to be; else the layer ends here."""
    box = s.b.box
    if box is None:
        s.report.add("box manifest", False, "no box/manifest.json: not a tkbox bundle")
        return False
    if box.get("format") != BOX_FORMAT:
        s.report.add("box manifest", False, f"format is {box.get('format')!r}, not {BOX_FORMAT}")
        return False
    wrong_type = box_manifest_types(box)
    if wrong_type:
        s.report.add("box manifest", False, wrong_type)
        return False
    return True


def _content_files_named(s: BoxLayer) -> bool:
    """I5: the box manifest's content_files are the content files the bundle holds."""
    b = s.b
    present = sorted(n for n in b.files if re.fullmatch(r"box/content-[0-9]{4}\.jsonl", n))
    if "content_files" in b.box and b.box["content_files"] != present:
        s.report.add("box manifest", False, f"content_files names {str(b.box['content_files'])[:120]}; the bundle "
                     f"holds {present[:5]}")
    return True


def _one_run(s: BoxLayer) -> bool:
    """I6: the records are of one run, the one the box manifest names; else the layer ends here."""
    b, report = s.b, s.report
    for r in b.records:  # only records of the shape the checks below read; Tracekit's verifier judges the rest
        e = r.get("event") if isinstance(r, dict) else None
        if isinstance(e, dict) and isinstance(e.get("run_seq"), int) and isinstance(e.get("run_id"), str) \
                and isinstance(e.get("type"), str) and isinstance(e.get("data"), dict):
            s.events[e["run_seq"]] = e
    run_ids = {e.get("run_id") for e in s.events.values()}
    if not report.add("run", len(run_ids) == 1 and b.box.get("run_id") in run_ids,
                      f"box/manifest.json names run {b.box.get('run_id')!r}; records hold {sorted(map(str, run_ids))}"):
        return False
    report.records = len(s.events)
    for seq in s.events:
        report.record_status[seq] = "valid"
    return True


def _policy_sources(s: BoxLayer) -> bool:
    """I3: each disclosed policy source hashes to its name and loads as a box policy."""
    for h, source in s.b.policies.items():
        if policy_hash(source) != h:
            s.report.add("policy source", False, f"box/policies/{h[7:19]}... does not hash to its name")
            continue
        try:
            s.policies[h] = Policy.from_toml(source, f"policy {h[7:19]}")
        except PolicyError as e:
            s.report.add("policy source", False, str(e))
    return True


def _disclosures_open_commitments(s: BoxLayer) -> bool:
    """I5: each disclosure names a record of the run of its type, once, and opens its commitment; the content its
    index or its signed statement names is in the bundle, at the digest and size signed."""
    from tracekit.format.canon import canonical, event_hash
    b, report, fail_record = s.b, s.report, s.fail_record
    for i, d in enumerate(b.disclosures):
        where = "%s line %d" % (b.disclosure_lines[i] if i < len(b.disclosure_lines)
                                else ("box/disclosures.jsonl", i + 1))
        if not (isinstance(d, dict) and isinstance(d.get("run_seq"), int) and isinstance(d.get("salt"), str)
                and _HEX64.fullmatch(d["salt"]) and d.get("type") in ("policy.decision", "tool.result")
                and isinstance(d.get("content"), dict)):
            report.add("disclosure", False, f"{where}: not a well-formed disclosure")
            continue
        seq, kind = d["run_seq"], d["type"]
        e = s.events.get(seq)
        if e is None or e.get("type") != kind:
            report.add("disclosure", False, f"{where}: run_seq {seq} is not a {kind} record of the run")
            continue
        if (seq, kind) in s.disclosed:
            fail_record(seq, "disclosure", "disclosed twice")
            continue
        s.disclosed[(seq, kind)] = d
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
    return True


def _content_disclosed(s: BoxLayer) -> bool:
    """I5: every content item is the bytes its digest names and is disclosed by some record (the `content` index of a
    disclosure is not signed, so an item left out of it must still be the bytes its name commits to)."""
    disclosed = s.disclosed
    referenced = {ref for d in disclosed.values() for ref in d["content"].values() if isinstance(ref, str)}
    referenced |= {ref for d in disclosed.values() for ref, _ in signed_content(d.get("args") if "args" in d
                                                                               else d.get("result")).values()}
    for ref, blob in sorted(s.b.content.items()):
        if "sha256:" + hashlib.sha256(blob).hexdigest() != ref:
            s.report.add("content", False, f"content {ref[:19]}... does not hash to its digest (altered)")
        elif ref not in referenced:
            s.report.add("content", False, f"content {ref[:19]}... is disclosed by no record")
    return True


def _nothing_withheld(s: BoxLayer) -> bool:
    """I5: every decision and result of the run is disclosed."""
    for seq, e in sorted(s.events.items()):
        if e.get("type") in ("policy.decision", "tool.result") and (seq, e["type"]) not in s.disclosed:
            s.fail_record(seq, "completeness", f"{e['type']} is not disclosed")
    return True


def _decisions_rederive(s: BoxLayer) -> bool:
    """I3, I66: each valid decision follows from its disclosed box policy and states every fetch its model request
    names; the valid box.start and box.stop decisions are kept for the manifest's check."""
    report, fail_record = s.report, s.fail_record
    for (seq, kind), d in sorted(s.disclosed.items()):
        if kind != "policy.decision" or report.record_status.get(seq) != "valid":
            continue
        args, data = d["args"], s.events[seq]["data"]
        if data.get("tool") == START_TOOL:
            s.starts.append((seq, args))
        elif data.get("tool") == STOP_TOOL:
            s.stops.append((seq, args))
        pol = s.policies.get(args.get("policy"))
        if pol is None:
            fail_record(seq, "policy", f"names policy {str(args.get('policy'))[:19]}..., which the bundle lacks")
            continue
        facts = {k: v for k, v in args.items() if k not in ("policy", "verdict", "rule", "verdict_reason")}
        why = unstated_fetches(args, s.b.content)
        if why:
            fail_record(seq, "model fetches", why)
        v = pol.decide(facts)
        stated = (args.get("verdict"), args.get("rule"), args.get("verdict_reason", ""))
        if (v.verdict, v.rule, v.reason[:500]) != stated:
            fail_record(seq, "re-derivation", f"the policy gives {v.verdict} by {v.rule}, the record states "
                                              f"{stated[0]} by {stated[1]}")
        elif v.verdict == "deny" and data.get("decision") != "deny":
            fail_record(seq, "re-derivation", f"the box policy denies it but the signer decided {data.get('decision')}")
    return True


def _model_totals(s: BoxLayer) -> bool:
    """I42: the run's totals each model call states are recounted from the signed records before it."""
    model_totals(s.events, s.disclosed, s.fail_record)
    return True


def _connection_totals(s: BoxLayer) -> bool:
    """I69: the run's allowed connections each connection states are recounted from the signed records before it."""
    connection_totals(s.events, s.disclosed, s.fail_record)
    return True


def _patch_diff_signed(s: BoxLayer) -> bool:
    """I34: the readable diff is exactly what the last signed patch summary committed to."""
    summaries = [d for (seq, kind), d in sorted(s.disclosed.items()) if kind == "policy.decision"
                 and isinstance(d.get("args"), dict) and d["args"].get("door") == PATCH
                 and d["args"].get("kind") == "summary" and s.report.record_status.get(seq) == "valid"]
    if "box/patch.diff" in s.b.files:
        want = summaries[-1]["args"].get("diff") if summaries else None
        got = "sha256:" + hashlib.sha256(s.b.files["box/patch.diff"]).hexdigest()
        s.report.add("patch diff", want == got, "box/patch.diff is the diff the last patch summary commits to"
                     if want == got else "box/patch.diff is not the diff the last signed patch summary commits to")
    return True


def _manifest_agrees_with_records(s: BoxLayer) -> bool:
    """I6, I78: the box manifest is the signed box.start's and box.stop's (box, policies, end reason, mounts), and
    each mount list opens its signed digest."""
    b, report, starts, stops = s.b, s.report, s.starts, s.stops
    if not starts:
        report.add("box manifest", False, "no disclosed box.start record")
        return True
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
    elif not set(b.box.get("policies") or []) >= {d["args"].get("policy") for (_, k), d in s.disclosed.items()
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
    return True


BOX_CHECKS: tuple[Callable[[BoxLayer], bool], ...] = (
    _files_listed, _content_files_read, _box_manifest_readable, _content_files_named, _one_run, _policy_sources,
    _disclosures_open_commitments, _content_disclosed, _nothing_withheld, _decisions_rederive, _model_totals,
    _connection_totals, _patch_diff_signed, _manifest_agrees_with_records)


def check_box_layer(report: VerifyReport, b: BundleContents) -> None:
    """Every check of `BOX_CHECKS` in order, until one ends the layer; when all held, what they proved, in a line."""
    s = BoxLayer(report, b)
    for check in BOX_CHECKS:
        if not check(s):
            return
    n_dec = sum(1 for k in s.disclosed if k[1] == "policy.decision")
    report.decisions = n_dec
    if all(c.ok for c in report.checks):
        report.add("disclosures", True, f"{len(s.disclosed)} item(s) open their commitments; {n_dec} decision(s) "
                                        "re-derived from the disclosed policy")
