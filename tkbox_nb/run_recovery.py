"""Runs whose holding process died (a kernel killed with SIGKILL, a crash) or whose signer was lost, closed and
bundled by the next box start or `tkbox signer recover`: their spools keep what another process needs (handle.json).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .recorder import RunRecorder
from .signer import MachineSigner, pid_alive


def recover_orphans(signer: MachineSigner) -> list[Path]:
    """Close every run whose process ended without closing it (a kernel killed with SIGKILL, a crash), recording
    why as its last word, and write its bundle (where it was meant to go, else $TKBOX_HOME/bundles). Returns them."""
    written = []
    if not signer.runs_dir.is_dir():
        return written
    for spool in sorted(signer.runs_dir.iterdir()):
        handle = spool / "handle.json"
        try:
            held = json.loads(handle.read_text())
            pid, abandoned = held["pid"], held.get("abandoned")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(pid) and not abandoned:
            continue
        lock = spool / "recovering"
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # one recoverer per run
        except FileExistsError:
            continue
        os.close(fd)
        try:
            rec = RunRecorder.adopt(signer, spool)
            rec.close(f"recovered: the run ended early ({abandoned})" if abandoned else
                      f"recovered: the process that held this box (pid {pid}) ended without closing its run")
            out = rec.bundle_hint
            if out is None or not out.parent.is_dir():
                out = signer.home / "bundles" / f"{rec.run_id}.tkb"
                out.parent.mkdir(mode=0o700, exist_ok=True)
            written.append(rec.write_bundle(out))
        except Exception as e:  # a spool we cannot adopt stays for `tkbox signer recover` to report
            (spool / "recover-error.txt").write_text(f"{type(e).__name__}: {e}"[:1000])
        finally:  # the workspace's copy (.env files and all) was the dead box's only: nothing reads it again
            shutil.rmtree(spool / "seed", ignore_errors=True)
            lock.unlink(missing_ok=True)
    return written

