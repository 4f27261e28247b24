"""`tkbox run`, `tkbox doctor` and `tkbox image build`: the box commands of the CLI."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from tkbox_nb.backends import BACKENDS
from tkbox_nb.core.errors import DoorRefused, TkboxError
from tkbox_nb.rules.door_table import EXEC


def _cmd_run(a) -> int:
    from tkbox_nb.box.box import Box
    if not a.argv:
        raise SystemExit("tkbox run: error: give the command after --, e.g. tkbox run -- python3 -c 'print(1)'")
    argv = a.argv[1:] if a.argv[0] == "--" else a.argv
    if a.output is not None:  # checked before the command runs: its bundle must have somewhere to go
        from tkbox_nb.cli.replay import _writable
        _writable(a.output)
        if Path(a.output).is_dir():
            raise TkboxError(f"cannot write {a.output}: it is a directory")
    stdin = None if sys.stdin.isatty() or not a.stdin else sys.stdin.buffer.read()
    box = Box(policy=a.policy, backend=a.backend, workspace=a.workspace, bundle_path=a.output,
              jailer=True if a.jailer else None)
    code = 1
    with box:
        from tkbox_nb.rules.refusal_notices import Shown, watch
        shown = Shown()  # each refusal on stderr as it happens, the first few (the command's own: below)
        watch(box.recorder, lambda line: (said := shown.admit("run", line)) and print(
            f"tkbox: {said}", file=sys.stderr, flush=True), skip=frozenset({(EXEC, "command")}))
        try:
            result = box.run(argv, stdin=stdin)
            sys.stdout.buffer.write(result.stdout)
            sys.stderr.buffer.write(result.stderr)
            code = result.exit_code
        except DoorRefused as e:
            print(f"tkbox run: {e}", file=sys.stderr)
            code = 126
    print(f"tkbox run: bundle {box.bundle_path}", file=sys.stderr)
    return code


def _cmd_doctor(a) -> int:
    from tkbox_nb.backends.registry import candidates, choose_backend
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.signer import MachineSigner
    ok_any = False
    policy = Policy.coerce(a.policy)
    jailer = bool(policy.get("box", "jailer"))
    for name in BACKENDS:
        backend = candidates()[name]
        ok, why = (backend(jailer=True) if name == "firecracker" and jailer else backend()).available()
        ok_any = ok_any or ok
        print(f"{name:12s} {'ok' if ok else 'no':3s} {why}")
        if name == "qemu" and ok:
            print(f"{'':16s} {'warm':8s} {_warm_line(backend(), policy)}")
        if name == "firecracker":
            fc = backend(jailer=jailer)
            for what, good, detail in fc.checks():
                print(f"{'':16s} {what:8s} {'ok' if good else ('no' if good is False else '-'):3s} {detail}")
            if not ok:
                print(f"{'':16s} {'boot':8s} -   not tried: a requirement above is missing")
            elif a.no_boot:
                print(f"{'':16s} {'boot':8s} -   not tried (--no-boot)")
            else:
                ok, detail = _boot_check(fc)
                print(f"{'':16s} {'boot':8s} {'ok' if ok else 'no':3s} {detail}")
    minimum = policy.get("box", "isolation")
    picked, why = choose_backend(minimum, jailer)
    label = f"{picked.name} ({picked.isolation})" if picked else "nothing"
    print(f"{'auto':12s} {'ok' if picked else 'no':3s} picks {label} for box.isolation = {minimum!r}")
    for line in why:
        print(f"{'':16s} {line}")
    from tkbox_nb.backends.gpus import doctor_line
    from tkbox_nb.backends.memory_limit import mechanism
    print(f"{'gpu':12s} {doctor_line()}")
    print(f"{'memory':12s} ok  box.memory_mib held by {mechanism()} on bwrap (docs/backends.md)")
    signer = MachineSigner()
    print(f"{'signer':12s} {'ok' if signer.answering() else 'off':3s} {signer.dir} "
          f"({'answering' if signer.answering() else 'starts on first use'})")
    return 0 if ok_any else 1


def _warm_line(backend, policy) -> str:
    """Whether this policy's machine size has a saved warm-start state (docs/backends.md) or its first box makes it."""
    from tkbox_nb.backends.warm_start import saved_state
    mem, cpus = policy.get("box", "memory_mib"), max(1, policy.get("box", "cpus"))
    state = saved_state(backend, mem, cpus)
    return (f"ok  saved state for {mem} MiB, {cpus} vCPU: {state.path}" if state else
            f"-   no saved state for {mem} MiB, {cpus} vCPU yet: the first box boots the template (tkbox image build "
            f"makes the default one)")


def _boot_check(backend) -> tuple[bool, str]:
    """Boot one box on `backend` and run one command in it: what `available()` cannot know (the kernel finds its
    devices, the door connects)."""
    import tempfile
    import time
    from tkbox_nb.box.box import Box
    t = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="tkbox-doctor-") as tmp, \
                Box(backend=backend.name, jailer=getattr(backend, "jailer", False),
                    bundle_path=f"{tmp}/boot-check.tkb") as box:
            r = box.run(["python3", "-c", "print(6 * 7)"])
        if r.stdout.strip() != b"42":
            return False, f"the test command printed {r.stdout[:80]!r}"
        return True, f"booted and ran a command in {time.monotonic() - t:.1f} s"
    except Exception as e:  # noqa: BLE001 -- a doctor reports, it does not crash
        return False, " ".join(str(e).split())[:300]


