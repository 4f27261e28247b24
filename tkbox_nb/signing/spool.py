"""One run's host-only spool: what its bundle and its recovery need that the signer does not keep.

Content a replay needs (cell code, outputs, commands) never goes to the signer: a record's arguments hold its SHA-256
and the bytes go here, one line per record in `disclosures.jsonl`, written before the record is asked for, so a
holder that dies just after a signer call still has that record's disclosure. Beside it: `handle.json` (what another
process needs to close the run if its holder dies: signing/recovery.py), `box.json` (the box manifest), `policies/`
(the source of every policy the run was decided under) and, once the run is closed and until its bundle is written,
`unbundled.json`. The spool is `$TKBOX_HOME/.../runs/RUN_ID` (0700; host-only, never bound into a box), and the
bundle (bundle/archive.py `write_bundle`) is written from it and the signer's export.

`RunRecorder` (signing/recorder.py) decides, completes and signs; it hands this class what to keep.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
from pathlib import Path
from typing import Any

from tkbox_nb.core.atomic_file import cut_torn_line, write_atomic
from tkbox_nb.policy import Policy

HANDLE = "handle.json"  # in an open run's spool: its id, token, holder's pid, where its bundle goes
UNBUNDLED = "unbundled.json"  # in a closed run's spool until its bundle is written (signing/recovery.py)
DISCLOSURES = "disclosures.jsonl"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def disclosure_line(entry: dict, blobs: dict[str, str]) -> str:
    """`entry` (with `blobs`, digest -> base64, when there are any) as one line of JSON, as `json.dumps(...,
    sort_keys=True, ensure_ascii=False)` writes it. The blobs are spliced in after the rest is encoded, in place of
    random placeholders: base64 needs no JSON escaping, and the encoder's scan of a large blob (a 10 MB file
    `%box_pull` brings back is 13 MB of base64) was a fifth of the pull's time."""
    if not blobs:
        return json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n"
    token = secrets.token_hex(16)  # 128 random bits: in nothing the entry holds
    marks = {digest: f"{token}-{i}" for i, digest in enumerate(blobs)}
    line = json.dumps(dict(entry, blobs=marks), sort_keys=True, ensure_ascii=False)
    parts = []
    for digest, mark in sorted(marks.items(), key=lambda kv: line.index(f'"{kv[1]}"')):
        head, line = line.split(f'"{mark}"', 1)
        parts += [head, '"', blobs[digest], '"']
    return "".join(parts) + line + "\n"


class RunSpool:
    """The spool directory of one run (its name is the run id) and the files in it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.run_id = self.path.name
        self._file: Any = None
        self._spooled: set[str] = set()  # content digests already written: each blob goes in once
        self._lock = threading.Lock()  # one line at a time, whatever lane's crossing writes it

    def create(self) -> "RunSpool":
        """A new run's spool: the directory (0700) and its disclosures file, open for appending."""
        self.path.mkdir(mode=0o700, parents=True)
        self._file = open(self.path / DISCLOSURES, "a", encoding="utf-8")
        return self

    def reopen(self) -> "RunSpool":
        """A dead holder's spool, taken over (signing/recovery.py `adopt`): its torn last line cut (a holder killed
        mid-write left half a line, whose record was never signed), open for appending after it, with the blobs it
        already holds known."""
        cut_torn_line(self.path / DISCLOSURES)
        self._file = open(self.path / DISCLOSURES, "a", encoding="utf-8")
        seen = [e for line in (self.path / DISCLOSURES).read_text(encoding="utf-8").splitlines()
                if line.strip() for e in [json.loads(line)]]
        self._spooled = {d for e in seen for d in (e.get("blobs") or {})}
        return self

    def read_json(self, name: str) -> Any:
        """One of the spool's JSON files (handle.json, box.json), read strictly."""
        from tkbox_nb.bundle.archive import loads_json
        return loads_json((self.path / name).read_bytes(), name)

    def read_policies(self) -> dict[str, Policy]:
        """Every policy the run was decided under, by hash."""
        policies = {}
        for path in (self.path / "policies").glob("*.toml"):
            policy = Policy.from_toml(path.read_text(encoding="utf-8"), path.name)
            policies[policy.hash] = policy
        return policies

    def write_handle(self, run_token: str, bundle_hint: Path | None, abandoned: str | None = None) -> None:
        """What another process needs to close this run if this one dies first (recover_orphans): the run's id and
        token, this process's pid and where the bundle should go; `abandoned`: why this process gave the run up
        (the signer was lost), so it is recovered even while this process lives. Host-only (0600 in 0700)."""
        handle = {"run_id": self.run_id, "run_token": run_token, "pid": os.getpid(),
                  "bundle_hint": str(bundle_hint) if bundle_hint else ""}
        if abandoned:
            handle["abandoned"] = abandoned[:300]
        write_atomic(self.path / HANDLE, json.dumps(handle).encode())

    def mark_unbundled(self, bundle_hint: Path | None) -> None:
        """The run is closed: nothing left to close, only its bundle to write (recover_orphans, if this process dies
        first)."""
        write_atomic(self.path / UNBUNDLED,
                     json.dumps({"pid": os.getpid(), "bundle_hint": str(bundle_hint or "")}).encode())
        (self.path / HANDLE).unlink(missing_ok=True)

    def append(self, entry: dict, content: dict[str, bytes]) -> int:
        """One line per record, written before the record is asked for, keyed by its call id (the record's
        tool_use_id); content inline (base64, once per digest): a single write per crossing. Returns the line's
        size in bytes (what the run's bundle grows by)."""
        with self._lock:
            fresh = {}
            for data in content.values():
                digest = sha256_digest(data)
                if digest not in self._spooled:
                    self._spooled.add(digest)
                    fresh[digest] = base64.b64encode(data).decode()
            line = disclosure_line(entry, fresh)
            self._file.write(line)
            self._file.flush()
        return len(line.encode())

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        """The disclosures file made durable and closed (the run is closing)."""
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def keep_policy(self, policy: Policy) -> None:
        path = self.path / "policies"
        path.mkdir(mode=0o700, exist_ok=True)
        (path / (policy.hash.removeprefix("sha256:") + ".toml")).write_text(policy.source, encoding="utf-8")

    def write_box_manifest(self, box: dict[str, Any]) -> None:
        tmp = self.path / "box.json.tmp"
        tmp.write_text(json.dumps(box, sort_keys=True, indent=1))
        os.replace(tmp, self.path / "box.json")

    def write_bundle(self, signer: Any, out_path: str | Path, final: bool = True) -> Path:
        """The run's `.tkb` from the signer's export and this spool, written atomically; `final=False`: the run so far
        (still open). A final bundle written, nothing is left for recovery (`unbundled.json` goes)."""
        from tkbox_nb.bundle.archive import write_bundle
        written = write_bundle(signer, self.run_id, self.path, out_path, final=final)
        if final:
            (self.path / UNBUNDLED).unlink(missing_ok=True)
        return written
