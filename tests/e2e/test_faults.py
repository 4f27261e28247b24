"""Faults injected into real boxes: the guest agent killed mid-cell and mid-transfer, the disk filling while a bundle
is written, and a box flooding a door while another box on the host works on. Each box ends fail-closed with the
reason as its run's last word, and every bundle that is written verifies.

(The signer killed or stalled mid-run, a hostile guest breaking the protocol and a killed host kernel are in
test_bwrap_box.py, test_signed_run.py and test_kernel.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import pytest

from tkbox_nb import Box, BoxEnded, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.core.errors import BundleError
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

KILL_PARENT = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"  # the parent of a cell or command: the agent


def assert_ended_early(path, why: str) -> None:
    """The bundle verifies, and both its box manifest and its last signed record say why the box ended."""
    report = verify_bundle(path)
    assert report.valid, report.summary()
    run = open_run(path)
    last = run.crossings()[-1]
    assert last.tool == "box.stop" and re.search(why, last.args["reason"]), last.args
    assert re.search(why, run.box["end_reason"]), run.box["end_reason"]
    return run


def test_the_agent_killed_mid_cell_ends_the_box_and_the_bundle_says_why(signer, tmp_path):
    box = Box(backend="bwrap", bundle_path=tmp_path / "cell.tkb").start()
    assert box.execute("x = 6 * 7\nx").outputs[-1]["data"]["text/plain"] == "42"
    with pytest.raises(BoxEnded):
        box.execute("print('before the kill', flush=True)\n" + KILL_PARENT + "import time\ntime.sleep(30)\n")
    assert not box.running.alive()
    with pytest.raises(BoxEnded):
        box.run(["echo", "after"])
    box.stop()
    run = assert_ended_early(tmp_path / "cell.tkb", "died|door stream|ended")
    cells = [c for c in run.crossings() if c.args.get("kind") == "cell"]
    assert len(cells) == 2 and cells[0].result["status"] == "ok"
    assert cells[1].result["status"] == "error" and cells[1].result.get("ended")  # the killed cell's end is signed
    assert not [c for c in run.crossings() if c.args.get("argv") == ["echo", "after"]]  # nothing after the end


def test_the_agent_killed_mid_transfer_ends_the_box_and_the_bundle_says_why(signer, tmp_path):
    box = Box(backend="bwrap", bundle_path=tmp_path / "transfer.tkb").start()
    program = ("import os, signal, sys\nw = sys.stdout.buffer\nfor _ in range(32):\n    w.write(b'x' * 65536)\n"
               "w.flush()\nos.kill(os.getppid(), signal.SIGKILL)\nfor _ in range(64):\n    w.write(b'y' * 65536)\n")
    with pytest.raises(BoxEnded):
        box.run(["python3", "-c", program])
    box.stop()
    run = assert_ended_early(tmp_path / "transfer.tkb", "died|door stream|ended")
    command = next(c for c in run.crossings() if c.args.get("kind") == "command")
    assert command.decision == "allow" and command.result is None  # decided and signed; no end was ever claimed


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs of our own, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_while_writing_the_bundle_is_one_clear_error_and_leaves_no_partial_file(signer, tmp_path,
                                                                                           small_disk):
    box = Box(backend="bwrap", bundle_path=small_disk / "run.tkb").start()
    r = box.run(["head", "-c", "300000", "/dev/urandom"])  # incompressible content the bundle must disclose
    assert r.exit_code == 0 and len(r.stdout) == 300000
    with pytest.raises(BundleError, match="No space left on device") as e:
        box.stop()
    assert "\n" not in str(e.value) and str(small_disk / "run.tkb") in str(e.value)
    assert os.listdir(small_disk) == []  # neither a truncated bundle nor its temporary file
    again = box.recorder.write_bundle(tmp_path / "elsewhere.tkb")  # the run is closed and whole: write it elsewhere
    run = open_run(again)
    assert verify_bundle(again).valid and run.content(run.crossings()[1].result["stdout"]) == r.stdout


FLOOD_AGENT = """
import os, time
from tkbox_guest import protocol as p
fd = int(os.environ["TKBOX_DOOR_FD"])
os.write(fd, p.encode_json(p.OPEN, 2, {"kind": "hello"}) + p.encode(p.CLOSE, 2))
decoder, opened = p.Decoder(), False
while not opened:  # the host's first stream: then flood the egress door with connections it must decide
    opened = any(f[0] == p.OPEN and f[1] == 1 for f in decoder.feed(os.read(fd, 65536)))
request = b"\\x04CONNECT 10.1.2.3:80 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"
for sid in range(4, 4 + 2 * 400, 2):
    os.write(fd, p.encode_json(p.OPEN, sid, {"kind": "egress"}) + p.encode(p.DATA, sid, request))
