"""The bubblewrap backend: a namespace box (user, pid, ipc, uts, mount, network, cgroup) where no VM can run.

Isolation is the host kernel's namespaces: weaker than a VM (one kernel bug away from the host), stronger than
nothing. What the box sees: the system's read-only /usr (and the interpreter's prefix, bound back read-only), a
synthetic /etc with only what programs need to start, a fresh /proc and a read-only /dev, a tmpfs /tmp and
/dev/shm, and a tmpfs /workspace filled from a read-only copy of the host workspace. Each tmpfs is sized: its pages
are host RAM that no rlimit of the box counts, so /tmp may hold half of `memory_mib` and /dev/shm a quarter (both
together stay below the box's memory), and /workspace `workspace_mib`. No host home, no /root, no /etc/ssh, no
$TKBOX_HOME, no host /sys. Its only interface is `lo`; its only way out is the door socket, an inherited fd.

What the box's /proc shows names no host path: bubblewrap reads its options from a file (`--args`), so its command
line, PID 1's in the box, is only the box's command; the interpreter (when outside /usr) and this process's venv are
seen at /opt/tkbox/python and /opt/tkbox/venv; the box's /etc is copied in from fds, not bound from a host folder.
/proc/self/mountinfo still names the host source of each bind (the interpreter's, the venv's lib, the guest package,
the workspace seed copy): docs/backends.md. bwrap's stderr is read by the host only until the agent's hello.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from tkbox_nb.core import scratch
from tkbox_nb.backends.mounts import bwrap_args as mount_args
from tkbox_nb.backends import memory_limit, seccomp
from tkbox_nb.backends.base import Backend, BoxSpec, RunningBox

GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"
BOX_PYTHON = "/opt/tkbox/python"  # where the box sees this host's interpreter when it lives outside /usr
BOX_VENV = "/opt/tkbox/venv"      # and this process's venv, remade there: its host paths stay out of the box's /proc
PIDS_CGROUP = Path("/sys/fs/cgroup/pids")
CGROUP_PREFIX = "tkbox-"  # then the host pid and the box id (scratch.sweep)
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "localtime", "alternatives",
             "os-release", "debian_version", "mime.types", "ssl/certs", "ca-certificates.conf",
             "fonts")  # fontconfig's config (its conf.d links into /usr): matplotlib runs fc-list for its font cache
PASSWD = "root:x:0:0:root:/tmp:/bin/sh\nbox:x:1000:1000:box:/tmp:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
GROUP = "root:x:0:\nbox:x:1000:\nnogroup:x:65534:\n"


def _grow_buffers(sock: socket.socket, size: int = 4 << 20) -> None:
    for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):  # SO_SNDBUFFORCE, SO_RCVBUFFORCE
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)  # past net.core.*mem_max, where allowed (root)
        except OSError:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, size)


def _under_usr(path: str) -> bool:
    return path == "/usr" or path.startswith("/usr/")


@functools.cache
def interpreter() -> tuple[str, tuple[tuple[str, str], ...], dict[str, str]]:
    """(the box's path of this host's Python, its read-only binds (host, box), the environment it needs there).

    A box runs this process's interpreter, but not at its host path: the argv and environment of every box process
    are readable in the box's /proc, and a path such as /root/.pyenv/... or /home/ci/checkout/.venv tells the box
    who runs it and where. An interpreter outside /usr is bound at BOX_PYTHON (a shared build finds its libpython
    there through LD_LIBRARY_PATH, its RUNPATH being the host's); a venv's lib/ is bound at BOX_VENV and the venv
    remade around it (box_files: a pyvenv.cfg naming the interpreter's box path; start(): bin/python3 a link)."""
    base = sys.base_prefix
    exe = getattr(sys, "_base_executable", None) or sys.executable
    binds: list[tuple[str, str]] = []
    env: dict[str, str] = {}
    if _under_usr(base) or not exe.startswith(base.rstrip("/") + "/"):
        python = exe
        if not _under_usr(base):  # an interpreter whose executable lies outside its prefix: bound where it is
            binds.append((base, base))
    else:
        python = BOX_PYTHON + exe[len(base.rstrip("/")):]
        binds.append((base, BOX_PYTHON))
        if any(Path(base, "lib").glob("libpython*.so*")):
            env["LD_LIBRARY_PATH"] = f"{BOX_PYTHON}/lib"
    if sys.prefix != base and Path(sys.prefix, "lib").is_dir():
        binds.append((str(Path(sys.prefix, "lib")), f"{BOX_VENV}/lib"))
    return python, tuple(binds), env


def venv_cfg() -> bytes:
    """The pyvenv.cfg of the box's venv: the host's, with `home` the interpreter's directory in the box."""
    system = "false"
    with contextlib.suppress(OSError):
        for line in Path(sys.prefix, "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "include-system-site-packages":
                system = "true" if value.strip().lower() == "true" else "false"
    version = ".".join(map(str, sys.version_info[:3]))
    return (f"home = {os.path.dirname(interpreter()[0])}\ninclude-system-site-packages = {system}\n"
            f"version = {version}\n").encode()


def _pids_cgroup_usable() -> bool:
    return (PIDS_CGROUP / "cgroup.procs").exists() and os.access(PIDS_CGROUP, os.W_OK)


def process_limit() -> str:
    """How this host can hold a box to `max_processes`: its own v1 pids cgroup; else RLIMIT_NPROC, set by prlimit in
    the box's user namespace (counted per user namespace since Linux 5.14, so only the box's processes), which the
    kernel never applies to processes of host root; else not at all, and box.start says so (`unenforced`). cgroup v2
    (`pids.max`) needs a delegated subtree this code does not set up yet."""
    if _pids_cgroup_usable():
        return "pids-cgroup"
    if os.geteuid() != 0 and shutil.which("prlimit"):
        return "rlimit-nproc"
    return "unenforced"


class BwrapRunning(RunningBox):
    def __init__(self, proc: subprocess.Popen, door: socket.socket, cgroup: Path | None, workdir: Path,
                 memory_cgroup: Path | None = None, go_fd: int | None = None):
        self.proc, self.door, self.cgroup, self._workdir = proc, door, cgroup, workdir
        self._go_fd, self._go_lock = go_fd, threading.Lock()  # the write end of the agent's GO pipe, until the GO
        self.memory_cgroup, self._oom_kills = memory_cgroup, 0
        self._killed_for: str | None = None
        self._keep_tail(proc.stderr, "tkbox-box-stderr")  # bwrap's and the agent's own stderr

    def _take_go(self) -> int | None:
        with self._go_lock:  # a go and a kill (fail_closed, from another thread) never both close the fd
            fd, self._go_fd = self._go_fd, None
        return fd

    def go(self) -> None:
        fd = self._take_go()
        if fd is not None:
            with contextlib.suppress(OSError):  # an agent already gone: its box ends as any dead box does
                os.write(fd, b"G")
            os.close(fd)

    def kill(self) -> None:
        fd = self._take_go()
        if fd is not None:  # an agent still waiting for its GO reads the end of the pipe and exits
            os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.wait(timeout=5)
        # every process of the box, even ones that left bwrap's process group: killed by its pids cgroup's list
        memory_limit.remove(self.cgroup)
        self._oom_kills = self.memory_kills()  # read before its cgroup goes: exit_reason names the limit after
        memory_limit.remove(self.memory_cgroup)
        self.memory_cgroup = None
        with contextlib.suppress(OSError):
            self.door.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def memory_kills(self) -> int:
        return memory_limit.oom_kills(self.memory_cgroup) if self.memory_cgroup is not None else self._oom_kills

    def describe_exit(self, rc: int | None) -> str:
        if rc in (-signal.SIGKILL, 128 + signal.SIGKILL) and self.memory_kills():  # bwrap passes on its child's
            return "killed by the memory limit (memory_mib, the box's memory cgroup)"
        return super().describe_exit(rc)


@functools.cache
def _help(exe: str) -> str:
    try:
        return subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    except OSError:
        return ""


def _disables_userns(exe: str) -> bool:
    """Whether this bubblewrap has --disable-userns (0.8 and later; Debian 12's is 0.8.0)."""
    return "--disable-userns" in _help(exe)


def _sizes_tmpfs(exe: str) -> bool:
    """Whether this bubblewrap has --size (0.5 and later): without it no tmpfs of the box could be bounded."""
    return "--size" in _help(exe)


def tmpfs_sizes(memory_mib: int) -> tuple[int, int]:
    """The bytes /tmp and /dev/shm may hold: half and a quarter of the box's memory, at least 1 MiB each."""
    return max(memory_mib << 19, 1 << 20), max(memory_mib << 18, 1 << 20)


def box_files(spec: BoxSpec, workdir: Path) -> dict[str, Path]:
    """The box's /etc (the host's few files programs need to start, and its own passwd, group, hosts, resolv.conf and
    CA bundle) and a venv's pyvenv.cfg: box path -> a host file. The host's are named where they are (opened, not
    copied); the box's own are written in `workdir`. Folders of ETC_FILES are bound read-only instead (argv)."""
    files: dict[str, Path] = {}
    for name in ETC_FILES:
        src = Path("/etc") / name
        if src.is_file():  # (a link followed: /etc/localtime)
            files[f"/etc/{name}"] = src
    own = {"passwd": PASSWD.encode(), "group": GROUP.encode(),
           "hosts": b"127.0.0.1 localhost tkbox\n::1 localhost\n",
           "resolv.conf": b"# no name servers in a box: names are resolved on the host\n"}
    if spec.ca_bundle is not None:
        own["tkbox/ca-bundle.pem"] = spec.ca_bundle
    for name, data in own.items():
        path = workdir / name.replace("/", "-")
        path.write_bytes(data)
        files[f"/etc/{name}"] = path
    if sys.prefix != sys.base_prefix:
        (workdir / "pyvenv.cfg").write_bytes(venv_cfg())
        files[f"{BOX_VENV}/pyvenv.cfg"] = workdir / "pyvenv.cfg"
    return files


class BwrapBackend(Backend):
    name = "bwrap"
    isolation = "namespace"

    def available(self) -> tuple[bool, str]:
        exe = shutil.which("bwrap")
        if not exe:
            return False, "bwrap is not installed (apt-get install bubblewrap)"
        r = subprocess.run([exe, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return False, f"bwrap cannot create namespaces here: {r.stderr.strip()[:200]}"
        if not _sizes_tmpfs(exe):
            return False, f"{exe} has no --size (bubblewrap before 0.5): a box's tmpfs could not be bounded"
        return True, f"{exe}: namespaces work"

    def prepare(self, memory_mib: int, cpus: int) -> dict:
        self._processes = process_limit()  # decided before box.start is signed, which names a limit it cannot hold
        facts = {"memory_limit": memory_limit.mechanism()}  # what holds memory_mib (memory_limit.py)
        return {**facts, "unenforced": "max_processes"} if self._processes == "unenforced" else facts

    def environment(self, cache_dir: Path) -> bytes:
        """The box runs the host's interpreter and venv, bound read-only: its manifest is the host's, as the box
        sees each path (the binds of argv below), from the cache while the site directories are unchanged."""
        from tkbox_nb.bundle.environment import host_python, manifest
        view = {"/usr": "/usr", **dict(interpreter()[1])}  # the binds of argv below
        if sys.prefix != sys.base_prefix:  # a venv, remade at BOX_VENV
            view[str(Path(sys.prefix, "bin"))] = f"{BOX_VENV}/bin"
        return manifest(host_python(view, cache_dir), self.name, self.image_digest())

    def argv(self, spec: BoxSpec, door_fd: int, files: dict[str, int], seccomp_fd: int | None = None,
             nproc: bool = False, go_fd: int | None = None) -> tuple[list[str], list[str]]:
        """bubblewrap's options for `spec` and the box's command. The options go to bubblewrap through a file
        (`--args`, start()), never on its command line, which is PID 1's in the box (/proc/1/cmdline); only the
        command (no host path in it) is there. `files` maps each file the host makes for the box (its
        /etc, a venv's pyvenv.cfg: box_files) to an fd that bubblewrap copies into the box's root: no host directory
        is bound for them, so /proc/self/mountinfo names none of this host's scratch directories."""
        exe = shutil.which("bwrap") or "bwrap"
        a = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--hostname", "tkbox", "--uid", "1000", "--gid", "1000"]
        if _disables_userns(exe):  # no user namespace inside the box: the kernel code it opens stays shut
            a += ["--unshare-user", "--disable-userns"]
        if seccomp_fd is not None:  # the system calls refused in the box (seccomp.py), loaded just before its exec
            a += ["--seccomp", str(seccomp_fd)]
        a += ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
            host = Path("/") / top
            if host.is_symlink():
                a += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                a += ["--ro-bind", str(host), f"/{top}"]
        a += ["--perms", "0755", "--dir", "/etc"]
        for name in ETC_FILES:
            if (Path("/etc") / name).is_dir():
                if "/" in name:
                    a += ["--perms", "0755", "--dir", os.path.dirname(f"/etc/{name}")]
                a += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        for path, fd in sorted(files.items()):
            a += ["--perms", "0755", "--dir", os.path.dirname(path), "--perms", "0644", "--file", str(fd), path]
        tmp_bytes, shm_bytes = tmpfs_sizes(spec.memory_mib)  # host RAM the box's rlimits do not count
        a += ["--proc", "/proc", "--dev", "/dev", *[x for d in spec.devices for x in ("--dev-bind", d, d)],
              "--size", str(shm_bytes), "--tmpfs", "/dev/shm",
              "--remount-ro", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
        python, py_binds, py_env = interpreter()
        for host, box in py_binds:
            a += ["--ro-bind", host, box]
        if sys.prefix != sys.base_prefix:  # a venv, remade at BOX_VENV (its pyvenv.cfg is one of `files`)
            a += ["--perms", "0755", "--dir", f"{BOX_VENV}/bin", "--symlink", python, f"{BOX_VENV}/bin/python3",
                  "--symlink", python, f"{BOX_VENV}/bin/python"]
        a += ["--ro-bind", str(GUEST_DIR), "/opt/tkbox/tkbox_guest",
              "--size", str(spec.workspace_mib << 20), "--tmpfs", "/workspace"]
        a += [x for p in spec.ro_binds for x in ("--ro-bind", p, p)]  # a GPU driver's files (gpus.py)
        if spec.seed is not None:
            a += ["--ro-bind", str(spec.seed), "/run/tkbox/seed"]
        a += mount_args(spec.mounts)  # the dataset mounts, read-only (backends/mounts.py)
        a += ["--remount-ro", "/", "--chdir", "/workspace", "--clearenv"]
        box_python = f"{BOX_VENV}/bin/python3" if sys.prefix != sys.base_prefix else python
        env = {"PATH": f"{os.path.dirname(box_python)}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
               "LANG": "C.UTF-8", "PYTHONPATH": "/opt/tkbox", "PYTHONDONTWRITEBYTECODE": "1",
               "TKBOX_DOOR_FD": str(door_fd), "TKBOX_BOX_ID": spec.box_id, "USER": "box", **py_env, **spec.env}
        if spec.seed is not None:
            env["TKBOX_SEED"] = "/run/tkbox/seed"
        if go_fd is not None:  # the agent waits for the host's GO on it (RunningBox.go)
            env["TKBOX_GO_FD"] = str(go_fd)
        for k, v in env.items():
            a += ["--setenv", k, v]
        command = []
        if nproc:  # set inside the box's user namespace, so the count is the box's processes only
            command += [shutil.which("prlimit") or "prlimit", f"--nproc={spec.max_processes}", "--"]
        command += spec.agent_argv or [box_python, "-m", "tkbox_guest.agent"]
        return [exe, *a], command

    @staticmethod
    def _prepare(spec: BoxSpec, workdir: Path, pids_cgroup: bool) -> tuple[dict[str, Path], Path | None]:
        """The files the host makes for the box (box path -> the host file bubblewrap copies in: box_files) and its
        pids cgroup."""
        files = box_files(spec, workdir)
        cgroup = None
        if pids_cgroup:
            scratch.sweep(CGROUP_PREFIX, PIDS_CGROUP, cgroups=True)  # those of host processes that were killed
            cgroup = PIDS_CGROUP / f"{CGROUP_PREFIX}{os.getpid()}-{spec.box_id}"
            cgroup.mkdir()
            (cgroup / "pids.max").write_text(f"{spec.max_processes}\n")
        return files, cgroup

    def start(self, spec: BoxSpec) -> BwrapRunning:
        """Spawn the box. Its agent starts (its own imports) and waits for the GO (`BwrapRunning.go`), which Box
        gives once the run's box.start is signed: before it, no workspace file is copied and nothing is sent."""
        host_end, box_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (host_end, box_end):  # room for several frames in flight: fewer stalls on bulk transfers
            _grow_buffers(end)
        workdir = scratch.fresh("tkbox-box-")
        processes = getattr(self, "_processes", None) or process_limit()
        try:
            files, cgroup = self._prepare(spec, workdir, processes == "pids-cgroup")
        except BaseException:
            host_end.close()
            box_end.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        try:
            memory_cg = memory_limit.create(spec.box_id, spec.memory_mib)
        except BaseException:
            host_end.close()
            box_end.close()
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        limits = (memory_limit.limits(spec.memory_mib, memory_cg is not None)["rlimit_as"], spec.cpu_time_s)

        def in_child():  # after fork, before exec: join the cgroups, set the limits (inherited by the whole box)
            for cg in (cgroup, memory_cg):
                if cg is not None:
                    with open(cg / "cgroup.procs", "w") as f:
                        f.write(str(os.getpid()))
            resource.setrlimit(resource.RLIMIT_AS, (limits[0], limits[0]))
            resource.setrlimit(resource.RLIMIT_CPU, (limits[1], limits[1] + 1))  # SIGXCPU, then SIGKILL
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        fd = box_end.fileno()
        fds: list[int] = []  # every fd bubblewrap reads at its start: closed here once it runs
        go_w = None

        def rd(path: Path) -> int:
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            return fds[-1]
        try:
            file_fds = {box: rd(host) for box, host in files.items()}
            filter_fd = None
            if seccomp.supported():
                (workdir / "seccomp.bpf").write_bytes(seccomp.program())
                filter_fd = rd(workdir / "seccomp.bpf")
            go_r, go_w = os.pipe()
            fds.append(go_r)
            (exe, *args), command = self.argv(spec, fd, file_fds, filter_fd, nproc=processes == "rlimit-nproc",
                                              go_fd=go_r)
            # bwrap's argv is PID 1's command line in the box: its arguments (host paths) go through a file
            (workdir / "bwrap.args").write_bytes(b"".join(arg.encode() + b"\0" for arg in args))
            args_fd = rd(workdir / "bwrap.args")
            # bwrap's own environment stays readable in the box (/proc/1/environ of its init): give it none of ours
            proc = subprocess.Popen([exe, "--args", str(args_fd), "--", *command], pass_fds=[fd, *fds],
                                    stdin=subprocess.DEVNULL,
                                    env={"PATH": "/usr/bin:/bin"},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=in_child,
                                    start_new_session=True)
        except BaseException:
            host_end.close()
            if go_w is not None:
                os.close(go_w)
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
            memory_limit.remove(memory_cg)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            box_end.close()
            for f in fds:
                os.close(f)
        return BwrapRunning(proc, host_end, cgroup, workdir, memory_cg, go_w)
