"""A box's dataset mounts on the host: checked, digested and signed at its start, bound read-only, checked at its stop.

The policy's [mounts.NAME] (policy/mounts.py) says what; this module says what the host holds. At start each source
is resolved and refused when it is not there, lies inside $TKBOX_HOME or holds it (the signer's keys), or holds a
FIFO, socket, device or a link out of itself (mount_digest.scan); then its digest is taken (cached), signed in the
box's start record (`facts`) with its file list disclosed in the bundle (`disclose`). bubblewrap binds each read-only
(`bwrap_args`); QEMU gives each to its guest as a read-only disk made from a copy of the source whose digest is the
signed one (microvm.py's `mount_disks`), and Firecracker gives the same disk as a read-only drive; a backend that
cannot mount host data refuses a policy with mounts (`refuse_backend`). At the stop every mount's metadata is walked
again, and files that changed under the source while the box ran are signed in its stop record (a VM box reads its
disk, made before it started, but the record says the same of the source as for bubblewrap).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tkbox_nb.bundle import mount_digest as md
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.policy.mounts import _overlaps

LIST_DIR = "mounts"  # in the run's spool, and box/mounts/NAME.jsonl in its bundle


@dataclass
class Mount:
    name: str
    source: str  # resolved
    target: str
    scan: md.Scan
    digest: str
    listing: bytes  # box/mounts/NAME.jsonl

    @property
    def entries(self) -> list:
        return md.parse_list(self.listing)


MOUNTING = ("bwrap", "qemu", "firecracker")  # the backends that give a box host data


def refuse_backend(policy: Any, backend_name: str) -> None:
    """One line when the box's backend cannot mount host data (every backend of registry.py can)."""
    if policy.data.get("mounts") and backend_name not in MOUNTING:
        raise TkboxError(f"[mounts] needs the bwrap, qemu or firecracker backend: a {backend_name} box cannot mount "
                         "host data (docs/backends.md, \"Dataset mounts\")")


def backend_for(policy: Any, name: str) -> str:
    """The backend a box with this policy takes: "auto" is bwrap when the policy has mounts, or qemu when its
    box.isolation asks for a VM; Firecracker, named, mounts them too."""
    if policy.data.get("mounts"):
        if name == "auto":
            name = "qemu" if policy.get("box", "isolation") == "vm" else "bwrap"
        refuse_backend(policy, name)
    return name


def _inside(a: str, b: str) -> bool:
    return _overlaps(a, b) and len(a) >= len(b)


def prepare(policy: Any, home: Path, backend_name: str) -> list[Mount]:
    """Each mount of `policy`, checked on the host and digested (files read only where the cache under `home`
    does not hold their metadata)."""
    return MountWalk(policy, home, backend_name).result()


class MountWalk:
    """A policy's mounts: their sources checked at once (there, not in or over $TKBOX_HOME), then walked and
    digested on a thread, so that a bubblewrap box's start overlaps the walk (`OVERLAPS`): a warm start of 10,000
    files stats every one, about as long as the box takes to boot. Nothing of the box runs before `result()`:
    Box signs box.start, with these digests, only after it, and opens no door before box.start; a walk that refuses
    the source (a FIFO, a socket, a link out) ends the spawned box before its run is opened."""

    def __init__(self, policy: Any, home: Path, backend_name: str):
        refuse_backend(policy, backend_name)
        self.specs: list[tuple[str, str, str]] = []  # (name, resolved source, target), in name order
        home_real = os.path.realpath(home)
        for name, spec in sorted(policy.data.get("mounts", {}).items()):
            source = os.path.realpath(spec["source"])
            if not os.path.lexists(spec["source"]) or not os.path.exists(source):
                raise TkboxError(f"mounts.{name}: the source {spec['source']} does not exist")
            if _overlaps(source, home_real):
                where = "inside" if _inside(source, home_real) else "over"
                raise TkboxError(f"mounts.{name}: the source {source} is {where} $TKBOX_HOME ({home_real}), which "
                                 "holds the signer's keys and is never shown to a box")
            self.specs.append((name, source, spec["target"]))
        self._home = home
        self._mounts: list[Mount] = []
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._finds: list = []  # the find processes started (one per mount), killed by cancel
        self._thread = threading.Thread(target=self._walk, name="tkbox-mount-walk", daemon=True)
        if self.specs:
            self._thread.start()

    def _walk(self) -> None:
        try:
            for name, source, target in self.specs:
                if self._cancelled.is_set():
                    raise TkboxError("the mounts' walk was cancelled")
                s = md.scan(source, self._finds.append)
                digest, listing = md.digest(s, self._home, self._cancelled)
                self._mounts.append(Mount(name, source, target, s, digest, listing))
        except BaseException as e:  # handed to whoever waits for the result
            self._error = e

    def cancel(self) -> None:
        """A start that failed stops the walk: find killed, no file hashed after the one being hashed."""
        self._cancelled.set()
        for proc in self._finds:
            if proc.poll() is None:
                proc.kill()

    def binds(self) -> list[tuple[str, str]]:
        """What the box binds (source, target): known before the walk ends."""
        return [(source, target) for _, source, target in self.specs]

    def result(self) -> list[Mount]:
        """The mounts, walked and digested; the walk's refusal raised here."""
        if self.specs:
            while self._thread.is_alive():  # a join in steps: an interrupt (a notebook's) is taken while it waits
                self._thread.join(0.5)
        if self._error is not None:
            raise self._error
        return self._mounts