time.sleep(60)
"""


def test_a_box_flooding_a_door_ends_itself_and_another_box_works_on(signer, tmp_path):
    calm = Box(backend="bwrap", bundle_path=tmp_path / "calm.tkb").start()
    flood = Box(backend="bwrap", bundle_path=tmp_path / "flood.tkb",
                agent_argv=["python3", "-c", FLOOD_AGENT]).start()
    result = {}
    counting = threading.Thread(target=lambda: result.update(r=calm.run(
        ["sh", "-c", "for i in $(seq 1 40); do echo $i; sleep 0.05; done"])))
    counting.start()
    with pytest.raises(BoxEnded, match="protocol violation"):
        flood.run(["true"])
    flood.stop()
    counting.join(60)
    assert result["r"].exit_code == 0 and result["r"].stdout == b"".join(b"%d\n" % i for i in range(1, 41))
    assert calm.run(["echo", "still here"]).stdout == b"still here\n"
    calm.stop()
    run = assert_ended_early(tmp_path / "flood.tkb", "more than 256 streams")
    egress = [c for c in run.crossings() if c.door == "egress"]
    assert egress and all(c.decision == "deny" for c in egress)  # what it did get decided was refused and signed
    assert verify_bundle(tmp_path / "calm.tkb").valid


STALLED_READER = """
import os, struct, time
from tkbox_guest import protocol as p
fd = int(os.environ["TKBOX_DOOR_FD"])
os.write(fd, p.encode_json(p.OPEN, 2, {"kind": "hello"}) + p.encode(p.CLOSE, 2))
decoder, sid = p.Decoder(), None
while sid is None:
    sid = next((f[1] for f in decoder.feed(os.read(fd, 65536)) if f[0] == p.OPEN and f[1] % 2 == 1), None)
os.write(fd, p.encode(p.WINDOW, sid, struct.pack(">I", 15 << 20)))
time.sleep(3600)  # a window for 16 MiB of stdin, and never another read of the door
"""


def _within(seconds: float, fn):
    """fn() in a thread: (returned, its value or exception), never a hung test."""
    out = {}

    def go():
        try:
            out["v"] = fn()
        except Exception as e:
            out["v"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("v")


def test_a_box_that_stops_reading_ends_at_the_exec_deadline_which_covers_stdin(signer, tmp_path):
    """The command's deadline starts before its stdin is sent: a box that took a window for the stdin and stopped
    reading its door ends at the deadline (the host's write wakes), where the host hung for good, and so did stop."""
    box = Box(backend="bwrap", bundle_path=tmp_path / "stalled.tkb", agent_argv=["python3", "-c", STALLED_READER])
    box.start()
    started = time.monotonic()
    stdin = os.urandom(14 << 20)  # more than the socket holds (its buffers are large); random: the bundle has it
    returned, value = _within(30, lambda: box.run(["cat"], stdin=stdin, timeout=2))
    assert returned, "the command never returned"
    assert isinstance(value, BoxEnded) and "exec timed out after 2s" in str(value)
    assert time.monotonic() - started < 10
    returned, value = _within(30, box.stop)
    assert returned and value == tmp_path / "stalled.tkb", value
    assert_ended_early(tmp_path / "stalled.tkb", "exec timed out after 2s")


ANSWERS_EXIT = """
import os
from tkbox_guest import protocol as p
fd = int(os.environ["TKBOX_DOOR_FD"])
os.write(fd, p.encode_json(p.OPEN, 2, {"kind": "hello"}) + p.encode(p.CLOSE, 2))
decoder = p.Decoder()
while True:
    for f in decoder.feed(os.read(fd, 65536)):
        if f[0] == p.OPEN and f[1] % 2 == 1:
            os.write(fd, p.encode(p.CLOSE, f[1], b'{"exit_code": CODE}'))
"""


@pytest.mark.parametrize("code", [2 ** 60, 256, -128, -(2 ** 53)])
def test_an_exit_status_no_process_can_have_ends_the_box_unsigned(signer, tmp_path, code):
    """The signer refuses an integer past 2**53 - 1; the exec door took any integer, so the result went unsigned,
    the run broke, run() returned it anyway and stop() blamed the signer. Now only what a process can end with
    (0..255, or minus a signal) is taken; anything else is a door protocol violation, and the bundle says so."""
    box = Box(backend="bwrap", bundle_path=tmp_path / "exit.tkb",
              agent_argv=["python3", "-c", ANSWERS_EXIT.replace("CODE", str(code))]).start()
    with pytest.raises(BoxEnded, match="exit status"):
        box.run(["true"])
    assert box.stop() == tmp_path / "exit.tkb"
    run = assert_ended_early(tmp_path / "exit.tkb", "protocol violation: .*exit status")
    command = next(c for c in run.crossings() if c.args.get("kind") == "command")
    assert command.decision == "allow" and command.result is None


def test_a_result_the_run_does_not_take_ends_the_box_and_is_never_returned(signer, tmp_path):
    """When the run cannot record a crossing's end (here: the signer refuses it), the caller gets BoxEnded, never the
    unsigned result, and the box ends at once with the reason."""
    box = Box(backend="bwrap", bundle_path=tmp_path / "refused.tkb").start()
    assert box.run(["echo", "signed"]).stdout == b"signed\n"
    lanes = box.recorder._lanes
    real = lanes.call

    def call(op, **kw):
        if op == "complete":
            raise RuntimeError("the signer refused the record")
        return real(op, **kw)
    lanes.call = call
    with pytest.raises(BoxEnded, match="signer lost: complete of .* was not recorded"):
        box.run(["echo", "unsigned"])
    assert not box.running.alive() and box.ended.startswith("signer lost")
    with pytest.raises(BoxEnded):
        box.run(["echo", "after"])
    lanes.call = real
    with pytest.raises(BoxEnded, match="no bundle yet"):
        box.stop()
    from tkbox_nb.signing.recovery import recover_orphans
    assert tmp_path / "refused.tkb" in recover_orphans(box.signer)  # the run, closed once the signer answers
    run = open_run(tmp_path / "refused.tkb")
    assert verify_bundle(tmp_path / "refused.tkb").valid and "not recorded" in run.box["end_reason"]
    commands = [c for c in run.crossings() if c.args.get("kind") == "command"]
    assert [c.result is not None for c in commands] == [True, False]  # the second's end was never signed
