"""The bubblewrap backend: a namespace box (user, pid, ipc, uts, mount, network, cgroup) where no VM can run.

Isolation is the host kernel's namespaces: weaker than a VM (one kernel bug away from the host), stronger than
nothing. What the box sees: the system's read-only /usr (and the interpreter's prefix, bound back read-only), a
synthetic /etc with only what programs need to start, a fresh /proc and a read-only /dev, a tmpfs /tmp and
/dev/shm, and a tmpfs /workspace filled from a read-only copy of the host workspace. Each tmpfs is sized: its pages
are host RAM that no rlimit of the box counts, so /tmp may hold half of `memory_mib` and /dev/shm a quarter (both
together stay below the box's memory), and /workspace `workspace_mib`. No host home, no /root, no /etc/ssh, no
$TKBOX_HOME, no host /sys. Its only interface is `lo`; its only way out is the door socket, an inherited fd.
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
import time
from pathlib import Path

from .. import scratch
from . import memory_limit, seccomp
from .base import Backend, BoxSpec, RunningBox

GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"
PIDS_CGROUP = Path("/sys/fs/cgroup/pids")
CGROUP_PREFIX = "tkbox-"  # then the host pid and the box id (scratch.sweep)
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "localtime", "alternatives",
             "os-release", "debian_version", "mime.types", "ssl/certs", "ca-certificates.conf")
PASSWD = "root:x:0:0:root:/tmp:/bin/sh\nbox:x:1000:1000:box:/tmp:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
GROUP = "root:x:0:\nbox:x:1000:\nnogroup:x:65534:\n"


def _grow_buffers(sock: socket.socket, size: int = 4 << 20) -> None:
    for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):  # SO_SNDBUFFORCE, SO_RCVBUFFORCE
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)  # past net.core.*mem_max, where allowed (root)
        except OSError:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, size)


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
                 memory_cgroup: Path | None = None):
        self.proc, self.door, self.cgroup, self._workdir = proc, door, cgroup, workdir
        self.memory_cgroup, self._oom_kills = memory_cgroup, 0
        self._killed_for: str | None = None
        self._keep_tail(proc.stderr, "tkbox-box-stderr")  # bwrap's and the agent's own stderr

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.wait(timeout=5)
        if self.cgroup is not None:  # every process of the box, even ones that left bwrap's process group
            for _ in range(50):
                try:
                    pids = [int(x) for x in (self.cgroup / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.02)
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
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

    def argv(self, spec: BoxSpec, door_fd: int, etc_dir: Path, seccomp_fd: int | None = None,
             nproc: bool = False) -> list[str]:
        exe = shutil.which("bwrap") or "bwrap"
        a = [exe, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
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
        a += ["--ro-bind", str(etc_dir), "/etc"]
        for name in ETC_FILES:
            if (Path("/etc") / name).is_dir() and (etc_dir / name).is_dir():
                a += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        tmp_bytes, shm_bytes = tmpfs_sizes(spec.memory_mib)  # host RAM the box's rlimits do not count
        a += ["--proc", "/proc", "--dev", "/dev", *[x for d in spec.devices for x in ("--dev-bind", d, d)],
              "--size", str(shm_bytes), "--tmpfs", "/dev/shm",
              "--remount-ro", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
        # after /tmp's tmpfs, so an interpreter that lives under /tmp (a CI checkout's venv) is not hidden by it
        for prefix in sorted({sys.base_prefix, sys.prefix}):
            if not prefix.startswith("/usr/"):
                a += ["--ro-bind", prefix, prefix]
        a += ["--ro-bind", str(GUEST_DIR), "/opt/tkbox/tkbox_guest",
              "--size", str(spec.workspace_mib << 20), "--tmpfs", "/workspace"]
        a += [x for p in spec.ro_binds for x in ("--ro-bind", p, p)]  # a GPU driver's files (gpus.py)
        if spec.seed is not None:
            a += ["--ro-bind", str(spec.seed), "/run/tkbox/seed"]
        a += ["--remount-ro", "/", "--chdir", "/workspace", "--clearenv"]
        env = {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
               "PYTHONPATH": "/opt/tkbox", "PYTHONDONTWRITEBYTECODE": "1", "TKBOX_DOOR_FD": str(door_fd),
               "TKBOX_BOX_ID": spec.box_id, "USER": "box", **spec.env}
        if spec.seed is not None:
            env["TKBOX_SEED"] = "/run/tkbox/seed"
        for k, v in env.items():
            a += ["--setenv", k, v]
        if nproc:  # set inside the box's user namespace, so the count is the box's processes only
            a += [shutil.which("prlimit") or "prlimit", f"--nproc={spec.max_processes}", "--"]
        a += spec.agent_argv or [os.path.join(sys.prefix, "bin", "python3"), "-m", "tkbox_guest.agent"]
        return a

    @staticmethod
    def _prepare(spec: BoxSpec, workdir: Path, pids_cgroup: bool) -> tuple[Path, Path | None]:
        """The box's /etc (copied, with its own passwd, hosts and resolv.conf) and its pids cgroup."""
        etc_dir = workdir / "etc"
        etc_dir.mkdir()
        for name in ETC_FILES:
            src = Path("/etc") / name
            dst = etc_dir / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():  # a mount point only: the host's folder is bound over it read-only (argv), since
                dst.mkdir(parents=True, exist_ok=True)  # copying its hundreds of links cost most of a box's start
            elif src.exists():
                shutil.copy2(src, dst, follow_symlinks=True)
        if spec.ca_bundle is not None:
            (etc_dir / "tkbox").mkdir()
            (etc_dir / "tkbox" / "ca-bundle.pem").write_bytes(spec.ca_bundle)
        (etc_dir / "passwd").write_text(PASSWD)
        (etc_dir / "group").write_text(GROUP)
        (etc_dir / "hosts").write_text("127.0.0.1 localhost tkbox\n::1 localhost\n")
        (etc_dir / "resolv.conf").write_text("# no name servers in a box: names are resolved on the host\n")
        cgroup = None
        if pids_cgroup:
            scratch.sweep(CGROUP_PREFIX, PIDS_CGROUP, cgroups=True)  # those of host processes that were killed
            cgroup = PIDS_CGROUP / f"{CGROUP_PREFIX}{os.getpid()}-{spec.box_id}"
            cgroup.mkdir()
            (cgroup / "pids.max").write_text(f"{spec.max_processes}\n")
        return etc_dir, cgroup

    def start(self, spec: BoxSpec) -> BwrapRunning:
        host_end, box_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (host_end, box_end):  # room for several frames in flight: fewer stalls on bulk transfers
            _grow_buffers(end)
        workdir = scratch.fresh("tkbox-box-")
        processes = getattr(self, "_processes", None) or process_limit()
        try:
            etc_dir, cgroup = self._prepare(spec, workdir, processes == "pids-cgroup")
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
        filter_fd = None
        if seccomp.supported():
            (workdir / "seccomp.bpf").write_bytes(seccomp.program())
            filter_fd = os.open(workdir / "seccomp.bpf", os.O_RDONLY | os.O_CLOEXEC)
        try:
            # bwrap's own environment stays readable in the box (/proc/1/environ of its init): give it none of ours
            proc = subprocess.Popen(self.argv(spec, fd, etc_dir, filter_fd, nproc=processes == "rlimit-nproc"),
                                    pass_fds=[fd] + ([filter_fd] if filter_fd is not None else []),
                                    stdin=subprocess.DEVNULL,
                                    env={"PATH": "/usr/bin:/bin"},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=in_child,
                                    start_new_session=True)
        except BaseException:
            host_end.close()
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
            memory_limit.remove(memory_cg)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            box_end.close()
            if filter_fd is not None:
                os.close(filter_fd)
        return BwrapRunning(proc, host_end, cgroup, workdir, memory_cg)
