"""The machine signer: one Tracekit v2 signer per user and machine, on the host, outside every box.

Topology (docs/bundle-format.md#signer-topology says why): one long-lived signer holds one log identity (one origin,
one key) that the user pins once with `tkbox trust`; each box is one run in it. The signer runs a fixed pack, the
*box pack* below, whose rules read the verdict that the door states from the box's own policy, plus invariant rules
that hold whatever the door says. The box policy itself is bound into the run by its hash in every decision's
arguments and disclosed in the bundle, so `tkbox verify` re-derives each decision from it.

Its directory (keys, store, socket) is mode 0700 under $TKBOX_HOME and is never bound into a box. This module must not
decide anything itself: it starts, reaches and reads the signer.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hmac
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tkbox_nb.core.atomic_file import reserve_beside
from tkbox_nb.core.errors import SignerError
from tkbox_nb.core.home import default_home, trust_path
from tkbox_nb.core.processes import pid_alive
from tkbox_nb.rules.addresses import REFUSED_NAMES
from tkbox_nb.rules.door_table import EGRESS, PACKAGES, SECRETS, TABLE, Door, tool_of, tools

ORIGIN_PREFIX = "tkbox.local"
TENANT = "default"
START_TIMEOUT_S = 30.0
DECIDE_TIMEOUT_S = 5.0
IDLE_S = 30 * 86400  # a notebook's box may sit idle for days; the box closes its run itself
GRACE_S = 0.0  # the recorder settles every crossing before close_run: nothing of a box comes late
ENSURED_S = 2.0
POLL_S = 0.01  # how often an export reads the checkpoint note while it waits for one

# The box pack: compiled by the signer into its policy v2. Tools are the doors' (rules/door_table.py, in its order);
# any other tool is denied. For the doors of today its text is the one every bundle so far was signed under.
_PACK = """\
# tkbox-nb box pack (policy v2): the signer's own rules for box doors.
version: 'tkbox-pack-1'
description: tkbox-nb doors; the box policy's verdict is stated by the door and re-derived by tkbox verify
tools:
@TOOLS@
unknown_tools: deny
flag:
  - id: TKB-FLAG-SECRET-MISUSE
    tool: '@SECRET@'
    field: kind
    pattern: '^misuse$'
    reason: a secret's placeholder outside its bound header and hosts (never swapped)
deny:
  - id: TKB-POLICY-DENY
    tool: 'box\\..*'
    field: verdict
    pattern: '^deny$'
    reason: the box policy refused this crossing
    remedy: Change the box policy if this crossing is meant to pass.
  - id: TKB-NO-POLICY
    tool: 'box\\..*'
    field: policy
    pattern: '^$'
    reason: a crossing that names no box policy
    remedy: Name the box policy hash in every crossing.
  - id: TKB-ALWAYS-REFUSED
    tool: '@DIALS@'
    field: address_class
    pattern: '^always$'
    reason: an address no box may reach (loopback, private, link-local, metadata, ...), whatever the box policy says
    remedy: Reach public hosts only; see tkbox_nb/rules/addresses.py for the table.
  - id: TKB-METADATA-ADDR
    tool: '@DIALS@'
    field: address
    pattern: '^(169\\.254\\.|100\\.100\\.100\\.200$|fd00:ec2::|0\\.|127\\.|::1$|::ffff:|@EMBEDDED@)'
    reason: a link-local (IPv4 or IPv6), loopback or cloud metadata address, refused whatever the box policy says
    remedy: Reach public hosts only; these addresses are never reachable from a box.
  - id: TKB-METADATA-ADDRS
    tool: '@PACKAGES@'
    field: addresses
    pattern: '"(169\\.254\\.|100\\.100\\.100\\.200"|fd00:ec2::|0\\.|127\\.|::1"|::ffff:|@EMBEDDED@)'
    reason: an index or file host whose lookup answered a link-local, loopback or cloud metadata address
    remedy: Name index and file hosts that resolve to public addresses only.
  - id: TKB-LOCAL-NAME
    tool: '@PACKAGES@'
    field: host
    pattern: '(^|\\.)(@LOCAL_NAMES@)\\.*$'
    reason: an index or file host named as the host itself or a cloud metadata service
    remedy: Name public index and file hosts only.
