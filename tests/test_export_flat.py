"""Exporting one run reads that run, not the machine signer's whole history (tkbox_nb/signing/store_view.py), and still
fails closed: a bundle equal to Tracekit's own export, a checkpoint that never comes refused in one line, and two
boxes stopping at once each with their own bundle (docs/bundle-format.md#export-cost, I86, I87)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import zipfile

import pytest
from conftest import VENV_BIN, record_run

from tkbox_nb.core.errors import SignerError
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.bundle.verify import verify_bundle

OTHER_RUNS = 240  # 3 records each: over two full tiles of 256 records, so the view reads tiles


def _register_many(signer, n: int) -> None:
    """`n` runs of another agent, registered and closed through the signer in bulk (one client), in batches under
    the signer's open-runs quota (a closing run counts until its run.final, at the signer's next tick)."""
    c = signer.client()
    try:
        for i in range(n):
            if i and i % 90 == 0:
                time.sleep(1.2)
            c.run(agent={"name": "bulk", "version": "0"}).close("bulk")
    finally:
        c.close()


def _tracekit_export(signer, run_id: str, note: str, out) -> None:
    """The same run exported by Tracekit's own FileReader, which indexes the whole store."""
    from tracekit.bundle_v2 import export
    from tracekit.storage.file import FileReader
    export(FileReader(str(signer.data_dir / "store")), "default", run_id, note, str(out),
           policy_dir=str(signer.data_dir / "policies"))


def _files(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def test_export_from_a_store_of_many_runs_returns_only_that_run_and_equals_tracekits(private_signer, tmp_path):
    signer = private_signer
    _register_many(signer, OTHER_RUNS // 2)
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    c = rec.decide("exec", "command", {"argv": ["true"]})
    _register_many(signer, OTHER_RUNS // 2)  # other runs between the run's records: the view reads past them
    rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"", "stderr": b""})
    rec.close("test done")
    out = rec.write_bundle(tmp_path / "one.tkb")

    assert len(list((signer.data_dir / "store" / "tiles" / "records" / "0").iterdir())) >= 2
    assert verify_bundle(out, signer.trust_path).valid
    run = open_run(out)
    records = [r for n, b in _files(out).items() if n.startswith("runs/") for r in b.splitlines()]
    assert run.run_id == rec.run_id and records
    assert all(f'"run_id":"{rec.run_id}"'.encode() in r for r in records)  # none of the other runs' records
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(out), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True)
    assert "Integrity: VERIFIED." in r.stdout, r.stdout + r.stderr

    mine, theirs = tmp_path / "mine.zip", tmp_path / "theirs.zip"
    signer.export(rec.run_id, mine)
    note = next(b for n, b in _files(mine).items() if n.startswith("checkpoints/")).decode()
    _tracekit_export(signer, rec.run_id, note, theirs)
    assert _files(mine) == _files(theirs)  # the same bundle, file for file: records, key records and proofs


def test_an_export_reads_the_key_index_again_after_it_is_deleted(private_signer, tmp_path):
    """The index beside the store is a cache: without it the next export rebuilds it and the bundle still verifies."""
    out = record_run(private_signer, tmp_path / "a.tkb")
    index = private_signer.dir / "export-index.json"
    assert index.exists()
    index.unlink()
    again = record_run(private_signer, tmp_path / "b.tkb")
    assert verify_bundle(again, private_signer.trust_path).valid and verify_bundle(out, private_signer.trust_path).valid
    assert index.exists()


def test_a_checkpoint_that_does_not_come_within_the_deadline_fails_closed_in_one_line(private_signer, tmp_path):
    rec = RunRecorder(private_signer, Policy.default(),
                      {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
    rec.decide("exec", "command", {"argv": ["true"]})
    pid = private_signer.pid()
    os.kill(pid, signal.SIGSTOP)  # a stalled signer: no checkpoint will come
    try:
        with pytest.raises(SignerError) as e:
            private_signer.export(rec.run_id, tmp_path / "x.zip", wait_final_s=0.5, final=False)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "no checkpointed final record after 0.5s" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x.zip").exists()


def test_an_export_of_a_run_the_store_does_not_hold_fails_closed(private_signer, tmp_path):
    with pytest.raises(SignerError, match="has no run nope"):
        private_signer.export("nope", tmp_path / "x.zip", wait_final_s=0.2)
    assert not (tmp_path / "x.zip").exists()


def test_two_boxes_stopping_at_once_each_get_their_own_bundle(signer, tmp_path):
    from tkbox_nb.box.box import Box
    boxes = [Box(backend="bwrap", bundle_path=tmp_path / f"{i}.tkb").start() for i in range(2)]
    for b in boxes:
        assert b.run(["true"]).exit_code == 0
    both = threading.Barrier(2)
    errors = []

    def stop(b):
        both.wait()
        try:
            b.stop()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stop, args=(b,)) for b in boxes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    runs = [open_run(tmp_path / f"{i}.tkb") for i in range(2)]
    assert runs[0].run_id != runs[1].run_id
    assert {r.run_id for r in runs} == {b.recorder.run_id for b in boxes}
    for i in range(2):
        assert verify_bundle(tmp_path / f"{i}.tkb", signer.trust_path).valid


def test_the_log_is_read_back_whole_lines_only_past_a_torn_line_longer_than_a_chunk(tmp_path):
    """The writer may be mid-append: a torn last line, even one longer than the view's read chunk, is never a record,
    and every complete line comes back whole with its offset, last first."""
    from tkbox_nb.signing.store_view import CHUNK, StoreView
    lines = [b'{"n":%d,"pad":"%s"}' % (i, b"x" * (i * 7919 % (CHUNK + 5000))) for i in range(40)]
    data = b"".join(line + b"\n" for line in lines) + b'{"torn":"' + b"y" * (CHUNK * 2 + 17)
    log = tmp_path / "records.jsonl"
    log.write_bytes(data)
    fd = os.open(log, os.O_RDONLY)
    try:
        back = list(StoreView._lines_back(None, fd, len(data)))
        assert StoreView._complete_end(fd, len(data)) == len(data) - len(b'{"torn":"') - (CHUNK * 2 + 17)
    finally:
        os.close(fd)
    assert [line for _, line in back] == lines[::-1]
    assert all(data[off:off + len(line)] == line for off, line in back)
