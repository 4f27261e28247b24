"""Real bubblewrap boxes: isolation, limits, the exec door, fail-closed and a hostile guest."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tkbox_nb import Box, BoxEnded, DoorRefused, Policy, open_run
from tkbox_nb.backends import bwrap
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.signing.recovery import recover_orphans
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.core.tree_digest import tree_digest

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

PY = "python3"


@pytest.fixture(scope="module")
def box(signer, tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws")
    (ws / "data.txt").write_text("host data\n")
    b = Box(backend="bwrap", workspace=ws, bundle_path=tmp_path_factory.mktemp("out") / "box.tkb").start()
    b.host_workspace = ws
    yield b
    b.stop()


def sh(box, script):
    return box.run(["sh", "-c", script])


def test_only_loopback_exists_and_outside_addresses_are_unreachable(box):
    r = box.run([PY, "-c", "import socket; print(sorted(n for _, n in socket.if_nameindex()))"])
    assert r.stdout.strip() == b"['lo']"
    r = box.run([PY, "-c", "import socket; socket.create_connection(('198.18.0.1', 80), timeout=2)"])
    assert r.exit_code != 0 and b"Network is unreachable" in r.stderr


def test_host_loopback_services_are_unreachable(box):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    try:
        r = box.run([PY, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"])
        assert r.exit_code != 0 and b"Connection refused" in r.stderr
    finally:
        srv.close()


def test_host_files_home_and_signer_are_invisible(box, signer):
    r = sh(box, f"ls -a /root; ls /etc/ssh; ls /home; ls {signer.home}; ls {signer.socket_path}; ls /sys")
    out = r.stdout.decode()
    # no /root at all: the interpreter is bound at /opt/tkbox/python even where it lives under /root/.pyenv; the
    # four other paths are not there either
    assert out.split() == [], out
    for secret in ("signer.sock", "trust.json", "ssh_host", ".bash_history"):
        assert secret not in out
    assert r.stderr.count(b"No such file or directory") >= 6
    r = box.run([PY, "-c", f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(signer.socket_path)!r})"])
    assert r.exit_code != 0


def test_host_processes_are_invisible(box, signer):
    r = sh(box, "ls /proc | grep -E '^[0-9]+$'")
    pids = [int(x) for x in r.stdout.split()]
    assert len(pids) < 10 and signer.pid() not in pids or max(pids) < 20


def test_writes_outside_workspace_and_tmp_fail(box):
    for path in ("/usr/x", "/etc/x", "/x", "/opt/tkbox/x"):
        r = sh(box, f"echo x > {path}")
        assert r.exit_code != 0, path
    assert sh(box, "echo x > /workspace/new.txt && echo y > /tmp/t && cat /workspace/data.txt").stdout == b"host data\n"
    assert not (box.host_workspace / "new.txt").exists()  # a copy, never the host directory


def test_the_box_cannot_make_a_user_namespace(box):
    """No user namespace (nor, through one, a mount, network or pid namespace of its own) inside the box: the
    kernel code that opens, a common way out of containers, stays shut to box code."""
    for cmd in ("unshare -U true", "unshare -Ur true", "unshare -Urn true"):
        r = sh(box, cmd)
        assert r.exit_code != 0, (cmd, r.stdout, r.stderr)


CLONE_NEWUSER_CODE = r"""
import ctypes, errno, os, threading
libc = ctypes.CDLL(None, use_errno=True)
for flags in (0x10000000 | 17, 0x40000000 | 17, 0x20000 | 17):  # CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS
    pid = libc.syscall(56, flags, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    print(pid, errno.errorcode.get(ctypes.get_errno()))
    if pid > 0:
        os.waitpid(pid, 0)
ctypes.set_errno(0)
print(libc.syscall(435, 0, 0), errno.errorcode.get(ctypes.get_errno()))
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
t = threading.Thread(target=print, args=("thread",))
t.start(); t.join()
"""


def test_clone_cannot_make_a_user_namespace_even_without_disable_userns(signer, tmp_path, monkeypatch):
    """As with a bubblewrap before 0.8 (no --disable-userns): the seccomp filter alone refuses clone(2) with a
    CLONE_NEW* flag (EPERM) and clone3(2) (ENOSYS, libc falls back to clone); fork and threads still work."""
    monkeypatch.setattr(bwrap, "_disables_userns", lambda exe: False)
    with Box(backend="bwrap", bundle_path=tmp_path / "u.tkb") as b:
        r = b.run([PY, "-c", CLONE_NEWUSER_CODE])
        assert r.stdout.decode().splitlines() == ["-1 EPERM"] * 3 + ["-1 ENOSYS", "fork 7", "thread"], r.stderr
        assert sh(b, "unshare -U true").exit_code != 0


def test_the_kernel_s_riskiest_calls_are_refused_in_the_box(box):
    """The seccomp filter (backends/seccomp.py): keyrings, BPF, io_uring, mounts and namespaces answer EPERM in the
    box; ordinary calls work."""
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for nr in (250, 321, 425, 165, 272, 308):\n"
            "    ctypes.set_errno(0)\n"
            "    print(nr, libc.syscall(nr, 0, 0, 0, 0, 0), errno.errorcode.get(ctypes.get_errno()))\n"
            "print('getpid', libc.syscall(39) > 0)")
    r = box.run(["python3", "-c", code])
    lines = r.stdout.decode().splitlines()
    assert lines[:6] == [f"{nr} -1 EPERM" for nr in (250, 321, 425, 165, 272, 308)], r.stdout + r.stderr
    assert lines[6] == "getpid True"


def test_commands_take_stdin_and_report_exit_status(box):
    assert box.run(["cat"], stdin=b"in\n").stdout == b"in\n"
    assert sh(box, "echo err >&2; exit 7").exit_code == 7


def test_cells_keep_state_and_follow_the_jupyter_model(box):
    seen = []
    r = box.execute("y = 40\nprint('side')\ny + 2", on_output=seen.append)
    assert r.status == "ok" and [o["output_type"] for o in r.outputs] == ["stream", "execute_result"]
    assert seen == r.outputs and r.outputs[-1]["data"]["text/plain"] == "42"
    assert box.execute("y").outputs[0]["data"]["text/plain"] == "40"
    err = box.execute("raise ValueError('no')")
    assert err.status == "error" and err.outputs[0]["ename"] == "ValueError"


def test_policy_refusal_runs_nothing_and_is_signed(signer, tmp_path):
    policy = Policy.from_toml('[exec]\ncells = false\ncommands = ["echo"]\n')
    ws = tmp_path / "ws"
    ws.mkdir()
    with Box(policy=policy, backend="bwrap", workspace=ws, bundle_path=tmp_path / "r.tkb") as b:
        assert b.run(["echo", "ok"]).stdout == b"ok\n"
        with pytest.raises(DoorRefused, match="not in \\[exec\\] commands"):
            b.run(["sh", "-c", "touch /workspace/ran"])
        with pytest.raises(DoorRefused):
            b.execute("open('/workspace/ran2', 'w')")
        assert b.run(["echo", "still"]).stdout == b"still\n"
    run = open_run(tmp_path / "r.tkb")
    decisions = [(c.args.get("kind"), c.decision) for c in run.crossings() if c.door == "exec"]
    assert decisions == [("command", "allow"), ("command", "deny"), ("cell", "deny"), ("command", "allow")]
    assert verify_bundle(tmp_path / "r.tkb").valid


def test_bundle_discloses_commands_cells_and_outputs(signer, tmp_path):
    with Box(backend="bwrap", bundle_path=tmp_path / "d.tkb") as b:
        b.run(["echo", "hello"])
        b.execute("print('cell out')")
    run = open_run(tmp_path / "d.tkb")
    rows = [c for c in run.crossings() if c.door == "exec"]
    assert rows[0].args["argv"] == ["echo", "hello"]
    assert run.content(rows[0].result["stdout"]) == b"hello\n"
    assert run.content(rows[1].args["code"]) == b"print('cell out')"
    assert json.loads(run.content(rows[1].result["outputs"]))[0]["text"] == "cell out\n"
    assert verify_bundle(tmp_path / "d.tkb").valid


LIMITS = """
[box]
memory_mib = 512
max_processes = 32
cpu_time_s = 3
workspace_mib = 8
[exec]
timeout_s = 20
"""


@pytest.fixture
def tight_box(signer, tmp_path):
    b = Box(policy=Policy.from_toml(LIMITS), backend="bwrap", bundle_path=tmp_path / "lim.tkb").start()
    yield b
    b.stop()


def test_fork_bomb_is_stopped(tight_box):
    r = tight_box.run([PY, "-c", "import os\nwhile True:\n    os.fork()"])
    assert r.exit_code != 0 and b"Resource temporarily unavailable" in r.stderr
    assert tight_box.run(["echo", "alive"]).stdout == b"alive\n"


def test_a_process_limit_the_host_cannot_hold_is_signed_as_unenforced(signer, tmp_path, monkeypatch):
    """With no usable pids cgroup (a cgroup v2 host, or one whose v1 pids hierarchy is not writable) and no rlimit
    that holds (host root is exempt from RLIMIT_NPROC), the signed box.start names max_processes as unenforced;
    with the cgroup, nothing is named."""
    with Box(policy=Policy.from_toml(LIMITS), backend="bwrap", bundle_path=tmp_path / "c.tkb") as b:
        assert b.run(["true"]).exit_code == 0
    with_cgroup = open_run(tmp_path / "c.tkb")
    assert "unenforced" not in with_cgroup.box or bwrap.process_limit() != "pids-cgroup"
    monkeypatch.setattr(bwrap, "_pids_cgroup_usable", lambda: False)
    with Box(policy=Policy.from_toml(LIMITS), backend="bwrap", bundle_path=tmp_path / "n.tkb") as b:
        r = sh(b, "i=0; while [ $i -lt 40 ]; do sleep 30 & i=$((i+1)); done; ls /proc | grep -c '^[0-9]'; "
                  "kill $(jobs -p) 2>/dev/null; true")
    run = open_run(tmp_path / "n.tkb")
    if bwrap.process_limit() == "unenforced":  # host root: nothing holds the limit, and the run says so
        assert run.box["unenforced"] == "max_processes" and int(r.stdout) > 32
    else:  # another user: RLIMIT_NPROC holds it
        assert "unenforced" not in run.box and b"Resource temporarily unavailable" in r.stderr
    report = verify_bundle(tmp_path / "n.tkb")
    assert report.valid, [c for c in report.checks if not c.ok]


def test_memory_hog_is_stopped(tight_box):
    """1 GiB touched in a 512 MiB box: its memory cgroup's OOM kill (SIGKILL), or RLIMIT_AS's MemoryError where the
    host has no memory cgroup to give (memory_limit.py)."""
    r = tight_box.run([PY, "-c", "x = bytearray(1 << 30)"])
    if bwrap.memory_limit.mechanism() == "memory-cgroup":
        assert r.exit_code == -signal.SIGKILL, (r.exit_code, r.stderr)
    else:
        assert r.exit_code != 0 and b"MemoryError" in r.stderr
    assert tight_box.run(["echo", "alive"]).stdout == b"alive\n"


def test_cpu_time_limit_is_enforced(tight_box):
    t = time.monotonic()
    r = tight_box.run([PY, "-c", "while True: pass"])
    assert r.exit_code == -signal.SIGXCPU and time.monotonic() - t < 15


def test_workspace_size_limit_is_enforced(tight_box):
    r = sh(tight_box, "dd if=/dev/zero of=/workspace/big bs=1M count=20")
    assert r.exit_code != 0 and b"No space left on device" in r.stderr


def test_tmp_and_dev_shm_are_bounded_by_the_box_s_memory(tight_box):
    """/tmp and /dev/shm are tmpfs, host RAM no rlimit of the box counts: each is sized below memory_mib (512 MiB
    here: /tmp 256 MiB, /dev/shm 128 MiB) and the rest of /dev is read-only."""
    for path, mib in (("/tmp", 300), ("/dev/shm", 150)):
        r = sh(tight_box, f"dd if=/dev/zero of={path}/fill bs=1M count={mib}; rc=$?; rm -f {path}/fill; exit $rc")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, (path, r.stderr)
    assert sh(tight_box, "echo x > /dev/x").exit_code != 0
    assert sh(tight_box, "echo x > /dev/shm/x && echo y > /tmp/y && cat /dev/shm/x /tmp/y").stdout == b"x\ny\n"


def test_wall_time_limit_ends_the_box_and_is_recorded(signer, tmp_path):
    policy = Policy.from_toml("[exec]\ntimeout_s = 2\n")
    b = Box(policy=policy, backend="bwrap", bundle_path=tmp_path / "w.tkb").start()
    with pytest.raises(BoxEnded, match="timed out"):
        b.run(["sleep", "30"])
    with pytest.raises(BoxEnded):
        b.run(["echo", "after"])
    b.stop()
    run = open_run(tmp_path / "w.tkb")
    assert "timed out" in run.box["end_reason"]
    assert "timed out" in run.crossings()[-1].args["reason"]


def test_killed_signer_refuses_the_next_command_and_stops_the_box(private_signer, tmp_path):
    b = Box(backend="bwrap", home=private_signer.home, bundle_path=tmp_path / "lost.tkb").start()
    assert b.run(["echo", "1"]).exit_code == 0
    os.kill(private_signer.pid(), signal.SIGKILL)
    with pytest.raises(DoorRefused, match="TKB-SIGNER-UNAVAILABLE"):
        b.run(["touch", "/workspace/should-not-run"])
    assert b.ended and not b.running.alive()
    with pytest.raises(BoxEnded):
        b.run(["echo", "2"])
    with pytest.raises(BoxEnded, match="no bundle yet.*tkbox signer recover"):
        b.stop()
    # the signer comes back: the run is closed as one that ended early, and its bundle verifies to the last record
    private_signer.ensure()
    [bundle] = recover_orphans(private_signer)
    assert bundle == tmp_path / "lost.tkb"
    run = open_run(bundle)
    assert run.box["end_reason"].startswith("recovered: the run ended early") and "signer" in run.box["end_reason"]
    assert [c.args["argv"] for c in run.crossings() if c.door == "exec"] == [["echo", "1"]]
    private_signer.write_trust(tmp_path / "trust.json")
    assert verify_bundle(bundle, tmp_path / "trust.json").valid


# A guest program in place of the agent: it says hello, waits for the host's first stream, then attacks.
HOSTILE_AGENT = """
import os, struct, time
from tkbox_guest import protocol as p
fd = int(os.environ["TKBOX_DOOR_FD"])
os.write(fd, p.encode_json(p.OPEN, 2, {"kind": "hello"}) + p.encode(p.CLOSE, 2))
decoder, opened = p.Decoder(), False
while not opened:  # until the host opens its first stream (the kernel's, for execute)
    opened = any(f[0] == p.OPEN and f[1] == 1 for f in decoder.feed(os.read(fd, 65536)))
"""
KERNEL_MSG = {"channel": "iopub", "header": {"msg_id": "m", "msg_type": "stream"}, "parent_header": {},
              "metadata": {}, "content": {"name": "stdout", "text": "x"}, "buffers": []}
HOSTILE = {
    "garbage": "os.write(fd, b'\\xff' * 64)",
    "oversized frame": "os.write(fd, struct.pack('>IBI', 100 << 20, 2, 1))",
    "too many streams": ("for i in range(4, 400, 2):\n"
                         "    os.write(fd, p.encode_json(p.OPEN, i, {}))"),
    "data past the window": ("chunk = p.encode(p.DATA, 1, b'\\x03' + b'x' * 200000)\n"
                             "for _ in range(20):\n    os.write(fd, chunk)"),
    "oversized kernel message": "os.write(fd, p.encode(p.DATA, 1, b'\\x03' + struct.pack('>I', 100 << 20)))",
    "kernel message not JSON": "os.write(fd, p.encode(p.DATA, 1, b'\\x03' + struct.pack('>I', 3) + b'{{{'))",
    "malformed kernel message": ("msg = dict(%r)\nmsg['content'] = {'name': 'stdin', 'text': 7}\n"
                                 "os.write(fd, p.encode(p.DATA, 1, b'\\x03' + p.encode_message(msg)))") % KERNEL_MSG,
    "kernel message with extra keys": ("msg = dict(%r, extra=1)\n"
                                       "os.write(fd, p.encode(p.DATA, 1, b'\\x03' + p.encode_message(msg)))")
                                      % KERNEL_MSG,
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_guest_ends_its_own_box_and_the_host_stays_up(signer, tmp_path, attack):
    program = HOSTILE_AGENT + HOSTILE[attack] + "\ntime.sleep(30)\n"
    b = Box(backend="bwrap", bundle_path=tmp_path / "h.tkb", agent_argv=["python3", "-c", program]).start()
    with pytest.raises(BoxEnded, match="protocol violation|door stream"):
        b.execute("1 + 1")
    b.stop()
    run = open_run(tmp_path / "h.tkb")
    assert "protocol violation" in run.box["end_reason"] or "door stream" in run.box["end_reason"]
    assert verify_bundle(tmp_path / "h.tkb").valid
    with Box(backend="bwrap", bundle_path=tmp_path / "next.tkb") as again:  # the host is fine
        assert again.run(["echo", "ok"]).stdout == b"ok\n"


def test_concurrent_commands_share_one_door(box):
    results = {}

    def one(i):
        results[i] = box.run(["sh", "-c", f"sleep 0.3; echo {i}"]).stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == {i: f"{i}\n".encode() for i in range(4)}
    assert time.monotonic() - t < 1.2  # they ran at once


BIG_OUTPUT = """
import random, sys, threading
seed = int(sys.argv[1])
def write(stream, n, salt):
    r = random.Random(seed * 7 + salt)
    for _ in range(n):
        stream.write(r.randbytes(65536))
    stream.flush()
t = threading.Thread(target=write, args=(sys.stderr.buffer, 24, 1))
t.start()
write(sys.stdout.buffer, 96, 0)
t.join()
"""


def test_large_outputs_of_concurrent_commands_arrive_whole(box):
    """Guest -> host bulk: 6 MiB of stdout and 1.5 MiB of stderr from each of two commands at once, each frame sent
    from its parts (header, channel, bytes) without joining them, arrive byte for byte on their own streams."""
    import random

    def expected(seed, n, salt):
        r = random.Random(seed * 7 + salt)
        return b"".join(r.randbytes(65536) for _ in range(n))

    results = {}

    def one(i):
        results[i] = box.run(["python3", "-c", BIG_OUTPUT, str(i)])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(2):
        assert results[i].exit_code == 0, results[i].stderr[-500:]
        assert results[i].stdout == expected(i, 96, 0)
        assert results[i].stderr == expected(i, 24, 1)


def test_quickstart_notebook_executes_in_a_box_and_verifies(signer, tmp_path):
    from tkbox_nb.cli.demo import NOTEBOOK, execute_notebook
    executed, bundle = execute_notebook(NOTEBOOK, tmp_path)
    import nbformat
    nb = nbformat.read(executed, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.outputs[-1]["data"]["text/plain"] == "['lo']"
    assert "bwrap" in "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert verify_bundle(bundle).valid


def test_a_box_flooding_its_stderr_costs_the_host_only_a_bounded_tail(signer, tmp_path):
    program = "import os\nfor _ in range(1600):\n    os.write(2, b'y' * 65536)\nos.write(2, b'\\nthe end\\n')\n"
    b = Box(backend="bwrap", bundle_path=tmp_path / "f.tkb", agent_argv=["python3", "-c", program])
    with pytest.raises(BoxEnded, match="did not come up.*the end"):
        b.start()
    assert len(b.running.log_tail()) <= 8192
    assert "did not come up" in open_run(tmp_path / "f.tkb").box["end_reason"]


def test_the_host_environment_is_invisible_in_the_box(signer, tmp_path, monkeypatch):
    monkeypatch.setenv("TKB_HOST_ONLY_SECRET", "host-env-value-5d1e")
    with Box(backend="bwrap", bundle_path=tmp_path / "env.tkb") as b:
        r = b.run(["sh", "-c", "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"])
    assert b"host-env-value-5d1e" not in r.stdout and b"TKB_HOST_ONLY_SECRET" not in r.stdout


def test_a_command_leaves_nothing_running_behind_it(box):
    """A command's process group ends with it: a background child neither outlives it nor holds its output open."""
    t = time.monotonic()
    r = box.run(["sh", "-c", "sleep 301 & echo started"])
    assert r.stdout == b"started\n" and time.monotonic() - t < 30
    left = box.run([PY, "-c", "import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit() and "
                                "open(f'/proc/{p}/cmdline', 'rb').read() == b'sleep\\x00301\\x00'))"])
    assert left.stdout == b"0\n"


KILLED_HOST = """
import sys, time
from tkbox_nb import Box
box = Box(backend="bwrap", bundle_path=sys.argv[1]).start()
print(box.running._workdir, box.running.cgroup or "", flush=True)
time.sleep(600)
"""


def test_a_host_process_killed_mid_box_leaves_no_scratch_after_the_next_start(signer, tmp_path):
    """A host process killed with SIGKILL cannot remove its box's /etc copy or pids cgroup; the next box start on
    the machine removes those of dead processes (tkbox_nb/core/scratch.py), and never a live box's."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_HOST, str(tmp_path / "killed.tkb")], stdout=subprocess.PIPE,
                            env={**os.environ, "TKBOX_HOME": str(signer.home)})
    workdir, _, cgroup = proc.stdout.readline().decode().strip().partition(" ")
    assert Path(workdir).is_dir(), workdir
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while cgroup and (Path(cgroup) / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)  # bwrap dies with its parent; its processes are gone a moment later
    with Box(backend="bwrap", bundle_path=tmp_path / "next.tkb") as box:
        assert box.run(["true"]).exit_code == 0
        assert box.running._workdir.is_dir()  # a live box's own stays
        assert not Path(workdir).exists()
        assert not cgroup or not Path(cgroup).exists()


SEEDED_HOST = """
import sys, time
from tkbox_nb import Box
box = Box(backend="bwrap", workspace=sys.argv[1], bundle_path=sys.argv[2]).start()
print(box.recorder.spool, flush=True)
time.sleep(600)
"""


def test_the_workspace_copy_is_removed_when_a_killed_host_s_run_is_recovered(signer, tmp_path):
    """The seed (the workspace copy, .env files and all) in the run's spool goes once recovery bundles the run."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / ".env").write_text("TOKEN=host-secret\n")
    proc = subprocess.Popen([sys.executable, "-c", SEEDED_HOST, str(ws), str(tmp_path / "s.tkb")],
                            stdout=subprocess.PIPE, env={**os.environ, "TKBOX_HOME": str(signer.home)})
    try:
        spool = Path(proc.stdout.readline().decode().strip())
        assert (spool / "seed" / ".env").exists()
    finally:
        proc.kill()
        proc.wait()
    assert tmp_path / "s.tkb" in recover_orphans(signer)
    assert not (spool / "seed").exists()


STALLING_GUEST = """
import os, socket, struct
s = socket.socket(fileno=int(os.environ["TKBOX_DOOR_FD"]))
body = b'{"kind":"hello","pid":1,"python":"3.x"}'
s.sendall(struct.pack(">IBI", len(body), 1, 2) + body)
while s.recv(1 << 16):
    pass
"""


def test_an_interrupted_stop_still_ends_the_box_and_closes_its_run(signer, tmp_path):
    """A guest that never answers the stop-time patch request; an interrupt (Ctrl-C) meanwhile still kills the box,
    closes the run (saying so), writes the bundle and removes the workspace copy, then reaches the caller."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "stall.py").write_text(STALLING_GUEST)
    b = Box(backend="bwrap", workspace=ws, bundle_path=tmp_path / "i.tkb",
            agent_argv=["python3", "/run/tkbox/seed/stall.py"]).start()

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            b.stop()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not b.running.alive() and b.recorder.closed and not (b.recorder.spool / "seed").exists()
    run = open_run(tmp_path / "i.tkb")
    assert "stop interrupted (KeyboardInterrupt)" in run.box["end_reason"]
    assert verify_bundle(tmp_path / "i.tkb").valid


WRITE_EVERY_FD = r"""
import os, sys
marker, agent, opened = sys.argv[1].encode(), None, {}
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"tkbox_guest.agent" in argv and not argv[0].endswith(b"bwrap"):
            agent = agent or pid
    except OSError:
        continue
    for fd in range(64):
        try:
            w = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(w, marker + b"\n")
            opened.setdefault(pid, []).append(fd)
        except OSError:
            pass
        os.close(w)
print("agent", agent, "opened", opened.get(agent, []), "pid1", opened.get(1, []))
"""


def test_box_code_cannot_write_the_agent_s_stderr_or_the_host_s_start_error_tail(signer, tmp_path):
    """The agent's stderr is a pipe to the host, shown as the tail of a box that did not come up: box code (the
    agent's user) opened /proc/2/fd/2 and wrote there. The agent is not dumpable, so none of its fds opens; what
    reaches the host's stream some other way (bubblewrap's init's stderr) after the hello is dropped."""
    with Box(backend="bwrap", bundle_path=tmp_path / "fd.tkb") as b:
        assert b.execute("1 + 1").status == "ok"  # a kernel too: its fds are written as well
        r = b.run([PY, "-c", WRITE_EVERY_FD, "tkbox-marker-6c1f"])
        out = r.stdout.decode()
        assert r.exit_code == 0 and "agent 2 opened [] " in out, (out, r.stderr)
        time.sleep(0.3)  # what reached the host's stream is drained
        assert "tkbox-marker-6c1f" not in b.running.log_tail()
        assert b.execute("2 + 2").outputs[-1]["data"]["text/plain"] == "4"  # the box still works
    assert "tkbox-marker-6c1f" not in b.running.log_tail()


def test_no_box_process_s_command_line_or_environment_names_a_host_path(signer, tmp_path):
    """/proc/1/cmdline was bubblewrap's whole command line (the host scratch directory, the interpreter's and the
    venv's host paths); the agent ran as <venv>/bin/python3. Now bubblewrap's options come through a file, the
    interpreter and venv are seen at /opt/tkbox, and the box's /etc is copied in, not bound from a host folder."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("x\n")
    host_paths = {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix), str(tmp_path), "tkbox-box-",
                  str(Path(bwrap.__file__).resolve().parents[2]), os.environ.get("TKBOX_HOME") or "/nonexistent"}
    with Box(backend="bwrap", workspace=ws, bundle_path=tmp_path / "p.tkb") as b:
        assert b.execute("import ipykernel, sys; sys.prefix").outputs[-1]["data"]["text/plain"] == "'/opt/tkbox/venv'" \
            or sys.prefix == sys.base_prefix
        r = sh(b, "for p in /proc/[0-9]*; do echo \"== $p\"; tr '\\0' ' ' < $p/cmdline; echo; "
                  "tr '\\0' ' ' < $p/environ 2>/dev/null; echo; done; echo == mountinfo; cat /proc/self/mountinfo")
    out = r.stdout.decode()
    assert "bwrap --args" in out and "tkbox_guest.agent" in out and "ipykernel" in out and "PATH=" in out, out
    listed = out.split("== mountinfo")[0]
    for path in host_paths:
        assert path not in listed, (path, listed)
    assert "tkbox-box-" not in out.split("== mountinfo")[1]  # the box's /etc is no host scratch folder


@pytest.mark.skipif(not Path("/etc/fonts/fonts.conf").is_file(), reason="this host has no fontconfig config to give")
def test_fontconfig_finds_its_config_in_the_box_and_it_is_read_only(box):
    """matplotlib asks fontconfig's fc-list for the fonts as it builds its font cache (each new box): without the
    fonts config every first plot printed `Fontconfig error: Cannot load default config file` (issue 36). The box sees
    the host's /etc/fonts read-only (fonts.conf and its conf.d links into /usr), nothing more of the host's /etc."""
    r = sh(box, "MPLCONFIGDIR=$(mktemp -d) python3 -c 'import matplotlib; matplotlib.use(\"Agg\")\n"
                "import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.savefig(\"/tmp/p.png\"); print(\"plotted\")'"
                " ; fc-list --format='%{file}\\n' | head -1")
    assert b"plotted" in r.stdout, r.stderr
    assert b"Fontconfig" not in r.stderr and b"/usr/share/fonts/" in r.stdout, r.stderr
    assert sh(box, "echo x > /etc/fonts/x").exit_code != 0
    assert sh(box, "ls /etc/fonts").stdout.decode().split() == sorted(os.listdir("/etc/fonts"))


def test_the_stated_workspace_digest_is_of_the_bytes_the_box_got_while_the_folder_changes(signer, tmp_path):
    """Files replaced on the host while the box starts: the digest box.start signs is of the copy the box was
    given, never of a version it did not get (it was taken from the folder before a separate copy)."""
    ws, staging, names = tmp_path / "ws", tmp_path / "staging", [f"f{i}" for i in range(12)]
    ws.mkdir()
    staging.mkdir()
    for name in names:
        (ws / name).write_text(f"{name} one\n")
    (ws / "big.bin").write_bytes(os.urandom(8 << 20))  # the start takes a while: the files change under it
    stop = threading.Event()

    def churn():
        n = 0
        while not stop.is_set():
            n += 1
            for name in names:
                (staging / name).write_text(f"{name} {'one' if n % 2 else 'two'}\n")
                os.replace(staging / name, ws / name)  # whole files: each read sees one version or the other

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        b = Box(backend="bwrap", workspace=ws, bundle_path=tmp_path / "c.tkb").start()
    finally:
        stop.set()
        writer.join()
    try:
        got = b.run(["cat", *names]).stdout.decode().splitlines()
        big = b.run(["sha256sum", "big.bin"]).stdout.split()[0]
        listed = b.run(["ls", "-A"]).stdout.decode().split()
    finally:
        b.stop()
    seen = tmp_path / "seen"  # the tree the box got, made again on the host
    seen.mkdir()
    for name, line in zip(names, got):
        (seen / name).write_text(line + "\n")
    (seen / "big.bin").write_bytes((ws / "big.bin").read_bytes())
    assert hashlib.sha256((seen / "big.bin").read_bytes()).hexdigest().encode() == big
    assert sorted(listed) == sorted([*names, "big.bin"])
    assert open_run(tmp_path / "c.tkb").box["workspace_digest"] == tree_digest(seen)
    assert not any((signer.home / "seeds").iterdir())  # the staged copy was moved, nothing of it left


def test_a_start_that_fails_on_the_workspace_leaves_no_staged_copy(signer, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("a\n")
    os.mkfifo(ws / "pipe")
    with pytest.raises(TkboxError, match="not a file, directory or symbolic link"):
        Box(backend="bwrap", workspace=ws, bundle_path=tmp_path / "f.tkb").start()
    assert not any((signer.home / "seeds").iterdir())


def _descendants(pid: int) -> list[tuple[int, str]]:
    """`pid`'s process and all below it, each (pid, command line), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            out.append((p, Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")))
        except OSError:
            pass
        todo += children.get(p, [])
    return out


def test_a_spawned_box_starts_nothing_of_its_own_before_the_host_s_go(tmp_path):
    """A bubblewrap box is spawned before its run's box.start is signed (its dataset mounts are walked meanwhile):
    until the host's GO its agent sends nothing on the door and copies no workspace file (an early kernel's zygote
    may import ipykernel, from /, and gets a kernel's folder only when the host asks, after the GO); after the GO the
    workspace is there and its hello comes. A box killed before its GO leaves no process."""
    import select

    from tkbox_nb.backends.base import BoxSpec
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "x.txt").write_text("x\n")
    running = BwrapBackend().start(BoxSpec(box_id="go-test", seed=seed, env={"TKBOX_KERNEL_EARLY": "1"}))
    try:
        time.sleep(2)  # the agent's imports, and its copy of the workspace were it not waiting
        assert select.select([running.door], [], [], 0)[0] == [], "the agent spoke before its GO"
        procs = _descendants(running.proc.pid)
        agent = next(pid for pid, c in procs if "tkbox_guest.agent" in c and "bwrap" not in c.split()[0])
        workspace = Path(f"/proc/{agent}/root/workspace")  # the box's own view, read by the host
        assert workspace.is_dir() and list(workspace.iterdir()) == [], procs
        running.go()
        assert select.select([running.door], [], [], 30)[0] == [running.door]
        assert b"hello" in running.door.recv(65536)
        assert (workspace / "x.txt").read_text() == "x\n"
    finally:
        running.kill()
    waiting = BwrapBackend().start(BoxSpec(box_id="go-test-2", seed=None))
    time.sleep(1)
    pid = waiting.proc.pid
    waiting.kill()
    assert waiting.proc.poll() is not None and _descendants(pid) == []
