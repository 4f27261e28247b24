"""The box of one notebook session, held on the host, and the host-side magics that act on it.

One implementation for both notebook front doors: the Tracekit Box kernel (every cell in the box) and the IPython
extension (`%%box` cells only). The box starts on the first cell that needs it, so a `%%box_policy` cell at the top of
a notebook sets the policy the box starts with. Host-side magics never enter the box; each is recorded in the run as
a host event (`door = "host"`) with its line, never a secret value. Events before the box exists are recorded as soon
as it starts.

Policy changes take effect at once for the doors' decisions (`[exec]` and later sections); `[box]` (backend and
limits) is fixed when a box starts, so a change there applies from the next box (`%box_restart`), and the magic says so.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tkbox_nb.box.box import Box
from tkbox_nb.bundle.environment import status_line
from tkbox_nb.box.early_box import EarlyBox
from tkbox_nb.core.errors import PolicyError, TkboxError
from tkbox_nb.core.visible import visible
from tkbox_nb.policy import Policy
from tkbox_nb.rules.door_table import HOST
from tkbox_nb.rules.gpu_record import status_line as gpu_line
from tkbox_nb.rules.notebook_name import bundle_name, describe, notebook_facts

HOST_MAGICS = ("box_policy", "box_secret", "box_status", "box_bundle", "box_restart", "box_view", "box_patch")
# the Tracekit Box kernel's also move files (box/notebook_files.py); the IPython extension's %box_pull and %box_push,
# its own (jupyter/magics.py), move plain values instead
KERNEL_MAGICS = HOST_MAGICS + ("box_pull", "box_push")


@dataclass
class SecretBinding:
    """A secret held on the host for the secrets door. Its value is never printed, recorded or sent into the box."""
    name: str
    hosts: list[str]
    header: str
    format: str
    source: str
    value: str = field(repr=False)

    def describe(self) -> str:
        return f"{self.name}: {self.header} for {', '.join(self.hosts)} (from {self.source})"


class NotebookBox:
    """The notebook's box, its policy and its secret bindings."""

    def __init__(self, policy: Policy | str | Path | None = None, backend: str = "auto",
                 workspace: str | Path | None = None, bundle_dir: str | Path | None = None,
                 home: str | Path | None = None):
        # a TKBOX_POLICY that does not load fails every box start closed, with its reason, until a policy that
        # loads is set (%%box_policy): the kernel still starts, and no box runs under a policy nobody asked for
        self.policy_error: str | None = None
        try:
            self.policy = Policy.coerce(policy if policy is not None else os.environ.get("TKBOX_POLICY") or None)
        except TkboxError as e:
            if policy is not None:
                raise
            self.policy = Policy.default()  # shown nowhere as in force: policy_error stops every start
            env, reason = os.environ["TKBOX_POLICY"], " ".join(str(e).split())[:500]
            name = f"TKBOX_POLICY={env}" if "\n" not in env and len(env) <= 300 else "TKBOX_POLICY"
            self.policy_error = f"{name} does not load ({reason}): no box starts until a policy that loads is set " \
                "(%%box_policy, or fix TKBOX_POLICY and restart the kernel)"
        self.backend = backend
        self.workspace = workspace
        bundle_dir = bundle_dir or os.environ.get("TKBOX_BUNDLE_DIR") or None
        self.bundle_dir = Path(bundle_dir) if bundle_dir else None
        self.home = home
        self.box: Box | None = None
        self.secrets: dict[str, SecretBinding] = {}
        self.bundles: list[Path] = []
        self.replay_of: str | None = None  # a rerun names the run it replays
        self.model_replay = self.package_pins = None  # a rerun's model calls (doors/model_replay.py), package files
        self.policy_guard: Callable[[Policy], None] | None = None  # a rerun: refuses a policy a bundle chose
        self._pending: list[tuple[dict, dict[str, bytes]]] = []
        self._early: EarlyBox | None = None
        self.early = False  # boxes start early (the Tracekit Box kernel): again after %box_restart
        self._release: threading.Event | None = None  # set once the box taken from an EarlyBox has stopped
        self.folder: Path | None = None  # the Tracekit Box kernel's: the notebook's folder (for_kernel)

    @classmethod
    def for_kernel(cls) -> "NotebookBox":
        """The Tracekit Box kernel's: its box starts with the kernel's working directory as its workspace, which
        every frontend makes the notebook's folder (TKBOX_WORKSPACE or [workspace] path overrides; `none`: empty)."""
        nb = cls()
        nb.folder = Path(os.getcwd())
        return nb

    def box_workspace(self) -> Path | None:
        """The folder a box started now is given a copy of: the one named at construction, else (the kernel's) from
        TKBOX_WORKSPACE, [workspace] path or the notebook's folder, in that order; `none` names no folder."""
        if self.workspace is not None or self.folder is None:
            return Path(self.workspace) if self.workspace is not None else None
        named = os.environ.get("TKBOX_WORKSPACE") or self.policy.get("workspace", "path")
        if named == "none":
            return None
        return self.folder / os.path.expanduser(named) if named else self.folder

    # -- the box -------------------------------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.box is not None and not self.box.ended and self.box.recorder is not None \
            and not self.box.recorder.closed

    def start_early(self) -> None:
        """Start a box, and its kernel, in the background now, so that the first cell need not wait for them (the
        Tracekit Box kernel calls this as it starts). The first cell that needs a box takes it if the notebook
        still asks for what it was started with (the same policy, secrets and replay); else it is stopped unused
        and a box is started for the cell."""
        self.early = True
        if self.box is None and self._early is None and self.policy_error is None:
            self._start_background()

    def _start_background(self) -> None:
        try:
            box = self._new_box(None)
        except Exception as e:  # no backend for the policy's isolation, a signer it cannot name: said on the cell
            self._early = EarlyBox.failed(e, self._wants())
            return
        box.kernel_early = True
        self._early = EarlyBox(box, self._wants())

    def _wants(self) -> tuple:
        """What a box started now is started with, compared when a cell takes it."""
        return (self.policy.hash, sorted(self.secrets.items()), self.replay_of, id(self.model_replay))

    def start_for_cell(self) -> None:
        """A cell needs a box (the Tracekit Box kernel): unless one is running, or starting with what the notebook
        asks for, one starts in the background, as start_early's does; the cell waits for it while `starting()`,
        the kernel answering its control channel meanwhile, then takes it (`ensure_box`). A started box that no
        longer fits (the policy changed, a secret was bound) is stopped unused first."""
        if self.live:
            return
        if self.policy_error is not None:
            raise PolicyError(self.policy_error)
        if self.box is not None:
            self.stop("the box ended")
        early = self._early
        if early is not None and early.done.is_set() and early.wants != self._wants():  # failed or not: not asked for
            self._early = None
            early.discard("the notebook's policy or secrets changed before its first cell")
        if self._early is None:
            self._start_background()

    def wait_spawned(self, timeout: float) -> None:
        """Wait, at most `timeout` seconds, until the early box's processes are spawned (or its start failed): the
        kernel imports its own app after that, so that on a small machine the two do not share the CPU until the
        box can start its kernel. A box that takes longer (a signer started cold, a VM) is not waited for."""
        if self._early is not None and self._early.box is not None:
            self._early.box.spawned.wait(timeout)

    def starting(self) -> bool:
        """Whether a box started in the background is still starting (a cell that needs it would wait in
        `ensure_box`)."""
        return self.box is None and self._early is not None and not self._early.done.is_set()

    def ensure_box(self) -> Box:
        """The running box: the one started in the background if it fits (waiting for its start to end), else one
        started now (or after the last one ended). A box whose start failed raises its reason here."""
        if self.live:
            return self.box
        if self.policy_error is not None:
            raise PolicyError(self.policy_error)
        if self.box is not None:
            self.stop("the box ended")
        bundle = None
        bundle_dir = self.bundle_dir or self._runs_dir()
        if bundle_dir is not None:
            bundle_dir.mkdir(parents=True, exist_ok=True)
            bundle = bundle_dir / bundle_name(self.notebook(), time.strftime("%Y%m%d-%H%M%S"), len(self.bundles) + 1)
        early, self._early = self._early, None
        box = early.take(self._wants()) if early else None
        if box is not None:
            self._release = early.released
            box.bundle_path = bundle
            if bundle is not None:
                box.recorder.hint_bundle(bundle)
        else:
            box = self._new_box(bundle)
            box.start()
        self.box = box
        pending, self._pending = self._pending, []
        for facts, content in pending:
            self._record(facts, content)
        return box

    mounts_original: dict[str, str] | None = None  # a rerun that goes on with changed data (replay.rerun)

    def notebook(self) -> dict[str, str]:
        """The kernel's notebook as its frontend names it (JPY_SESSION_NAME: JupyterLab, Notebook 7, VS Code), as its
        box.start signs it (rules/notebook_name.py): never guessed, none for the extension's box."""
        return notebook_facts(os.environ.get("JPY_SESSION_NAME")) if self.folder is not None else {}

    def _runs_dir(self) -> Path | None:
        """The kernel's bundles go beside the notebook ([workspace] runs_dir, under its folder; left out of the
        workspace by the default excludes); elsewhere, to the signer's home."""
        if self.folder is None:
            return None
        return self.folder / os.path.expanduser(self.policy.get("workspace", "runs_dir"))

    def _new_box(self, bundle: Path | None) -> Box:
        box = Box(policy=self.policy, backend=self.backend, workspace=self.box_workspace(), bundle_path=bundle,
                  home=self.home, secrets=self.secrets, replay_of=self.replay_of, model_replay=self.model_replay)
        box.mounts_original, box.notebook, box.package_pins = self.mounts_original, self.notebook(), self.package_pins
        return box

    def stop(self, reason: str = "box stopped") -> Path | None:
        """Stop the box (if any) and write its bundle; returns the bundle's path. An early box never taken is
        stopped too (its bundle goes to the signer's home, not the notebook's bundle folder)."""
        early, self._early = self._early, None
        if early is not None:
            early.discard(reason)
        box, self.box = self.box, None
        if box is None:
            return None
        release, self._release = self._release, None
        try:
            path = box.stop(reason)
        finally:
            if release is not None:
                release.set()
        if path is not None:
            self.bundles.append(path)
        return path

    # -- host events ---------------------------------------------------------------------------------------------
    def host_event(self, magic: str, line: str, body: str | None = None) -> None:
        facts, content = {"magic": magic, "line": line[:2000]}, ({"body": body.encode("utf-8")} if body else {})
        if self.live:
            self._record(facts, content)
        else:
            self._pending.append((facts, content))

    def _record(self, facts: dict, content: dict[str, bytes]) -> None:
        crossing = self.box.recorder.decide(HOST, "magic", facts, content)
        if crossing.allowed:
            self.box.recorder.complete(crossing, "ok", {})

    # -- what the magics do --------------------------------------------------------------------------------------
    def set_policy(self, policy: Policy) -> str:
        if self.policy_guard is not None:  # a rerun: the policy a bundle's %box_policy sets (replay._from_bundle)
            self.policy_guard(policy)
        old, self.policy, self.policy_error = self.policy, policy, None
        if not self.live:
            return f"policy {policy.name} ({policy.hash[:19]}...) set: the box starts with it"
        self.box.policy = policy
        self.box.recorder.set_policy(policy)
        note = ""
        if policy.data.get("box", {}) != old.data.get("box", {}):
            note = "; its [box] section (backend, limits) applies from the next box (%box_restart)"
        if policy.data.get("signer", {}) != old.data.get("signer", {}):
            note += "; its [signer] section applies from the next box (%box_restart): a run signs into one signer"
        if policy.data.get("mounts", {}) != old.data.get("mounts", {}):
            note += "; its [mounts] apply from the next box (%box_restart): a box's mounts are digested at its start"
        return f"policy {policy.name} ({policy.hash[:19]}...) in force for every crossing from now{note}"

    def status(self) -> str:
        lines = [f"policy   none in force: {self.policy_error}" if self.policy_error else
                 f"policy   {self.policy.name} ({self.policy.hash[:19]}...)"]
        if not self.live:
            lines.append("box      not started (starts with the first cell that needs it)")
        else:
            b, rec = self.box, self.box.recorder
            lines += [f"box      {b.box_id} ({b.backend.name}, isolation {b.backend.isolation})",
                      f"run      {rec.run_id}, its bundle at the end: {b.bundle_path or 'the signer home'}",
                      f"env      {status_line(rec.start_content.get('environment'))}",
                      f"folder   {b.workspace or 'none (an empty workspace)'}"] + \
                ([f"gpus     {visible(gpu_line(rec.box['gpus']))}"] if "gpus" in rec.box else [])
            if self.folder is not None:  # as its box.start signed it (the frontend's text, escaped)
                lines.append(f"notebook {visible(describe(rec.box))}")
            doors: dict[str, dict[str, int]] = {}
            for (door, decision), n in sorted(rec.counts.items()):
                doors.setdefault(door, {})[decision] = n
            lines += [f"{door:8s} " + ", ".join(f"{n} {d}" for d, n in c.items()) for door, c in doors.items()]
        mounts = getattr(self.box, "mounts", None) if self.live else None
        if mounts:  # read-only, each with the digest its box.start signed
            lines.append("mounts   " + "; ".join(f"{m.name}: {m.source} at {m.target} (read-only, {m.digest[:25]}..., "
                                                  f"{len(m.scan.files)} files)" for m in mounts))
        elif self.policy.data.get("mounts"):
            lines.append("mounts   " + "; ".join(f"{n}: {s['source']} at {s['target']} (read-only, digested when the "
                                                  "box starts)" for n, s in self.policy.data["mounts"].items()))
        if self.secrets:
            lines.append("secrets  " + "; ".join(s.describe() for s in self.secrets.values()))
        if self.bundles:
            lines.append(f"bundles  {', '.join(str(p) for p in self.bundles)}")
        return "\n".join(lines)


