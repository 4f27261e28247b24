"""Model replay serves the responses of the very bytes it verified (I7): `recordings_from_bundle` (and so
`Box(model_replay=PATH)`, which calls it) reads the bundle once. The sample bundle is verified for real; the swap is
made at the one moment an attacker needs, right after the real verification returns, by wrapping it."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

from conftest import forged_bundle

import tkbox_nb.bundle.verify
from tkbox_nb.bundle.archive import read_bundle_file
from tkbox_nb.doors.model_replay import recordings_from_bundle
from tkbox_nb.bundle.read_back import open_run

SAMPLES = Path(__file__).resolve().parent.parent / "notebooks" / "samples"


def altered(src: Path, out: Path) -> tuple[bytes, tuple[str, str, str]]:
    """A copy of `src` whose first model response is other bytes, its digests made to match (it does not verify,
    and need not: the swap comes after the check). Returns the original response and its call's key."""
    run = open_run(src)
    call = next(c for c in run.crossings() if c.door == "model" and c.decision == "allow")
    old = call.result["response"]
    body = run.content(old)
    forged = body.replace(b"assistant", b"attacker!")
    assert forged != body
    new = "sha256:" + hashlib.sha256(forged).hexdigest()
    files = read_bundle_file(src)
    for name in [n for n in files if n.startswith("box/content-")]:
        lines = []
        for line in files[name].split(b"\n"):
            if line and json.loads(line)["digest"] == old:
                line = json.dumps({"digest": new, "b64": base64.b64encode(forged).decode()}).encode()
            lines.append(line)
        files[name] = b"\n".join(lines)
    files["box/disclosures.jsonl"] = files["box/disclosures.jsonl"].replace(old.encode(), new.encode())
    forged_bundle(files, out)
    assert open_run(out).content(new) == forged
    return body, (call.args["provider"], call.args["endpoint"], call.args["request"])


def test_a_bundle_swapped_between_verify_and_model_replay_serves_the_verified_responses(tmp_path, monkeypatch):
    bundle = tmp_path / "calls.tkb"
    shutil.copy(SAMPLES / "model-calls.tkb", bundle)
    original, key = altered(bundle, tmp_path / "swapped.tkb")
    real = tkbox_nb.bundle.verify.verify_bundle
    swapped = []

    def verify_then_swap(path, trust=None, **kw):
        report = real(path, trust, **kw)
        shutil.copy(tmp_path / "swapped.tkb", bundle)  # the attacker's move, once the check has passed
        swapped.append(report.valid)
        return report
    monkeypatch.setattr(tkbox_nb.bundle.verify, "verify_bundle", verify_then_swap)
    recordings = recordings_from_bundle(bundle, SAMPLES / "trust.json")
    assert swapped == [True]
    served = recordings.take(key)
    assert served is not None and served.body == original
