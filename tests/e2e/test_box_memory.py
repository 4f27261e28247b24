"""A bubblewrap box's memory limit is what it uses, not what it maps (memory_limit.py): a box that touches more than
`memory_mib` is stopped and the run says why; one that only maps (as torch and CUDA do) is not; its cgroup goes with
it."""

from __future__ import annotations

import os
import signal

import pytest

from tkbox_nb import Box, BoxEnded, Policy, open_run
from tkbox_nb.backends import memory_limit
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(memory_limit.mechanism() != memory_limit.CGROUP,
                                 reason="no memory cgroup can be made here: RLIMIT_AS holds memory_mib")]

SMALL = Policy.from_toml("[box]\nmemory_mib = 256\n")
HOG = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"  # bytearray zero-fills: every page touched
MAPS = ("import mmap\n"  # 8 x memory_mib of address space, none of it touched: what CUDA and torch's libraries do
        "reserved = mmap.mmap(-1, 8 * 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)  # PROT_NONE\n"
        "untouched = mmap.mmap(-1, 8 * 256 << 20)\n"
        "untouched[0] = 1\nprint(len(reserved) + len(untouched))\n")


def test_a_box_that_touches_past_memory_mib_is_killed_and_the_result_says_why(signer, tmp_path):
    with Box(policy=SMALL, backend="bwrap", bundle_path=tmp_path / "m.tkb") as b:
        r = b.run(["python3", "-c", HOG])
        assert r.exit_code == -signal.SIGKILL, (r.exit_code, r.stderr[-300:])
        assert b.run(["echo", "alive"]).stdout == b"alive\n"  # the hog was the one killed, not the box
    run = open_run(tmp_path / "m.tkb")
    assert run.box["memory_limit"] == "memory-cgroup"
    [hog, alive] = [c for c in run.crossings() if c.door == "exec"]
    assert (hog.result["exit_code"], hog.result["killed_by"]) == (-9, "memory limit")
    assert "killed_by" not in alive.result


def test_a_box_that_maps_a_large_untouched_address_space_is_not_stopped(signer, tmp_path):
    """Under the old RLIMIT_AS = memory_mib this mmap failed (ENOMEM), as torch's import did."""
    with Box(policy=SMALL, backend="bwrap", bundle_path=tmp_path / "a.tkb") as b:
        r = b.run(["python3", "-c", MAPS])
    assert r.exit_code == 0 and int(r.stdout) == 16 * 256 << 20, r.stderr[-300:]
    start = open_run(tmp_path / "a.tkb").crossings()[0]
    assert start.door == "box" and start.args["memory_limit"] == "memory-cgroup"
    report = verify_bundle(tmp_path / "a.tkb")  # the manifest's memory_limit is the signed one
    assert report.valid, [c for c in report.checks if not c.ok]


def test_a_box_whose_own_agent_passes_the_limit_ends_saying_so(signer, tmp_path):
    b = Box(policy=SMALL, backend="bwrap", bundle_path=tmp_path / "d.tkb",
            agent_argv=["python3", "-c", "x = bytearray(1 << 30)"])
    with pytest.raises(BoxEnded, match="killed by the memory limit"):
        b.start()
    assert "memory limit" in open_run(tmp_path / "d.tkb").box["end_reason"]


def _cgroup_of(b: Box):
    cg = b.running.memory_cgroup
    assert cg is not None and cg.is_dir() and cg.name == f"tkbox-{os.getpid()}-{b.box_id}"
    assert int((cg / "memory.limit_in_bytes" if (cg / "memory.limit_in_bytes").exists() else cg / "memory.max")
               .read_text()) == 256 << 20
    return cg


def test_the_box_s_memory_cgroup_is_removed_at_stop_and_after_a_kill(signer, tmp_path):
    with Box(policy=SMALL, backend="bwrap", bundle_path=tmp_path / "s.tkb") as b:
        cg = _cgroup_of(b)
        assert str(b.running.proc.pid) in (cg / "cgroup.procs").read_text().split()
    assert not cg.exists()
    b = Box(policy=SMALL, backend="bwrap", bundle_path=tmp_path / "k.tkb").start()
    cg = _cgroup_of(b)
    b.run(["sh", "-c", "sleep 600 & exit 0"])  # a process of the box that left bwrap's process group
    os.killpg(b.running.proc.pid, signal.SIGKILL)  # bwrap killed from outside: the box's processes may live on
    b.stop()
    assert not cg.exists()
