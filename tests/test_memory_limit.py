"""memory_limit.py's pure parts: where this process's memory cgroup is, from /proc/self/cgroup's text (hostile
shapes included), and the limits a box's cgroup and rlimit get."""

from __future__ import annotations

import resource
from pathlib import Path

from tkbox_nb.backends.memory_limit import limits, own_cgroup

ROOT = Path("/sys/fs/cgroup")


def test_a_v1_memory_hierarchy_is_found_before_the_unified_one():
    text = "9:name=systemd:/\n4:memory:/process_api/ab12\n0::/\n"
    assert own_cgroup(text, ROOT) == ("v1", ROOT / "memory" / "process_api/ab12")
    assert own_cgroup("5:cpu,memory:/a\n", ROOT) == ("v1", ROOT / "memory" / "a")


def test_a_v2_only_host_uses_its_unified_cgroup(tmp_path):
    """On a v2-only host the unified hierarchy is the root itself; on a hybrid host it is mounted at unified/."""
    assert own_cgroup("0::/user.slice/s.scope\n", tmp_path) == ("v2", tmp_path / "user.slice/s.scope")
    (tmp_path / "unified").mkdir()
    assert own_cgroup("0::/user.slice/s.scope\n", tmp_path) == ("v2", tmp_path / "unified/user.slice/s.scope")


def test_odd_or_hostile_lines_name_no_cgroup():
    for text in ("", "garbage\n", "4:memory:relative\n", "4:memory:/../../etc\n", "4:memory\n"):
        assert own_cgroup(text, ROOT) is None, text


def test_the_cgroup_holds_memory_mib_and_then_no_address_space_cap_is_set():
    held = limits(512, True)
    assert held["memory.limit_in_bytes"] == held["memory.memsw.limit_in_bytes"] == held["memory.max"] == 512 << 20
    assert held["memory.swap.max"] == 0 and held["rlimit_as"] == resource.RLIM_INFINITY
    assert limits(512, False)["rlimit_as"] == 512 << 20  # no cgroup: RLIMIT_AS stays the limit
