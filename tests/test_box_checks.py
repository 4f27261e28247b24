"""The box layer of `tkbox verify` is one function per invariant (bundle/box_checks.py): each says which invariant of
docs/threat-model.md it serves, so a reader goes from a check to what it holds and back."""

import re
from pathlib import Path

from tkbox_nb.bundle.box_checks import BOX_CHECKS

ROOT = Path(__file__).resolve().parent.parent


def test_each_box_check_names_the_invariants_it_serves_and_they_exist():
    table = set(re.findall(r"^\| *(I\d+) *\|", (ROOT / "docs" / "threat-model.md").read_text(), re.M))
    assert len(BOX_CHECKS) == len(set(BOX_CHECKS)) >= 10
    for check in BOX_CHECKS:
        doc = (check.__doc__ or "").strip()
        ids = re.match(r"((?:I\d+, )*I\d+): \S", doc)
        assert ids, f"{check.__name__}: its docstring does not start with the invariant ids it serves"
        missing = set(ids.group(1).split(", ")) - table
        assert not missing, f"{check.__name__} names {sorted(missing)}, not in docs/threat-model.md"
