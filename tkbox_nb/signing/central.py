"""A central Tracekit signer reached over HTTPS: boxes on many hosts sign their runs into one log.

Chosen by the box policy's `[signer]` section (docs/central-signer.md); without one a box uses the machine signer
(signing/signer.py). `CentralSigner` has the face the box, the recorder and the bundle writer use (ensure, answering,
client, export, salts, write_trust, home, runs_dir), so nothing else knows which signer signs. Where it differs, it is
because Tracekit 1.4.2 offers no other way:

- It is never started from here. A signer that does not answer at box start refuses the box; one lost mid-run breaks
  the recorder like a lost machine signer (fail closed), and the run is closed and bundled by `recover_orphans`
  once it answers again.
- TLS trusts only the configured CA (never the system store); the bearer token is read from its file per call.
- Export reads the central Postgres store through a SELECT-only role (`store_dsn_file`): Tracekit has no export RPC,
  and a bundle needs the records, the checkpoint and the inclusion proofs that only the store holds.
- The salts that open disclosed content come from the signer's content vault (`content_get`, the `content_read`
  grant), which needs `content: {retain: true}` on the signer: the salt key never leaves the signer's host.
- The compiled box pack the bundle carries is compiled here; its hash must be the one the records cite.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from tkbox_nb.core.errors import SignerError
from tkbox_nb.core.home import default_home
from tkbox_nb.signing.signer import BOX_PACK, DECIDE_TIMEOUT_S, TENANT, MachineSigner, export_run, status_answers

SALTS_PER_CALL = 200  # content_get answers at most 1000 items, and one answer line is bounded: stay well under
PURPOSE = "tkbox-nb bundle export"


def signer_for(policy, home: str | Path | None = None):
    """The signer a box with `policy` signs into: the central one its [signer] section names, else the machine's."""
    if policy.get("signer", "url"):
        return CentralSigner.from_policy(policy, home)
    return MachineSigner(home)


