"""docs/threat-model.md names tests for each invariant: each invariant names at least one, and each named one exists
(a test function of that name in that file, or a whole file of tests)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = re.compile(r"`((?:tests/[\w/]+\.py)?::\w+|tests/[\w/]+\.py)`")


def invariants(root: Path = ROOT) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """(invariant id, [(test file, test name or None for the whole file)]) for each row of the table; a `::name`
    belongs to the file named last before it in the same row."""
    rows = []
    for line in (root / "docs" / "threat-model.md").read_text().splitlines():
        m = re.match(r"\| *(I\d+) *\|", line)
        if not m:
            continue
        tests_cell = line.rstrip().rstrip("|").rsplit("|", 1)[1]
        refs, module = [], None
        for ref in REF.findall(tests_cell):
            if ref.startswith("tests/"):
                module, _, name = ref.partition("::")
                refs.append((module, name or None))
            else:
                refs.append((module or "(no file named before it)", ref.lstrip(":")))
        rows.append((m.group(1), refs))
    return rows


def problems(root: Path = ROOT) -> list[str]:
    out = []
    for invariant, refs in invariants(root):
        if not refs:
            out.append(f"{invariant} names no test")
        for module, name in refs:
            path = root / module
            if not path.is_file():
                out.append(f"{invariant}: {module} does not exist")
            elif name is None and not re.search(r"^def test_\w+\(", path.read_text(), re.M):
                out.append(f"{invariant}: {module} holds no test")
            elif name is not None and not re.search(rf"^\s*def {name}\(", path.read_text(), re.M):
                out.append(f"{invariant}: {module}::{name} is named in the threat model but missing")
    return out


def test_every_invariant_names_a_test_and_every_named_test_exists():
    ids = [int(i[1:]) for i, _ in invariants()]
    # in order and each once; ids may skip (engineers working at once are given disjoint ranges of new ids)
    assert len(ids) >= 50 and ids[0] == 1 and all(a < b for a, b in zip(ids, ids[1:]))
    assert problems() == []


def test_the_check_sees_a_missing_test_and_a_row_without_one(tmp_path):
    """The check itself, on a made-up table: a name its file does not define, a row naming no test."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "docs" / "threat-model.md").write_text(
        "| I1 | a | b | `tests/test_x.py::test_here`, `::test_gone` |\n| I2 | a | b | nothing named |\n"
        "| I3 | a | b | every test in `tests/test_x.py`, `tests/test_y.py` |\n")
    assert problems(tmp_path) == ["I1: tests/test_x.py::test_gone is named in the threat model but missing",
                                  "I2 names no test", "I3: tests/test_y.py does not exist"]
