"""Where a recovered run's bundle goes (signing/recovery.py `_out`): where it was meant to go, unless that is a
scratch directory the dead holder made for itself, which the next sweep removes with the bundle in it (a batch
worker killed mid-rerun: its rerun was written in its own `tkbox-batch-<pid>-...` directory)."""

from __future__ import annotations

from tkbox_nb.signing.recovery import _out
from tkbox_nb.signing.signer import MachineSigner


def test_a_recovered_bundle_goes_where_it_was_meant_to_but_never_into_the_dead_holder_s_scratch(tmp_path):
    (tmp_path / "home").mkdir(mode=0o700)
    signer = MachineSigner(tmp_path / "home")
    kept = tmp_path / "notebook" / ".tkbox" / "runs"
    kept.mkdir(parents=True)
    assert _out(signer, "run1", kept / "a.tkb", 4242) == kept / "a.tkb"
    scratch = tmp_path / "tkbox-batch-4242-k2j_x9"
    scratch.mkdir()
    assert _out(signer, "run1", scratch / "rerun.tkb", 4242) == signer.home / "bundles" / "run1.tkb"
    other = tmp_path / "tkbox-batch-4243-k2j_x9"  # another process's scratch: not this holder's own
    other.mkdir()
    assert _out(signer, "run1", other / "rerun.tkb", 4242) == other / "rerun.tkb"
    assert _out(signer, "run2", tmp_path / "gone" / "x.tkb", 4242) == signer.home / "bundles" / "run2.tkb"
    assert _out(signer, "run1", scratch / "rerun.tkb", 42) == scratch / "rerun.tkb"  # 4242 is not pid 42's
