"""Which number a rerun gives each cell (audit/replay.rerun_counts): the original's, read from its signed result,
which is a value the original box returned. A real signed run (a real signer and recorder, no box behind it) whose
cells state hostile numbers: only a positive int below 2**31 above every number taken before is passed on."""

from __future__ import annotations

from tkbox_nb.audit.replay import _steps, rerun_counts
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder


def test_a_rerun_passes_on_only_positive_increasing_int_counts_from_a_hostile_bundle(signer, tmp_path):
    """A bundle could state 2**31 - 1 (the box's setter then padded about two billion history entries in the
    rerun's box), a number lower than one before it, a bool, a string, a float or a negative one."""
    rec = RunRecorder(signer, Policy.from_toml("[exec]\ncells = true\n"), {"backend": "bwrap", "isolation": "none",
                                                                            "image_digest": "none"})
    rec.open()
    stated = [1, 3, 2, 3, True, "7", 7.0, -1, 0, 2 ** 31, None, [9], 9, 2 ** 31 - 1, 2 ** 31 - 1, 10]
    for i, n in enumerate(stated):
        c = rec.decide("exec", "cell", {}, {"code": b"x = %d\n" % i})
        rec.complete(c, "ok", {} if n is None else {"execution_count": n}, {"outputs": b"[]"})
    rec.close("test done")
    run = open_run(rec.write_bundle(tmp_path / "h.tkb"))
    counts = rerun_counts(_steps(run))
    cells = [c.seq for c in run.crossings() if c.door == "exec"]
    assert list(counts) == cells
    assert list(counts.values()) == [1, 3, None, None, None, None, None, None, None, None, None, None, 9,
                                     2 ** 31 - 1, None, None]