class _ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise TkboxError(f"%{self.prog}: {message}")


def split_host_magics(code: str) -> tuple[list[tuple[str, str, str | None]], str]:
    """The host-side magics a cell starts with, as (name, line, body), and the code left for the box.

    `%%box_policy` takes the whole cell as its body. Otherwise each leading line `%box_NAME ...` (blank lines between
    allowed) is a host magic, and the rest of the cell, if any, is code for the box."""
    stripped = code.lstrip()
    if stripped.startswith("%%box_policy"):
        first, _, body = stripped.partition("\n")
        return [("box_policy", first[len("%%box_policy"):].strip(), body)], ""
    magics, lines = [], code.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line:
            i += 1
            continue
        name = line[1:].split(None, 1)[0] if line.startswith("%") and not line.startswith("%%") else ""
        if name not in KERNEL_MAGICS:
            break
        magics.append((name, line[1 + len(name):].strip(), None))
        i += 1
    return magics, "\n".join(lines[i:]) if magics else code


class HostMagics:
    """Runs host-side magics on a NotebookBox. `read_secret(prompt)` asks the user on the host (getpass-like)."""

    def __init__(self, nb: NotebookBox, read_secret: Callable[[str], str]):
        self.nb = nb
        self.read_secret = read_secret

    def run(self, name: str, line: str, body: str | None = None) -> str | Path:
        """Do one magic; returns text to show (or, for %box_view, the bundle to show). Usage errors raise
        TkboxError (one line)."""
        out = getattr(self, "_" + name)(line, body)
        self.nb.host_event(name, line, body)
        return out

    def _box_policy(self, line: str, body: str | None) -> str:
        if body is not None:
            return self.nb.set_policy(Policy.from_toml(body, line or "%%box_policy"))
        if not line:
            if self.nb.policy_error:
                return f"# no policy in force: {self.nb.policy_error}"
            return f"# {self.nb.policy.name} ({self.nb.policy.hash})\n{self.nb.policy.source}"
        return self.nb.set_policy(Policy.load(os.path.expanduser(line)))

    def _box_secret(self, line: str, body: str | None) -> str:
        p = _ArgParser(prog="box_secret", add_help=False)
        p.add_argument("name")
        p.add_argument("--host", action="append", required=True)
        p.add_argument("--header", default="Authorization")
        p.add_argument("--format", default="{value}")
        p.add_argument("--env", help="read the value from this host environment variable instead of a prompt")
        try:
            a = p.parse_args(shlex.split(line))
        except ValueError as e:
            raise TkboxError(f"%box_secret: {e}") from None
        from tkbox_nb.policy.secrets import name_error
        if name_error(a.name):
            raise TkboxError(f"%box_secret: {a.name[:80]!r}: {name_error(a.name)}")
        if "{value}" not in a.format:
            raise TkboxError("%box_secret: --format must contain {value}")
        if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", a.header):
            raise TkboxError("%box_secret: --header must be one header name")
        from tkbox_nb.rules.hostnames import HostError, literal_address
        for host in a.host:
            try:  # an IP literal is matched as the address it spells (docs/policy.md), so it must spell one
                literal_address(host)
            except HostError as e:
                raise TkboxError(f"%box_secret: --host {host[:80]!r}: {e}") from None
        if a.env:
            value, source = os.environ.get(a.env), f"env:{a.env}"
            if not value:
                raise TkboxError(f"%box_secret: the host environment has no {a.env}")
        else:
            value, source = self.read_secret(f"value of {a.name} (stays on the host): "), "prompt"
            if not value:
                raise TkboxError(f"%box_secret: no value given for {a.name}")
        from tkbox_nb.rules.secrets import Binding, check_binding
        try:  # a legal HTTP header value, and the header it makes (an error names the source, never the value)
            check_binding(Binding(a.name, a.host, a.header, a.format, source, value=value))
        except PolicyError as e:
            raise TkboxError(f"%box_secret: {e}") from None
        binding = SecretBinding(a.name, a.host, a.header, a.format, source, value)
        self.nb.secrets[a.name] = binding
        when = "from the next box (%box_restart)" if self.nb.live else "when the box starts"
        return (f"secret {binding.describe()} held on the host; the box sees ${a.name} as a placeholder, swapped "
                f"for the value only in {a.header} of HTTPS requests to {', '.join(a.host)}; in force {when}.")

    def _box_status(self, line: str, body: str | None) -> str:
        return self.nb.status()

    def _box_bundle(self, line: str, body: str | None) -> str:
        from tkbox_nb.bundle.verify import verify_bundle
        if not self.nb.live:
            raise TkboxError("%box_bundle: no box is running (the bundles written so far: "
                             f"{', '.join(map(str, self.nb.bundles)) or 'none'})")
        box = self.nb.box
        out = Path(os.path.expanduser(line)) if line else \
            box.signer.home / "bundles" / f"{box.recorder.run_id}.so-far.tkb"
        out.parent.mkdir(parents=True, exist_ok=True)
        box.recorder.write_snapshot(out)
        return f"wrote {out} (the run so far, still open)\n{verify_bundle(out).summary()}"

    def _box_view(self, line: str, body: str | None) -> Path:
        """The bundle to view: the one named, else the running box's run so far, else the last one written."""
        if line:
            return Path(os.path.expanduser(line))
        if self.nb.live:
            box = self.nb.box
            out = box.signer.home / "bundles" / f"{box.recorder.run_id}.so-far.tkb"
            out.parent.mkdir(parents=True, exist_ok=True)
            return box.recorder.write_snapshot(out)
        if self.nb.bundles:
            return self.nb.bundles[-1]
        raise TkboxError("%box_view: no run to view yet (name a .tkb, or run a cell first)")

    def _box_patch(self, line: str, body: str | None) -> str:
        """The box's workspace changes so far, each file decided and signed; `never`, `review` or `auto` overrides
        the policy's [patch] apply for this patch; `apply` writes the allowed ones, those listed before too."""
        mode = line.strip() or None
        if mode not in (None, "never", "review", "auto", "apply"):
            raise TkboxError("%box_patch: the mode must be never, review, auto or apply")
        if not self.nb.live:
            raise TkboxError("%box_patch: no box is running")
        patch = self.nb.box.patch("auto", again=True) if mode == "apply" else self.nb.box.patch(mode)
        diff = patch.diff.decode("utf-8", "replace")
        return patch.summary() + ("\n\n" + diff if diff else "")

    def _box_pull(self, line: str, body: str | None) -> str:
        from tkbox_nb.box.notebook_files import pull
        return pull(self.nb, line)

    def _box_push(self, line: str, body: str | None) -> str:
        from tkbox_nb.box.notebook_files import push
        return push(self.nb, line)

    def _box_restart(self, line: str, body: str | None) -> str:
        path = self.nb.stop("restarted by %box_restart")
        # where boxes start early, the next one starts now, in the background; with secrets bound (or in a rerun) it
        # starts, in the background too, with the next cell that needs it (start_for_cell)
        early = self.nb.early and not self.nb.secrets and self.nb.replay_of is None
        if early:
            self.nb.start_early()
        nxt = "a new box is starting in the background for the next cell" if early else "the next cell starts a new box"
        return f"box stopped; its bundle: {path}. {nxt[0].upper()}{nxt[1:]}." if path else f"no box was running; {nxt}."
