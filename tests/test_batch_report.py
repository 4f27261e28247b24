"""The pure parts of `tkbox rerun --many` (tkbox_nb/audit/batch.py): scheduler addresses, rerun paths, exit status and
the report, whose text comes partly from the bundles (cell code and outputs: hostile)."""

from __future__ import annotations

import os

import pytest

from tkbox_nb.core.atomic_file import write_atomic
from tkbox_nb.audit.batch import BatchResult, exit_code, html_report, rerun_path, scheduler_address, table
from tkbox_nb.core.errors import TkboxError


def test_scheduler_addresses_are_read_strictly():
    assert scheduler_address("tcp://10.0.0.5:8786") == ("10.0.0.5", 8786)
    assert scheduler_address("tls://[::1]:8786") == ("::1", 8786)
    for bad in ("10.0.0.5:8786", "tcp://host", "tcp://:8786", "tcp://h:0", "tcp://h:99999", "udp://h:1",
                "tcp://h:8786/x", "tcp://a/b:1", ""):
        with pytest.raises(TkboxError, match="give tcp://HOST:PORT"):
            scheduler_address(bad)


def test_a_rerun_path_depends_only_on_the_bundle(tmp_path):
    a, b = tmp_path / "x" / "run.tkb", tmp_path / "y" / "run.tkb"
    assert rerun_path(a, tmp_path / "out") == rerun_path(str(a), tmp_path / "out")
    assert rerun_path(a, tmp_path / "out") != rerun_path(b, tmp_path / "out")  # same name, other bundle
    assert rerun_path(a, tmp_path / "out").name.startswith("run.") and rerun_path(a, "o").suffix == ".tkb"


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "d" / "r.tkb"
    p.parent.mkdir()
    write_atomic(p, b"first")
    write_atomic(p, b"second")
    assert p.read_bytes() == b"second" and [f.name for f in p.parent.iterdir()] == ["r.tkb"]
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (p.parent / f".r.tkb.{os.getpid()}.tmp").symlink_to(victim)  # where a predictable temporary name once was

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_atomic(p, fail)
    assert p.read_bytes() == b"second" and victim.read_bytes() == b"keep"
    assert sorted(f.name for f in p.parent.iterdir()) == [f".r.tkb.{os.getpid()}.tmp", "r.tkb"]


def test_exit_status_and_report():
    eq, diff = BatchResult("a.tkb", "equivalent"), BatchResult("b.tkb", "different", "x", 1)
    failed = BatchResult("c.tkb", "failed", "does not verify")
    assert exit_code([eq]) == 0 and exit_code([eq, diff]) == 1 and exit_code([eq, diff, failed]) == 2
    assert table([eq, diff, failed]).endswith("3 bundle(s): 1 equivalent, 1 different, 1 failed")
    hostile = BatchResult("<img src=x onerror=alert(1)>.tkb", "different", "<script>alert(1)</script>", 1,
                          details=[{"what": "cell outputs #1", "a": "<script>a</script>", "b": "</pre><iframe>"}])
    page = html_report([hostile])
    assert "<script" not in page and "<img" not in page and "<iframe" not in page and "</pre><iframe" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "0 equivalent, 1 different, 0 failed" in page


def test_only_the_scratch_of_dead_workers_is_swept(tmp_path):
    import subprocess
    import sys

    from tkbox_nb.audit.batch import SCRATCH_PREFIX, sweep_scratch
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, live, other = (tmp_path / f"{SCRATCH_PREFIX}{dead.pid}-a", tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-b",
                         tmp_path / f"{SCRATCH_PREFIX}x-c")
    for d in (gone, live, other):
        d.mkdir()
        (d / "original.tkb").write_bytes(b"x")
    assert sweep_scratch(tmp_path) == [gone]
    assert not gone.exists() and live.exists() and other.exists()


def test_an_output_named_after_a_device_or_pipe_never_replaces_it(tmp_path):
    """`-o /dev/null` once put a regular file in /dev/null's place (a rename over it, as root); a name that holds
    anything but a regular file or a link is refused and left as it is."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path):
        with pytest.raises(OSError, match="not a regular file"):
            write_atomic(target, b"x")
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
