"""nbval's conventions in `tkbox audit`: a cell marked to have its output ignored, or to be skipped, has only its code
compared, as `pytest --nbval` would not compare its outputs.

Why: notebooks already tested with nbval mark their volatile cells so; an audit that ignored the marks called those
notebooks' honest reruns different. The marks are nbval's own, read as nbval reads them: a comment line of the
cell's code (`# NBVAL_IGNORE_OUTPUT`, `# NBVAL_SKIP`, and nbval's older `# PYTEST_VALIDATE_IGNORE_OUTPUT`) or a cell
tag (`nbval-ignore-output`, `nbval-skip`). The exec door records a cell's code, not its notebook metadata (a Jupyter
frontend does not send a cell's tags with its execute request), so in a bundle the comments are what is found; a tag
is honoured where a cell's recorded arguments carry `tags`. A mark in either run's cell applies to the pair.

Pure: reads the code's lines (bounded by MAX_SCAN characters: a mark is at the top of a cell, as nbval users write it).
"""

from __future__ import annotations

from typing import Any

IGNORE, SKIP = "nbval-ignore-output", "nbval-skip"
COMMENTS = {"NBVAL_IGNORE_OUTPUT": IGNORE, "PYTEST_VALIDATE_IGNORE_OUTPUT": IGNORE, "NBVAL_SKIP": SKIP}
TAGS = {IGNORE: IGNORE, SKIP: SKIP}
MAX_SCAN = 1 << 16


def marks(code: str, tags: Any = None) -> frozenset[str]:
    """The nbval marks of one cell: from its code's comment lines and its tags (when recorded)."""
    found = set()
    for line in code[:MAX_SCAN].splitlines():
        line = line.strip()
        if line.startswith("#"):
            mark = COMMENTS.get(line.lstrip("#").strip())
            if mark:
                found.add(mark)
    if isinstance(tags, list):
        found.update(TAGS[t] for t in tags if isinstance(t, str) and t in TAGS)
    return frozenset(found)


def describe(counts: dict[str, tuple[int, int]]) -> str:
    """The coverage line's part for the marks: cells per mark in A/B, or '' when none."""
    parts = [f"{mark} {na}/{nb}" for mark, (na, nb) in counts.items() if na or nb]
    return ("nbval marks honoured (cells in A/B, outputs not compared): " + ", ".join(parts)) if parts else ""
