"""The pure parts of audit tolerances and nbval marks: what a number is, what stays exact, and a hostile output's
bound (tolerance.numbers_equal, conventions.marks)."""

from __future__ import annotations

import time

import pytest

from tkbox_nb.audit.conventions import IGNORE, SKIP, marks
from tkbox_nb.audit.tolerance import Tolerance, numbers_equal
from tkbox_nb.core.errors import TkboxError


@pytest.mark.parametrize("a,b,rtol,atol,equal", [
    ("took 0.022 s", "took 0.023 s", 0.1, 0, True),
    ("took 0.022 s", "took 0.023 s", 0.01, 0, False),
    ("steps 3", "steps 4", 0.5, 10, False),  # integers exactly
    ("loss 1.0", "loss 1", 0.5, 10, False),  # a float is not an integer
    ("<td>0.300000</td>", "<td>0.300001</td>", 1e-5, 0, True),
    ("<td>0.3</td>", "<th>0.3</th>", 1, 1, False),  # structure exactly
    ("a 1.5\nb", "a 1.5\nc", 1, 1, False),
    ("x1.5", "x1.6", 1, 1, False),  # inside a word: text
    ("sha256:1e5f", "sha256:1e6f", 1, 1, False),
    ("v 1.2.3", "v 1.2.4", 1, 1, False),  # a dotted version is text
    ("0  1.5\n1  2.5", "0  1.50001\n1  2.5", 1e-3, 0, True),  # a column wider by its number
    ("1e-3", "1.0000001e-3", 1e-6, 0, True),
    ("1.5 2.5", "1.5", 1, 1, False),
])
def test_numbers_compare_within_the_tolerance_and_nothing_else(a, b, rtol, atol, equal):
    assert numbers_equal(a, b, rtol, atol) is equal


def test_a_hostile_output_is_compared_in_linear_time():
    for text in ("1." * 2_000_000, "1.5 " * 1_000_000, "9" * 4_000_000, "1e" * 2_000_000):
        start = time.monotonic()
        assert not numbers_equal(text, "0" + text[1:], 1e-9, 0)
        assert not numbers_equal(text, text[:-1] + "x", 1e-9, 0)
        assert time.monotonic() - start < 30, text[:8]


@pytest.mark.parametrize("rtol,atol,image", [(-1, 0, None), (float("nan"), 0, None), (0, float("inf"), None),
                                             (0, 0, 256), (0, 0, -0.5)])
def test_a_bad_tolerance_is_one_line(rtol, atol, image):
    with pytest.raises(TkboxError, match="a tolerance is a finite number, 0 or more"):
        Tolerance(rtol, atol, image)


def test_nbval_marks_are_read_as_nbval_reads_them():
    assert marks("# NBVAL_IGNORE_OUTPUT\nprint(1)") == {IGNORE}
    assert marks("x = 1\n  #  NBVAL_SKIP  \n") == {SKIP}
    assert marks("# PYTEST_VALIDATE_IGNORE_OUTPUT") == {IGNORE}
    assert marks("print('# NBVAL_SKIP')") == frozenset()  # not a comment line
    assert marks("x = 1", ["nbval-skip", "other", 3]) == {SKIP}


def test_a_batch_refuses_a_bad_tolerance_before_any_rerun(tmp_path):
    from tkbox_nb.audit.batch import run_batch
    with pytest.raises(TkboxError, match="--rtol -1.0: a tolerance is a finite number"):
        run_batch([str(tmp_path / "a.tkb")], tmp_path / "out", tolerance={"rtol": -1.0})


def test_cutting_the_common_start_and_end_never_changes_the_answer(monkeypatch):
    """numbers_equal compares only the middle of two values (tolerance._middle): on many small random pairs,
    with the cut window made tiny so it cuts everywhere it may, its answer is the uncut comparison's."""
    import random

    import tkbox_nb.audit.tolerance as tol
    rng = random.Random(7)
    pieces = ["1", "2", ".", " ", "  ", "\n", "e", "-", "a", "1.5", "0.30000000000000004", "\t", "1.5000001"]
    pairs = []
    for _ in range(4000):
        x = [rng.choice(pieces) for _ in range(rng.randint(0, 24))]
        y = list(x)
        for _ in range(rng.randint(1, 3)):
            if y:
                y[rng.randrange(len(y))] = rng.choice(pieces)
        pairs.append(("".join(x), "".join(y)))
    monkeypatch.setattr(tol, "CHUNK", 3)
    cut = [tol.numbers_equal(x, y, r, 0) for x, y in pairs for r in (0, 1e-3)]
    monkeypatch.setattr(tol, "_middle", lambda x, y: (x, y))
    assert cut == [tol.numbers_equal(x, y, r, 0) for x, y in pairs for r in (0, 1e-3)]
