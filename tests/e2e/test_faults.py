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

import pytest

from tkbox_nb import Box, BoxEnded, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.errors import BundleError
from tkbox_nb.verify import verify_bundle

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
