"""Runs whose holding process died (a kernel killed with SIGKILL, a crash) or whose signer was lost, closed and
bundled by the next box start or `tkbox signer recover`: their spools keep what another process needs (handle.json).

A run closed but not yet bundled is recovered too: its bundle waits for a checkpoint of the signer (seconds, under
load), and a frontend kills a kernel that has not exited within its wait (jupyter_client: 5 s), so the holder may die
between its run's last record and its `.tkb`. The closed run's spool keeps `unbundled.json` (the holder's pid, where
the bundle was meant to go) until the bundle is written; recovery writes the bundle of such a run whose holder died.

An open run is taken over with `adopt`: a RunRecorder resumed on the dead holder's run token and spool (its torn last
line cut), which closes the run with the reason as its last record and writes its bundle.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tkbox_nb.core import scratch
from tkbox_nb.core.processes import pid_alive
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import MachineSigner
from tkbox_nb.signing.spool import HANDLE, UNBUNDLED, RunSpool


def _held(spool: Path) -> tuple[str, dict] | None:
    """What is left to do for `spool` ("close" an open run, "bundle" a closed one) and its holder's note; None when
    nothing is, or the note does not read."""
    for what, name in (("close", HANDLE), ("bundle", UNBUNDLED)):
        try:
            held = json.loads((spool / name).read_text())
            if isinstance(held, dict) and isinstance(held.get("pid"), int):
                return what, held
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return None
        return None
    return None


def recover_orphans(signer: MachineSigner) -> list[Path]:
    """Close every run whose process ended without closing it (a kernel killed with SIGKILL, a crash), recording
    why as its last word, and write its bundle (where it was meant to go, else $TKBOX_HOME/bundles); write the bundle
    of every run closed by a process that ended before writing it. Returns the bundles written."""
    written = []
    if not signer.runs_dir.is_dir():
        return written
    for spool in sorted(signer.runs_dir.iterdir()):
        got = _held(spool)
        if got is None:
            continue
        what, held = got
        abandoned = held.get("abandoned") if what == "close" else None
        if pid_alive(held["pid"]) and not abandoned:
            continue
        lock = spool / "recovering"
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # one recoverer per run
        except FileExistsError:
            continue
        os.close(fd)
        try:
            if what == "close":
                rec = adopt(signer, spool)
                rec.close(f"recovered: the run ended early ({abandoned})" if abandoned else
                          f"recovered: the process that held this box (pid {held['pid']}) ended without closing its "
                          "run")
                written.append(rec.write_bundle(_out(signer, rec.run_id, rec.bundle_hint, held["pid"])))
            elif (spool / UNBUNDLED).exists():  # closed by its holder, which died before writing the bundle
                hint = Path(held["bundle_hint"]) if held.get("bundle_hint") else None
                written.append(RunSpool(spool).write_bundle(signer, _out(signer, spool.name, hint, held["pid"])))
        except Exception as e:  # a spool we cannot adopt stays for `tkbox signer recover` to report
            (spool / "recover-error.txt").write_text(f"{type(e).__name__}: {e}"[:1000])
        finally:  # the workspace's copy (.env files and all) was the dead box's only: nothing reads it again
            shutil.rmtree(spool / "seed", ignore_errors=True)
            lock.unlink(missing_ok=True)
    return written


def adopt(signer: MachineSigner, spool_dir: Path) -> RunRecorder:
    """Take over an open run whose process is gone, from its spool, to close it and write its bundle."""
    from tracekit.sdk.client import RunHandle
    spool = RunSpool(spool_dir)
    handle, box = spool.read_json(HANDLE), spool.read_json("box.json")
    policies = spool.read_policies()
    rec = RunRecorder(signer, policies[box["policy"]["hash"]],
                      {k: v for k, v in box.items() if k not in ("policy", "policies")})
    rec.policies = policies
    rec.bundle_hint = Path(handle["bundle_hint"]) if handle.get("bundle_hint") else None
    client = signer.client()
    run = RunHandle(client, {"run_id": handle["run_id"], "run_token": handle["run_token"]})
    rec.resume(run, client, spool)
    spool.reopen()  # its torn last line cut, open for the adopter's records
    return rec


def _out(signer: MachineSigner, run_id: str, hint: Path | None, pid: object = None) -> Path:
    """Where a recovered run's bundle goes: where it was meant to, else $TKBOX_HOME/bundles/RUN_ID.tkb. Not into a
    scratch directory the dead holder made for itself (core/scratch.py: `tkbox-...<pid>-XXXX`, as a batch task's
    rerun is written), which the next sweep removes with whatever is in it: a recovered bundle there would be lost."""
    own_scratch = hint is not None and isinstance(pid, int) and scratch.made_by(hint.parent, pid)
    if hint is not None and hint.parent.is_dir() and not own_scratch:
        return hint
    out = signer.home / "bundles" / f"{run_id}.tkb"
    out.parent.mkdir(mode=0o700, exist_ok=True)
    return out
