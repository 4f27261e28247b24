"""Every bundle the writer makes reads back: an honest run whose output deflates past the reader's zip-bomb rule (one
character repeated, a training loop's equal progress lines) is written with that entry stored, and both `tkbox verify`
and `tracekit verify` accept it, up to the output limit and the entry and expansion limits; a real bomb is still
refused (tests/test_bundle_bad_input.py)."""

from __future__ import annotations

import io
import os
import subprocess
import zipfile

from conftest import VENV_BIN, run_cli

from tkbox_nb.bundle.archive import MAX_ENTRY, MAX_RATIO, read_bundle_file, read_entries, write_zip


def run_and_verify(signer, tmp_path, code: str, expect_stdout: int) -> dict[str, bytes]:
    out = tmp_path / "run.tkb"
    r = subprocess.run([str(VENV_BIN / "tkbox"), "run", "--backend", "bwrap", "-o", str(out), "--",
                        "python3", "-c", code], capture_output=True, timeout=300)
    assert r.returncode == 0 and len(r.stdout) == expect_stdout, (r.returncode, len(r.stdout), r.stderr[-500:])
    v = run_cli("verify", str(out), "--trust", str(signer.trust_path))
    assert v.returncode == 0 and v.stdout.startswith("VALID"), v.stdout + v.stderr
    t = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(out), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stdout + t.stderr
    with zipfile.ZipFile(out) as z:  # what deflated past half the bomb ratio was stored
        for info in z.infolist():
            assert info.file_size <= (MAX_RATIO // 2) * max(info.compress_size, 1), (info.filename, info.file_size)
    return read_bundle_file(out)


def test_a_run_printing_2_mib_of_one_character_verifies_with_both_verifiers(signer, tmp_path):
    """Once written deflated at 966x, which `tkbox verify` then called a zip bomb (exit 2)."""
    files = run_and_verify(signer, tmp_path, "import sys; sys.stdout.write('A' * (2 << 20))", 2 << 20)
    assert any(n.startswith("box/content-") and len(b) > 2 << 20 for n, b in files.items())


def test_a_run_printing_200000_equal_progress_lines_verifies_with_both_verifiers(signer, tmp_path):
    line = "epoch 1 step done loss=0.2500\n"
    run_and_verify(signer, tmp_path, f"import sys; sys.stdout.write({line!r} * 200000)", len(line) * 200000)


def test_a_run_at_the_output_limit_of_one_character_verifies_with_both_verifiers(signer, tmp_path):
    """[exec] max_output_bytes is 16 MiB: all of it one character, its content entry about 21 MiB."""
    run_and_verify(signer, tmp_path, "import sys; sys.stdout.write('A' * (16 << 20))", 16 << 20)


def test_entries_at_the_entry_and_expansion_limits_are_written_so_the_reader_reads_them(tmp_path):
    """An entry of MAX_ENTRY zeros, and 120 entries of just under 1 MiB that together deflate 1000x (the shape of
    test_many_small_entries_that_expand_together_are_a_zip_bomb), come back whole from what write_zip writes."""
    files = {"manifest.json": b"{}", "box/zeros": b"\0" * MAX_ENTRY}
    files.update({f"box/part-{i:04d}": b"0.0," * ((1 << 18) - 1) + b"\n" for i in range(120)})
    out = tmp_path / "limits.tkb"
    write_zip(out, files)
    assert read_entries(out.read_bytes()) == files
    mixed = {"a": b"x" * (1 << 20), "b": os.urandom(1 << 16), "c": b"text " * 100}  # others stay deflated
    write_zip(out, mixed)
    with zipfile.ZipFile(io.BytesIO(out.read_bytes())) as z:
        assert [i.compress_type for i in z.infolist()] == [zipfile.ZIP_STORED] + [zipfile.ZIP_DEFLATED] * 2
    assert read_entries(out.read_bytes()) == mixed