class CentralSigner:
    """A central signer at `url` (https://HOST:PORT), its token in `token_file`, its certificate chaining to `ca`."""

    def __init__(self, url: str, token_file: str | Path, ca: str | Path, store_dsn_file: str | Path,
                 trust: str | Path | None = None, home: str | Path | None = None):
        self.url = url.rstrip("/")
        self.token_file, self.ca, self.store_dsn_file = Path(token_file), Path(ca), Path(store_dsn_file)
        self.trust = Path(trust) if trust else None
        self.home = Path(home) if home else default_home()
        netloc = re.sub(r"[^A-Za-z0-9._-]", "_", urlsplit(self.url).netloc)[:128]
        self.dir = self.home / "central" / netloc  # this host's spools of the central signer's runs
        self.runs_dir = self.dir / "runs"
        self.trust_path = self.trust  # what `tkbox verify --trust` takes for its bundles
        self._ctx: ssl.SSLContext | None = None

    @classmethod
    def from_policy(cls, policy, home: str | Path | None = None) -> "CentralSigner":
        return cls(policy.get("signer", "url"), policy.get("signer", "token_file"), policy.get("signer", "ca"),
                   policy.get("signer", "store_dsn_file"), policy.get("signer", "trust") or None, home)

    def __repr__(self) -> str:
        return f"CentralSigner({self.url})"

    # -- reaching it ---------------------------------------------------------------------------------------------
    def _tls(self) -> ssl.SSLContext:
        """Only `ca` is trusted: create_default_context with a cafile loads no system certificates."""
        if self._ctx is None:
            try:
                self._ctx = ssl.create_default_context(cafile=str(self.ca))
            except (OSError, ssl.SSLError) as e:
                raise SignerError(f"cannot load the central signer's CA {self.ca}: {e}") from None
        return self._ctx

    def client(self, timeout: float = DECIDE_TIMEOUT_S):
        from tracekit.sdk.client import Client
        ctx = self._tls()
        c = Client(signer=self.url, timeout=timeout, token_file=str(self.token_file))
        https = getattr(c, "_https", None)
        if https is None or not hasattr(https, "ctx"):  # a Tracekit whose client we cannot pin: refuse, never trust
            c.close()
            raise SignerError("this Tracekit's client has no HTTPS transport whose CA can be pinned")
        https.ctx = ctx
        return c

    def answering(self, timeout: float = 2.0) -> bool:
        try:
            return status_answers(self.client(timeout=timeout))
        except SignerError:
            return False

    def ensure(self, timeout: float = DECIDE_TIMEOUT_S) -> "CentralSigner":
        """Check that the signer answers (it is never started from here): a box does not start without it."""
        for what, path in (("token file", self.token_file), ("CA", self.ca), ("store DSN file", self.store_dsn_file)):
            if not path.is_file():
                raise SignerError(f"the central signer's {what} {path} is not a readable file")
        for d in (self.home, self.home / "central", self.dir, self.runs_dir):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
        c = self.client(timeout=timeout)
        try:
            c.status({})
        except Exception as e:
            raise SignerError(f"the central signer at {self.url} does not answer: {e}"[:500]) from None
        finally:
            c.close()
        return self

    def pid(self) -> None:
        return None  # not a process of this host

    # -- identity ------------------------------------------------------------------------------------------------
    def write_trust(self, out: str | Path) -> dict:
        """Copy the central signer's trust config (as its operator published it, `[signer] trust`) to `out`."""
        if self.trust is None:
            raise SignerError("the policy's [signer] names no trust file: ask the signer's operator for the one "
                              "`tracekit signer trust` wrote")
        try:
            data = json.loads(self.trust.read_text())
        except (OSError, ValueError) as e:
            raise SignerError(f"cannot read the central signer's trust file {self.trust}: {e}") from None
        from tkbox_nb.core.atomic_file import write_atomic
        try:  # a fresh file renamed over `out`: never written through a symlink planted there, never half-written
            write_atomic(out, json.dumps(data, indent=1).encode())
        except OSError as e:
            raise SignerError(f"cannot write {out}: {e.strerror or e}") from None
        return data

    # -- export --------------------------------------------------------------------------------------------------
    def _reader(self):
        from tracekit.storage import postgres
        try:
            return postgres.PostgresReader(postgres.read_dsn({"dsn_file": str(self.store_dsn_file)}))
        except Exception as e:
            raise SignerError(f"cannot read the central signer's store: {e}"[:500]) from None

    def export(self, run_id: str, out_path: str | Path, wait_final_s: float = 15.0, final: bool = True) -> dict:
        """Tracekit's v2 export of `run_id` from the central store, with the box pack compiled here."""
        with tempfile.TemporaryDirectory(prefix="tkbox-pack-") as policy_dir:
            _compile_box_pack(Path(policy_dir))
            return export_run(self._reader, self.client, run_id, out_path, policy_dir, TENANT, wait_final_s, final)

    def salts(self, events: list[dict]) -> dict[int, bytes]:
        """Each record's salt (run_seq -> salt) from the signer's content vault. A record it has no salt for (content
        not retained, too large, erased, or changed by its redaction) stops the bundle: it could not be opened."""
        out: dict[int, bytes] = {}
        if not events:
            return out
        run_ids = {e["run_id"] for e in events}
        if len(run_ids) != 1:
            raise SignerError("salts of one run at a time")
        run_id = run_ids.pop()
        seqs = sorted({e["run_seq"] for e in events})
        c = self.client(timeout=30.0)
        try:
            for i in range(0, len(seqs), SALTS_PER_CALL):
                chunk = seqs[i:i + SALTS_PER_CALL]
                try:
                    reply = c.content_get({"run_id": run_id, "seqs": chunk, "purpose": PURPOSE})
                except Exception as e:
                    raise SignerError(f"the central signer gave no salts for run {run_id}: {e}"[:500]) from None
                items = reply.get("items") if isinstance(reply, dict) else None
                if not isinstance(items, list) or len(items) != len(chunk):
                    raise SignerError("the central signer's content_get answer does not fit the request")
                for seq, item in zip(chunk, items):
                    salt = item.get("salt") if isinstance(item, dict) and item.get("seq") == seq else None
                    if not (isinstance(salt, str) and re.fullmatch(r"[0-9a-f]{64}", salt)):
                        why = item.get("state") or ("redacted" if item.get("redacted") else "no salt") \
                            if isinstance(item, dict) else "no answer"
                        raise SignerError(f"the central signer has no salt for record {seq} of run {run_id} ({why}): "
                                          "it needs `content: {retain: true}` and this host's token the "
                                          "content_read grant")
                    out[seq] = bytes.fromhex(salt)
        finally:
            c.close()
        return out


def _compile_box_pack(policy_dir: Path) -> str:
    """Write the compiled box pack as `<hash>.json` in `policy_dir` (what a signer writes to data_dir/policies)."""
    from tracekit.policy2 import compile as policy_compile
    src = policy_dir / "box-pack.yaml"
    src.write_text(BOX_PACK)
    pol, errors = policy_compile.build(str(src))
    if errors:
        raise SignerError(f"the box pack does not compile: {'; '.join(errors)}"[:500])
    h = policy_compile.policy_hash(pol)
    (policy_dir / (h.removeprefix("sha256:") + ".json")).write_text(policy_compile.canonical(pol))
    return h