def _cmd_image(a) -> int:
    from tkbox_nb.backends.image import DEFAULT_PACKAGES, KERNEL_PACKAGE, build_image, images_dir, prune
    if a.action == "prune":
        removed, freed = prune()
        print(f"removed {removed} image(s) and the roots no image uses, {freed / 2**20:.0f} MiB freed "
              f"(kept the current one; cache {images_dir()})")
        return 0
    packages = list(DEFAULT_PACKAGES) + [p for arg in a.packages for p in arg.split(",") if p]
    pip = [p for arg in a.pip for p in arg.split(",") if p]
    image, built = build_image(packages, a.kernel or KERNEL_PACKAGE, force=a.force, pip=pip, make_current=True)
    size = image.size_bytes() / 2**20
    print(f"image {image.digest} {'built' if built else 'cached (inputs unchanged)'}: {image.path} ({size:.0f} MiB; "
          f"cache {images_dir()}); qemu boxes boot it from now on")
    if not a.no_warm and shutil.which("qemu-system-x86_64"):
        from tkbox_nb.backends.qemu import QemuBackend
        from tkbox_nb.backends.warm_start import warm_state
        from tkbox_nb.policy import Policy
        default, backend = Policy.coerce(None), QemuBackend(image)
        mem, cpus = default.get("box", "memory_mib"), default.get("box", "cpus")
        t = time.monotonic()
        state = warm_state(backend, mem, cpus, backend.ready_timeout_s)
        print(f"warm-start state for {mem} MiB, {cpus} vCPU ({backend.accel}): {state.path} "
              f"({state.path.stat().st_size / 2**20:.0f} MiB, {time.monotonic() - t:.1f} s); other machine sizes "
              f"are saved by their first box")
    return 0


def _cmd_kernel(a) -> int:
    from tkbox_nb.jupyter.kernel.install import install
    if sum(bool(x) for x in (a.user, a.sys_prefix, a.prefix)) > 1:
        raise SystemExit("tkbox kernel install: error: give at most one of --user, --sys-prefix, --prefix")
    try:
        path = install(user=a.user, prefix=a.prefix, sys_prefix=a.sys_prefix)
    except OSError as e:
        from tkbox_nb.core.errors import TkboxError
        raise TkboxError(f"cannot install the kernelspec: {e.strerror or e} (try --user or --sys-prefix)") from None
    print(f"installed kernelspec tkbox (Python 3 (Tracekit Box)) in {path}")
    return 0


def add_commands(sub) -> None:
    r = sub.add_parser("run", help="run one command in a fresh box and write its signed bundle")
    r.add_argument("--policy", help="box policy (TOML)")
    r.add_argument("--backend", choices=["auto", *BACKENDS], default="auto")
    r.add_argument("--workspace", help="directory copied into the box as /workspace")
    r.add_argument("-o", "--output", help="where to write the .tkb (default: $TKBOX_HOME/bundles/RUN.tkb)")
    r.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    r.add_argument("--jailer", action="store_true", help="run Firecracker under its jailer (docs/backends.md)")
    r.add_argument("argv", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_cmd_run)
    d = sub.add_parser("doctor", help="which backends can run here, and why not")
    d.add_argument("--no-boot", action="store_true", help="do not boot a test VM where Firecracker is available")
    d.add_argument("--policy", help="box policy (TOML) whose box.isolation the auto choice must meet")
    d.set_defaults(fn=_cmd_doctor)
    i = sub.add_parser("image", help="the guest image of the qemu backend")
    i.add_argument("action", choices=["build", "prune"], help="build (or find) the image; prune all but the current")
    i.add_argument("--packages", action="append", default=[], metavar="PKG[,PKG...]",
                   help="more Debian packages in the root (besides python3, ipykernel, numpy, pandas, matplotlib)")
    i.add_argument("--pip", action="append", default=[], metavar="REQ[,REQ...]",
                   help="pip packages installed into the root at build time (NAME[extras] and one version clause)")
    i.add_argument("--kernel", help="the Debian kernel package (default linux-image-cloud-amd64)")
    i.add_argument("--force", action="store_true", help="rebuild even when the inputs did not change")
    i.add_argument("--no-warm", action="store_true", help="do not boot the image to save its warm-start state "
                   "(docs/backends.md); the first qemu box of each machine size does it then")
    i.set_defaults(fn=_cmd_image)
    k = sub.add_parser("kernel", help="the Tracekit Box Jupyter kernel")
    k.add_argument("action", choices=["install"])
    k.add_argument("--user", action="store_true", help="install for this user")
    k.add_argument("--sys-prefix", action="store_true", help="install into this Python's prefix (a venv)")
    k.add_argument("--prefix", help="install under this prefix")
    k.set_defaults(fn=_cmd_kernel)