OVERLAPS = ("bwrap",)  # the backends whose box binds the source itself, not a disk made from it: the walk overlaps


def facts(mounts: list[Mount], original: dict[str, Any] | None = None) -> dict[str, Any]:
    """What box.start signs of each mount (`mounts`: {NAME: ...}, none without mounts): its target, digest, files
    and bytes; in a rerun that went on with changed data (--allow-changed-data), the first file that differs from the
    original's (`original`)."""
    if not mounts:
        return {}
    out = {}
    for m in mounts:
        f = {"target": m.target, "digest": m.digest, **md.summary(m.scan)}
        if original and m.name in original:
            f["differs_from_original"] = original[m.name]
        out[m.name] = f
    return {"mounts": out}


def disclose(mounts: list[Mount], spool: Path) -> None:
    """Each mount's entries in the run's spool, for the bundle (box/mounts/NAME.jsonl)."""
    if mounts:
        (spool / LIST_DIR).mkdir(mode=0o700, exist_ok=True)
    for m in mounts:
        (spool / LIST_DIR / f"{m.name}.jsonl").write_bytes(m.listing)


def bwrap_args(binds: list[tuple[str, str]]) -> list[str]:
    """bubblewrap's arguments for the mounts: each source bound read-only (recursively, nosuid, nodev) at its
    target. A target over the interpreter's prefix (bound into the box when it is not under /usr) is refused."""
    a: list[str] = []
    prefixes = [p for p in {sys.base_prefix, sys.prefix} if not p.startswith("/usr/")]
    for source, target in binds:
        hit = next((p for p in prefixes if _overlaps(target, p)), None)
        if hit is not None:
            raise TkboxError(f"the mount target {target} is over {hit}, the interpreter the box runs")
        a += ["--ro-bind", source, target]
    return a


def rerun_differences(signed: Any, lists: dict[str, bytes], policy: Any, home: Path) -> dict[str, str]:
    """Each mount whose data a rerun under `policy` would read differs from the original's (its signed `mounts`,
    its disclosed `lists` by bundle path), with the first path that differs; {} when every mount is the same. The
    host's data is digested now (cached), before any box starts."""
    signed = signed if isinstance(signed, dict) else {}
    now = {m.name: m for m in prepare(policy, home, "bwrap")} if policy.data.get("mounts") else {}
    out = {}
    for name in sorted(set(signed) | set(now)):
        fact, m = signed.get(name), now.get(name)
        if m is None or not isinstance(fact, dict):
            out[name] = "(the rerun's policy has no such mount)" if m is None else "(the original had no such mount)"
        elif m.digest != fact.get("digest"):
            try:
                was = md.parse_list(lists.get(f"box/mounts/{name}.jsonl", b""))
            except (ValueError, UnicodeError, RecursionError):
                was = []
            out[name] = md.first_difference(was, m.entries) or "(its digest)"
    return out


def stop_facts(mounts: list[Mount]) -> dict[str, Any] | None:
    """What box.stop signs beside its reason: `mounts_changed`, when a file changed under a mount; else None."""
    found = changed(mounts)
    return {"mounts_changed": found} if found else None


def changed(mounts: list[Mount]) -> dict[str, list[str]]:
    """The mounts whose files changed while the box ran (metadata walked again), each with its first paths."""
    out = {}
    for m in mounts:
        paths = md.changes(m.scan)
        if paths:
            out[m.name] = paths[:20] + ([f"... and {len(paths) - 20} more"] if len(paths) > 20 else [])
    return out