"""


# IPv6 link-local (fe80::/10), and the IPv4-compatible (::/96), NAT64 (64:ff9b::/96) and 6to4 (2002::/16) forms of a
# loopback (127/8) or link-local (169.254/16) IPv4 address, as the door states an address (Python's compressed text,
# lower case): the signer reads text, so each form is spelled as it is written (rules/addresses.py judges the rest).
EMBEDDED = "fe[89ab][0-9a-f]:|::(7f[0-9a-f]{2}|a9fe):|64:ff9b::(7f[0-9a-f]{2}|a9fe):|2002:(7f[0-9a-f]{2}|a9fe):"


def box_pack(table: tuple[Door, ...] = TABLE) -> str:
    """The box pack's text: the tools of `table`, and its rules naming the egress, package and secrets doors' tools.
    The doors that dial a host the box names (egress, and the package door's index and file hosts) share the rules
    on the address they state; the package door's also on every address of the lookup and on the host's name (the
    names rules/addresses.py refuses before any lookup), so the signer refuses those crossings itself whatever the
    box policy's verdict says."""
    connect, packages = (re.escape(tool_of(d, None, table)) for d in (EGRESS, PACKAGES))
    return _PACK.replace("@TOOLS@\n", "".join(f"  '{t}': app\n" for t in tools(table))).replace(
        "@DIALS@", f"({connect}|{packages})").replace("@PACKAGES@", packages).replace(
        "@LOCAL_NAMES@", "|".join(n.replace(".", "\\.") for n in REFUSED_NAMES)).replace(
        "@SECRET@", re.escape(tool_of(SECRETS, None, table))).replace("@EMBEDDED@", EMBEDDED)


BOX_PACK = box_pack()


def origin_name() -> str:
    user = re.sub(r"[^A-Za-z0-9._-]", "_", getpass.getuser())[:64]
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
    return f"{ORIGIN_PREFIX}/{user}@{host}"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


class MachineSigner:
    """The per-user signer under `home` (default $TKBOX_HOME, else $XDG_STATE_HOME/tkbox)."""

    pack = BOX_PACK  # the pack it runs: the doors' tools (a test of a longer door table runs that table's)

    def __init__(self, home: str | Path | None = None):
        self.home = Path(home) if home else default_home()
        self.dir = self.home / "signer"
        self.config_path = self.dir / "signer.yaml"
        self.pack_path = self.dir / "box-pack.yaml"
        self.data_dir = self.dir / "data"
        self.socket_path = self.dir / "signer.sock"
        self.pid_path = self.dir / "signer.pid"
        self.log_path = self.dir / "signer.log"
        self.trust_path = trust_path(self.home)
        self.runs_dir = self.home / "runs"
        self._ensured = -ENSURED_S  # when ensure() last found it answering (monotonic)

    # -- set-up --------------------------------------------------------------------------------------------------
    def _write_config(self) -> bool:
        """Write signer.yaml and the box pack; True when either changed (a running signer must then restart)."""
        _private_dir(self.home)
        _private_dir(self.dir)
        _private_dir(self.runs_dir)
        config = (
            "# written by tkbox-nb; the box never sees this directory\n"
            "data_dir: ./data\n"
            "socket: ./signer.sock\n"
            "policy: ./box-pack.yaml\n"
            "durability: ack-on-fsync\n"
            "limits: {events_per_s: 100000, burst: 100000}\n"
            "fail_modes: {default: closed}\n"
            f"grace_s: {GRACE_S}\n"
            f"idle_s: {IDLE_S}\n"
            f"origin: {origin_name()}\n"
            "posture: {network: enforced, tool_calls: enforced}\n"
        )
        changed = False
        for path, text in ((self.pack_path, self.pack), (self.config_path, config)):
            if not path.exists() or path.read_text() != text:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
                changed = True
        return changed

    def answering(self, timeout: float = 2.0) -> bool:
        if not self.socket_path.exists():
            return False
        return status_answers(self.client(timeout=timeout))

    def pid(self) -> int | None:
        """The pid in signer.pid if that process is this signer (`tracekit signer serve --config` our config): a pid
        file a dead signer left may name a process that reused its pid, never to be signalled."""
        try:
            pid = int(self.pid_path.read_text().strip())
            os.kill(pid, 0)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        want = [b"tracekit", b"signer", b"serve", b"--config", os.fsencode(self.config_path)]
        return pid if any(argv[i:i + len(want)] == want for i in range(len(argv))) else None

    def ensure(self, timeout: float = START_TIMEOUT_S) -> "MachineSigner":
        """Start the signer unless it already answers. Safe to call from several processes at once. A second call
        within ENSURED_S of one that found it answering, while its process lives, asks it nothing (a box start and its
        recorder both ensure); a signer that died since is started again, and one stalled since fails the next call
        to it, closed, as it would a moment later anyway."""
        if time.monotonic() - self._ensured < ENSURED_S and self.pid():
            return self
        if self._write_config() and self.answering():  # a signer of an older pack or config: replace it
            self.stop()
        if self.answering():
            self._ensure_trust()
            self._ensured = time.monotonic()
            return self
        with open(self.dir / "start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.answering():
                self._start(timeout)
        self._ensure_trust()
        self._ensured = time.monotonic()
        return self

    def _start(self, timeout: float) -> None:
        old = self.pid()
        if old:  # alive but not answering: a stalled signer is replaced, never trusted
            with contextlib.suppress(OSError):
                os.kill(old, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        log = open(self.log_path, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tracekit", "signer", "serve", "--config", str(self.config_path)],
            cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True)
        log.close()
        self.pid_path.write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise SignerError(f"the signer exited at start (status {proc.returncode}): {tail[0][:300]}")
            if self.answering(timeout=1.0):
                return
            time.sleep(0.1)
        proc.kill()
        raise SignerError(f"the signer did not answer within {timeout:g}s (log: {self.log_path})")

    def stop(self, timeout: float = 10.0) -> None:
        self._ensured = -ENSURED_S
        pid = self.pid()
        if not pid:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and pid_alive(pid, reap=True):
            time.sleep(0.05)
        if pid_alive(pid, reap=True):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            self.pid_path.unlink()

    def client(self, timeout: float = DECIDE_TIMEOUT_S):
        from tracekit.sdk.client import Client
        return Client(signer=str(self.socket_path), timeout=timeout)

    def lane_client(self, timeout: float = DECIDE_TIMEOUT_S):
        """A connection for one lane of a run (signing/lanes.py): one call at a time, on the calling thread."""
        from tkbox_nb.signing.lanes import DirectClient
        return DirectClient(str(self.socket_path), timeout)

    # -- identity ------------------------------------------------------------------------------------------------
    def _ensure_trust(self) -> None:
        if not self.trust_path.exists():
            self.write_trust(self.trust_path)

    def write_trust(self, out: str | Path) -> dict:
        """Write the trust config that pins this signer's log key (Tracekit's `signer trust`)."""
        out = Path(out)
        tmp = reserve_beside(out)
        r = subprocess.run([sys.executable, "-m", "tracekit", "signer", "trust", "--config", str(self.config_path),
                            "-o", str(tmp)], capture_output=True, text=True, cwd=self.dir)
        if r.returncode != 0:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise SignerError(f"tracekit signer trust failed: {(r.stderr or r.stdout).strip()[:300]}")
        os.replace(tmp, out)
        return json.loads(out.read_text())

    def salt_key(self) -> bytes:
        """The key the signer derives each record's salt from (owner only; see tracekit.signer.service.reveal)."""
        try:
            return (self.data_dir / "keys" / "args_salt.key").read_bytes()
        except OSError as e:
            raise SignerError(f"cannot read the signer's salt key: {e}") from None

    # -- export --------------------------------------------------------------------------------------------------
    def export(self, run_id: str, out_path: str | Path, wait_final_s: float = 15.0, final: bool = True) -> dict:
        """Tracekit's v2 export of `run_id`, once its run.final record is covered by a checkpoint. With
        `final=False`, the run so far (still open), once its last record is covered."""
        return export_file_run(self.data_dir / "store", self.dir / "export-index.json", self.client, run_id,
                               out_path, str(self.data_dir / "policies"), TENANT, wait_final_s, final)

    def salts(self, events: list[dict]) -> dict[int, bytes]:
        """The salt of each record's commitments (run_seq -> salt), derived here from the signer's salt key."""
        from tracekit.signer.pipeline import salt_label

        key = self.salt_key()
        return {e["run_seq"]: salt_for(key, salt_label(e)) for e in events}


def status_answers(client) -> bool:
    """Whether a signer answers a status call through `client` (closed afterwards, whatever happened)."""
    try:
        client.status({})
        return True
    except Exception:
        return False
    finally:
        client.close()


def export_run(open_reader, client, run_id: str, out_path: str | Path, policy_dir: str, tenant: str,
               wait_final_s: float = 15.0, final: bool = True) -> dict:
    """Tracekit's v2 export of `run_id` from the store `open_reader()` reads, once its run.final record (or with
    `final=False` its last record) is covered by a checkpoint; `client()` reaches the signer to ask for one.
    Shared by the machine signer (its file store) and the central one (its Postgres store)."""
    from tracekit.bundle_v2 import export

    deadline = time.monotonic() + wait_final_s
    nudged = False
    while True:
        r = open_reader()
        try:
            records = list(r.iter_run(tenant, run_id))
            if not records:
                raise SignerError(f"the signer has no run {run_id}")
            last = records[-1]["event"]
            note = r.checkpoint_latest()
            ended = last["type"] == "run.final" or not final
            if ended and note and note[0] > last["seq"]:
                export(r, tenant, run_id, note[1], str(out_path), policy_dir=policy_dir)
                return {"records": len(records), "final": last["type"] == "run.final"}
        finally:
            r.close()
        if ended and not nudged:  # ask for a checkpoint once, before the wait is counted: reading a long run's
            nudged = True         # records can itself take longer than the wait
            deadline = max(deadline, time.monotonic() + wait_final_s)
            c = client()
            try:
                c.checkpoint_nudge({})
            except Exception:
                pass
            finally:
                c.close()
        elif time.monotonic() > deadline:
            raise SignerError(f"run {run_id} has no checkpointed final record after {wait_final_s:g}s")
        time.sleep(0.05)


def _nudge(client) -> None:
    c = client()
    try:
        c.checkpoint_nudge({})
    except Exception:  # the signer checkpoints on its own cadence anyway; the deadline decides
        pass
    finally:
        c.close()


def export_file_run(store: str | Path, index_path: str | Path, client, run_id: str, out_path: str | Path,
                    policy_dir: str, tenant: str, wait_final_s: float = 15.0, final: bool = True) -> dict:
    """Tracekit's v2 export of `run_id` from the file store at `store`, once a checkpoint covers its run.final record
    (or with `final=False` its last record), at a cost flat in the store's history (signing/store_view.py says how).
    The wait reads the checkpoint note (one small file) every POLL_S; the run's records are found once."""
    from tracekit.bundle_v2 import export

    from tkbox_nb.signing.store_view import StoreView

    view = StoreView(store, tenant, run_id, index_path)
    deadline = time.monotonic() + wait_final_s
    nudged = False
    records = view.run_records()  # the recorder registered the run before: none in the store is no run
    while final and records[-1]["event"]["type"] != "run.final":
        if time.monotonic() > deadline:
            raise SignerError(f"run {run_id} has no final record after {wait_final_s:g}s")
        time.sleep(POLL_S)
        records = view.more_records()
    last = records[-1]["event"]
    while True:
        note = view.checkpoint_latest()
        if note and note[0] > last["seq"]:
            break
        if not nudged and not final:  # a run.final nudges the checkpointer itself; a run still open needs asking
            nudged = True
            _nudge(client)
        if time.monotonic() > deadline:
            raise SignerError(f"run {run_id} has no checkpointed final record after {wait_final_s:g}s")
        time.sleep(POLL_S)
    try:
        view.load(note[0])
        export(view, tenant, run_id, note[1], str(out_path), policy_dir=policy_dir)
    except ValueError as e:  # the view does not match the signed note: never a bundle
        raise SignerError(f"cannot export run {run_id}: {e}") from None
    return {"records": len(view.records), "final": view.records[-1]["event"]["type"] == "run.final"}


def salt_for(salt_key: bytes, label: str) -> bytes:
    """The salt of a record's commitments: what tracekit.signer.service.reveal returns, derived from the key. Here,
    beside the key it derives from, so this module needs nothing of the recorder (the dependency goes one way)."""
    return hmac.new(salt_key, label.encode(), "sha256").digest()
