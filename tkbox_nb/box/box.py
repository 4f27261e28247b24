"""Box: one box and one signed run, from start to a written `.tkb`.

A Box starts its backend, opens its run, and composes its doors (exec, egress, patch, model, and the host end of
its kernel), which see it only as a DoorContext (doors/context.py) while it sees each only as a Door
(doors/door.py): it gathers their environment before the box starts, starts them in a loop once it is spawned, and
ends them in a loop at its stop. Their exchanges with the box go through one ExecTransport
(doors/exec_transport.py). Anything the box does outside the protocol, a limit it reaches, or a signer that stops
answering ends the box fail-closed, and the reason is recorded in the run's last record and the box manifest.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tkbox_nb.guest import protocol as p
from tkbox_nb.backends import BoxSpec, get_backend
from tkbox_nb.backends.base import end_note
from tkbox_nb.backends.gpus import gpu_backend, gpu_plan
from tkbox_nb.doors.cell import BoxKernel, Cell
from tkbox_nb.doors.door import Door, environment, stop_all
from tkbox_nb.rules.jupyter_messages import user_expressions_request
from tkbox_nb.stream.connection import HostConnection, StreamClosed
from tkbox_nb.doors.egress import EgressDoor
from tkbox_nb.doors.exec import CommandResult, ExecDoor
from tkbox_nb.doors.exec_transport import ExecTransport
from tkbox_nb.doors.packages import PackagesDoor
from tkbox_nb.doors.patch import Patch, PatchDoor
from tkbox_nb.rules.secrets import bindings_for
from tkbox_nb.core.errors import BoxEnded, TkboxError
from tkbox_nb.policy import Policy
from tkbox_nb.bundle.environment import box_environment
from tkbox_nb.signing.recorder import Crossing, RunRecorder, sha256_digest
from tkbox_nb.signing.recovery import recover_orphans
from tkbox_nb.signing.central import signer_for
from tkbox_nb.backends import mounts as mounts_
from tkbox_nb.box.workspace_seed import SeedCopy, check_size


@dataclass
class CellResult:
    status: str
    outputs: list[dict[str, Any]] = field(default_factory=list)
    execution_count: int | None = None
    user_expressions: dict[str, Any] = field(default_factory=dict, repr=False)  # each asked: its result, signed


class Box:
    """`with Box(policy=...) as box: box.run([...]); box.execute("...")`; the bundle is at `box.bundle_path`.

    A Box is the DoorContext (doors/context.py) of the doors it composes: they see its policy, bindings, CA,
    workspace, recorder and door stream, `fail_closed`, `memory_kills` and `exchange`, and nothing else of it."""

    kernel_early = False  # a notebook's box (NotebookBox.start_early): its kernel is wanted from the start
    mounts_original: dict[str, str] | None = None  # a rerun that went on with changed data: mount -> first difference
    package_pins: dict[str, dict[str, str]] | None = None  # a rerun's package files: project -> name -> sha256
    notebook: dict[str, str] = {}  # the kernel's notebook as its frontend named it (NotebookBox.notebook): signed

    def __init__(self, policy: Policy | str | Path | None = None, backend: str = "auto",
                 workspace: str | Path | None = None, bundle_path: str | Path | None = None,
                 home: str | Path | None = None, agent_argv: list[str] | None = None,
                 secrets: dict[str, Any] | None = None, replay_of: str | None = None,
                 model_replay: Any = None, jailer: bool | None = None):
        self.policy = Policy.coerce(policy)
        name = backend if backend != "auto" else self.policy.get("box", "backend")
        name = mounts_.backend_for(self.policy, name)  # auto with mounts: bwrap, or qemu for isolation = vm
        name = gpu_backend(self.policy, name)  # auto with gpus: bwrap, the one backend that gives GPUs
        jailer = self.policy.get("box", "jailer") if jailer is None else jailer
        self.backend = get_backend(name, self.policy.get("box", "isolation"), jailer=bool(jailer))
        self.workspace = Path(workspace) if workspace else None
        if self.workspace is not None and not self.workspace.is_dir():
            raise TkboxError(f"workspace {self.workspace} is not a directory")
        self.signer = signer_for(self.policy, home)  # the machine signer, or the central one [signer] names
        self.bundle_path: Path | None = Path(bundle_path) if bundle_path else None
        self.box_id = uuid.uuid4().hex
        self.recorder: RunRecorder | None = None
        self.running = None
        self.conn: HostConnection | None = None
        self.ended: str | None = None
        self.agent_argv = agent_argv  # another guest program instead of the agent: for testing a hostile guest
        self._kernel: BoxKernel | None = None
        self.transport = ExecTransport(self, self._died)  # the doors' exchanges with the box (DoorContext.exchange)
        self.exec_door = ExecDoor(self)
        self.egress: EgressDoor | None = None
        self.patch_door: PatchDoor | None = None
        self.doors: list[Door] = []  # in the order they start (and, reversed, end): Box._doors
        self.last_patch: Patch | None = None
        self.bindings = bindings_for(self.policy, secrets or {})
        self.replay_of = replay_of
        # model calls served from a bundle's recordings (a path, verified now, or Recordings): replay mode
        if model_replay is not None and not hasattr(model_replay, "take"):
            from tkbox_nb.doors.model_replay import recordings_from_bundle
            model_replay = recordings_from_bundle(model_replay)
        self.model_replay = model_replay
        self.model: Any = None  # the ModelDoor, when the box has the model endpoint
        self.packages: Any = None  # the PackagesDoor, when the policy names a package index
        if self.bindings:  # the per-box CA the secrets door terminates TLS with; its key stays in this process
            from tkbox_nb.rules.box_ca import BoxCA
            self.ca = BoxCA(self.box_id)
        else:
            self.ca = None
        self._lock = threading.RLock()
        self.spawned = threading.Event()  # set once start() has spawned the box's processes, or has failed

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> "Box":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop("box stopped" if exc[0] is None else f"box stopped after {exc[0].__name__}")

    @property
    def run_id(self) -> str | None:
        return self.recorder.run_id if self.recorder else None

    def start(self) -> "Box":
        try:
            return self._start()
        finally:
            self.spawned.set()

    def _start(self) -> "Box":
        gpus = gpu_plan(self.policy.get("box", "gpus"), self.policy.get("box", "gpu_caps"), self.backend.name)
        self.signer.ensure()
        if self.workspace is not None:  # a copy, never the host directory itself; too large: one line, before any copy
            check_size(self.workspace, self.policy.get("workspace", "exclude"), self.policy.get("workspace", "max_mib"))
        # the mounts' sources checked now, walked and digested on a thread while the rest of the start goes on
        walk = mounts_.MountWalk(self.policy, self.signer.home, self.backend.name)
        # the workspace copied and digested in one read, on a thread too; moved into the run's spool once the box
        # has taken it (the digest is signed in box.start, so the copy is made before)
        seeding = SeedCopy(self.workspace, self.signer.home / "seeds", self.policy.get("workspace", "exclude")) \
            if self.workspace is not None else None
        try:
            return self._open(gpus, seeding, walk)
        except BaseException:
            walk.cancel()
            raise
        finally:  # what is left of the staged copy: all of it if the start failed before the move, else nothing
            if seeding is not None:
                seeding.discard()

    def _open(self, gpus: Any, seeding: "SeedCopy | None", walk: mounts_.MountWalk) -> "Box":
        """Open the run (box.start signed), spawn the box, start its doors and open its door stream. A bubblewrap
        box is spawned first: its agent's imports overlap the mounts' walk and the run's opening, and it waits for
        the GO, given once box.start is signed, before it starts anything of the box's; a refused walk kills it
        before any run exists. A VM box's run opens before it starts (its disks are made from the walked data)."""
        overlap = self.backend.name in mounts_.OVERLAPS
        boot = self._boot(gpus, seeding, walk, overlap)
        env = box_environment(self.backend, self.signer.home)
        recorder = RunRecorder(self.signer, self.policy, {
            "box_id": self.box_id, "backend": self.backend.name, "isolation": self.backend.isolation,
            "image_digest": self.backend.image_digest(), "environment": sha256_digest(env), **boot},
            replay_of=self.replay_of)
        recorder.start_content = {"environment": env}  # box.start commits to it; the bundle discloses it
        if self.bundle_path is not None:
            recorder.bundle_hint = self.bundle_path
        # a crossing the run could not record (a lost signer, a result it refused) ends the box: no door goes on
        recorder.on_broken = lambda why: self.fail_closed(f"signer lost: {why}")
        recorder.on_full = self.fail_closed  # the run reached [box] max_run_mib: the box ends, its bundle written
        try:
            if not overlap:
                self._open_run(recorder, walk)
            self.doors = self._doors()
            env = environment(self.doors)
            if self.kernel_early:  # the agent starts the ipykernel at once, before the host asks for it
                env["TKBOX_KERNEL_EARLY"] = "1"
            self.running = self.backend.start(BoxSpec(
                box_id=self.box_id, seed=seeding.staged() if seeding is not None else None,
                memory_mib=self.policy.get("box", "memory_mib"), cpus=self.policy.get("box", "cpus"),
                cpu_time_s=int(self.policy.get("box", "cpu_time_s")),
                max_processes=self.policy.get("box", "max_processes"),
                workspace_mib=self.policy.get("box", "workspace_mib"), agent_argv=self.agent_argv,
                env={**env, **gpus.env}, ca_bundle=self.ca.trust_bundle() if self.ca else None,
                mounts=walk.binds(), disks=self.disks, devices=gpus.devices, ro_binds=gpus.ro_binds))
            self.spawned.set()
            if overlap:
                self._open_run(recorder, walk)
                self.running.go()
            for door in self.doors:  # the secret bindings signed; the providers' keys read (one line if missing)
                door.start()
            self.conn = HostConnection(self.running.door, self._violation, on_open=self._box_opened)
            deadline = time.monotonic() + self.backend.ready_timeout_s
            while not self.conn.ready.wait(0.1):
                if not self.running.alive() or self.conn.closed or time.monotonic() > deadline:
                    raise BoxEnded(f"the box did not come up ({self.running.exit_reason()}): {self._log_tail()}")
            self.running.ready()  # its output stream's tail ends here: what box code writes there is not the host's
            if seeding is not None:  # the agent copied it before its hello: now the patch door's base, in the spool
                seeding.move_to(self.recorder.spool / "seed")
            if self.ended:
                raise BoxEnded(self.ended)
        except BaseException as e:
            if self.recorder is None:  # no run yet: the box, if spawned, waits for a GO it never gets; it goes
                if self.running is not None:
                    self.running.kill()
            else:
                self.stop(f"box failed to start: {e}"[:300])
            raise
        return self

    def _open_run(self, recorder: RunRecorder, walk: mounts_.MountWalk) -> None:
        """The run opened, its box.start signed with the mounts' digests (the walk ended here), their lists kept."""
        self.mounts = walk.result()
        recorder.box.update(mounts_.facts(self.mounts, self.mounts_original))
        try:
            recorder.open()
        finally:  # opened, even if it failed after: the start's failure closes it (stop)
            if recorder.run_spool is not None:
                self.recorder = recorder
        mounts_.disclose(self.mounts, self.recorder.spool)

    def _boot(self, gpus: Any, seeding: "SeedCopy | None", walk: mounts_.MountWalk, overlap: bool) -> dict:
        """What box.start states of the box before it runs (the backend, GPUs, notebook, and the digest of the
        workspace's copy, signed: a rerun can tell whether it starts from the same tree; an empty one is none). A VM
        box's mounts are walked first: its disks are made from copies whose digests are those signed (so a QEMU box
        with mounts boots cold, before the backend's prepare makes or finds the warm state)."""
        recover_orphans(self.signer)  # runs of boxes whose process died (a killed kernel) get their bundles now
        self.disks = [] if overlap else self.backend.mount_disks(walk.result(), self.signer.home)
        boot = {**self.backend.prepare(self.policy.get("box", "memory_mib"), self.policy.get("box", "cpus")),
                **gpus.facts}  # the GPUs the box gets, signed in box.start
        boot = dict(boot, **self.notebook)
        digest = seeding.digest() if seeding is not None else None
        return dict(boot, workspace_digest=digest) if digest is not None else boot

    def _doors(self) -> list[Door]:
        """The box's doors, in the order they start, and in the reverse of it end: the egress door signs the secret
        bindings before the model door reads the providers' keys, and the model door's client closes before the
        egress door ends its open connections. The model endpoint exists in the box when its policy has [models] at
        start, or calls are replayed."""
        self.egress = EgressDoor(self)
        self.patch_door = PatchDoor(self, rerun=self.replay_of is not None)
        if "models" in self.policy.data or self.model_replay is not None:
            from tkbox_nb.doors.model import ModelDoor
            self.model = ModelDoor(self, self.model_replay)
        if self.policy.get("packages", "index"):  # its host cache is shared by the boxes of this $TKBOX_HOME
            self.packages = PackagesDoor(self, self.signer.home / "packages", self.package_pins)
        return [d for d in (self.exec_door, self.egress, self.patch_door, self.model, self.packages) if d is not None]

    def _box_opened(self, stream, body: dict) -> bool:
        """A stream the box opened: an egress connection, or a model call or package request to its endpoint."""
        return self.egress.accept(stream, body) or any(
            door is not None and door.accept(stream, body) for door in (self.packages, self.model))

    def stop(self, reason: str = "box stopped") -> Path | None:
        """Stop the box, close the run and write the bundle (once); returns its path. Interrupted while it waits for
        the box's last patch or outputs, it still kills the box, closes the run (saying so), writes the bundle and
        removes the workspace's seed copy, then raises the interruption."""
        with self._lock:
            if self.recorder is None or self.recorder.closed:
                return self.bundle_path
            interrupted = None
            try:
                reason = self._last_words(reason)
            except BaseException as e:  # KeyboardInterrupt, a notebook's interrupt: the box is ended all the same
                interrupted, reason = e, f"{reason}; stop interrupted ({type(e).__name__})"
            try:
                try:
                    self._end_processes(reason)
                finally:
                    self.recorder.close(end_note(self.running, self.ended or reason),
                                        mounts_.stop_facts(getattr(self, "mounts", [])))
                if self.recorder.broken:
                    raise BoxEnded(f"no bundle yet: the run could not be closed ({self.recorder.broken}); its records "
                                   f"up to the loss stay in the signer's store, run {self.recorder.run_id}: once the "
                                   "signer answers again, `tkbox signer recover` (or the next box) closes it and "
                                   "writes its bundle")
                if self.bundle_path is None:
                    out = self.signer.home / "bundles"
                    out.mkdir(mode=0o700, exist_ok=True)
                    self.bundle_path = out / f"{self.recorder.run_id}.tkb"
                self.recorder.write_bundle(self.bundle_path)
            finally:  # the workspace's copy (.env files and all) never outlives the box
                shutil.rmtree(self.recorder.spool / "seed", ignore_errors=True)
            if interrupted is not None:
                raise interrupted
            return self.bundle_path

    def _last_words(self, reason: str) -> str:
        """The box's last patch and late outputs, signed before it goes; the stop reason, with what failed."""
        if self.collect_patch_at_stop and self.patch_door is not None and self.conn is not None \
                and not self.ended and self.running.alive() and not self.recorder.broken:
            try:  # the box's last word on its workspace, decided before it goes
                self.last_patch = self.patch_door.collect()
            except TkboxError as e:
                reason = f"{reason}; the patch was not collected: {e}"
        if not self.ended:
            try:  # late outputs held for ended cells are signed before the box goes
                self.flush_late()
            except Exception as e:
                reason = f"{reason}; late outputs not signed: {str(e)[:200]}"
        return reason

    def _end_processes(self, reason: str) -> None:
        """Kill the box, shut its door stream, and end its doors, each step even if one before it fails."""
        try:
            if self.running is not None:
                self.running.kill()
        finally:
            try:
                if self.conn is not None:
                    self.conn.shutdown()
            finally:  # each door in the reverse of its start (open tunnels end, signed, before the run closes),
                # then the kernel: a cell still running ends with the box, its end signed before the stop
                stop_all([*reversed(self.doors), self._kernel], self.ended or reason)

    collect_patch_at_stop = True

    def patch(self, apply: str | None = None, **which: Any) -> Patch:
        """The workspace changes so far, each file decided and signed; applied per `[patch] apply` (or `apply`:
        never, review, auto). Files already decided in this box with the same content are not decided again, unless
        `again`; `only` (paths): those files alone, decided again (%box_pull)."""
        self._check_alive()
        if apply is not None and apply not in ("never", "review", "auto"):
            raise TkboxError("apply must be never, review or auto")
        with self._lock:
            self.last_patch = self.patch_door.collect(apply, **which)
        return self.last_patch

    def _violation(self, reason: str) -> None:
        self.fail_closed(f"door protocol violation: {reason}")

    def fail_closed(self, reason: str) -> None:
        """End the box now, fail-closed; the reason becomes the run's last word (DoorContext: its doors call it)."""
        if self.ended is None:
            self.ended = reason[:500]
        if self.conn is not None:  # a writer blocked on the box (and whoever waits for the door's lock) wakes
            self.conn.abort()
        if self.running is not None:
            self.running.kill()

    def _died(self) -> str | None:
        """Why the box's processes are gone (the backend's word), or None while they run."""
        if self.running is not None and not self.running.alive():
            return f"the box died: {self.running.exit_reason()}"
        return None

    def memory_kills(self) -> int:
        return self.running.memory_kills() if self.running is not None else 0

    def _log_tail(self) -> str:
        tail = getattr(self.running, "log_tail", lambda: "")()
        return tail.strip().splitlines()[-1][:300] if tail.strip() else "no output"

    def _check_alive(self) -> None:
        if self.recorder is not None and not self.recorder.closed:
            self.watch([])  # a box that died since the last crossing ends now, before anything more is decided
        if self.ended:
            raise BoxEnded(f"the box has ended: {self.ended}")
        if self.recorder is None or self.running is None:
            raise BoxEnded("the box is not started")

    # -- the exec door (doors/exec.py) ----------------------------------------------------------------------------
    def run(self, argv: list[str], stdin: bytes | None = None, timeout: float | None = None,
            cwd: str | None = None, env: dict[str, str] | None = None) -> CommandResult:
        """Run `argv` in the box (after a signed allow) and return its exit status and output. `cwd` (default
        /workspace) and `timeout` are recorded; of `env`, only the names are (never the values)."""
        self._check_alive()
        self.flush_late()
        return self.exec_door.run(argv, stdin, timeout, cwd, env)

    def decide_cell(self, code: str, user_expressions: dict[str, str] | None = None) -> "Crossing":
        """The exec door for one cell and its user_expressions (decided with its code, jupyter_messages.
        user_expressions): a signed allow, or DoorRefused (and nothing goes into the box)."""
        self._check_alive()
        expressions = user_expressions_request(user_expressions)
        self.flush_late()
        return self.exec_door.decide_cell(code, expressions)

    def flush_late(self) -> None:
        """Sign (and so let be shown) the late outputs held for cells already ended, before the next crossing."""
        kernel = self._kernel
        if kernel is not None and not kernel.ended:
            kernel.flush_late(boundary=True)

    def kernel(self) -> BoxKernel:
        """The box's Jupyter kernel (a real ipykernel in the box), started on first use."""
        self._check_alive()
        with self._lock:
            if self._kernel is None or self._kernel.ended:
                try:
                    self._kernel = BoxKernel(self)
                except (StreamClosed, OSError) as e:
                    self.fail_closed(f"door stream lost: {e}")
                    raise BoxEnded(f"the box has ended: {self.ended}") from None
            kernel = self._kernel
        ready_s = self.backend.kernel_ready_s
        deadline = time.monotonic() + ready_s
        while not kernel.ready.wait(0.1):
            if self.ended or not self.running.alive():
                raise BoxEnded(f"the box has ended: {self.ended or self.running.exit_reason()}")
            if time.monotonic() > deadline:
                self.fail_closed(f"the box's kernel did not answer within {ready_s:g}s")
                raise BoxEnded(f"the box has ended: {self.ended}")
        if kernel.ended:
            if self.ended:
                raise BoxEnded(f"the box has ended: {self.ended}")
            raise TkboxError(f"the box's kernel did not start: {kernel.ended}")
        return kernel

    def execute(self, code: str, on_output: Callable[[dict], None] | None = None,
                user_expressions: dict[str, str] | None = None, execution_count: int | None = None) -> CellResult:
        """Run a Python cell in the box's kernel (state persists); outputs follow the Jupyter message model.
        `user_expressions` (name -> expression) are evaluated after it, as ipykernel does, decided with its code.
        `execution_count`: the number the cell takes in the box's kernel (its In/Out/_n; a rerun gives the
        original's), else the kernel's next one."""
        crossing = self.decide_cell(code, user_expressions)
        try:
            kernel = self.kernel()
            cell = kernel.execute_request(code, crossing, on_output, user_expressions=user_expressions,
                                          execution_count=execution_count)
        except TkboxError:
            self.recorder.complete(crossing, "error", {"ended": "the box's kernel is not available"})
            raise
        except (StreamClosed, OSError, p.ProtocolError) as e:
            self.fail_closed(f"door stream lost: {e}")
            raise BoxEnded(f"the box has ended: {self.ended}") from None
        while not cell.done.wait(0.2):
            self.watch([cell])
            if self.ended:
                raise BoxEnded(f"the box has ended: {self.ended}")
        if cell.ended:
            self.watch([])  # a cell ended by its box dying under it ends the box
        if self.ended:
            raise BoxEnded(f"the box has ended: {self.ended}")
        if cell.ended:
            raise TkboxError(f"the cell did not finish: {cell.ended}")
        return CellResult(cell.status, cell.outputs, cell.execution_count, cell.expression_results or {})

    def watch(self, cells: list["Cell"]) -> None:
        """End the box if a cell in flight ran past `[exec] timeout_s`, or if the box died under it."""
        timeout = self.policy.get("exec", "timeout_s")
        if any(time.monotonic() - c.started > timeout for c in cells):
            self.fail_closed(f"exec timed out after {timeout:g}s")
        elif died := self._died():
            self.fail_closed(died)
        elif self.conn is not None and self.conn.closed and self.recorder is not None and not self.recorder.closed:
            self.fail_closed("the box's door stream ended (its guest agent is gone)")

    def exchange(self, request: dict, timeout: float, on_data: Callable[[int, bytes], None],
                 stdin: bytes | None = None) -> dict:
        """One request to the box and its answer, within one deadline (DoorContext: the exec and patch doors')."""
        return self.transport.exchange(request, timeout, on_data, stdin)
