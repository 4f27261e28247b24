"""[workspace] (policy/workspace.py) and the refusal lines (rules/refusal_notices.py): pure rules, checked
without a box."""

from __future__ import annotations

import pytest

from tkbox_nb.rules.refusal_notices import Shown, refusal_line
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy
from tkbox_nb.core.tree_digest import excluded
from tkbox_nb.policy.workspace import DEFAULT_EXCLUDE


@pytest.mark.parametrize("rel, pattern", [
    (".git", ".git"), (".git/config", ".git"), ("sub/.git/HEAD", ".git"), ("a/node_modules/x/y.js", "node_modules"),
    ("pkg/__pycache__/m.pyc", "__pycache__"), ("runs/old.tkb", "*.tkb"), (".tkbox/runs/a.tkb", ".tkbox"),
    ("venv/bin/python", "venv")])
def test_the_default_excludes_leave_out_what_a_user_expects_at_any_depth(rel, pattern):
    assert excluded(DEFAULT_EXCLUDE, rel) == pattern


@pytest.mark.parametrize("rel", ["data.csv", "src/venvs.py", "git/notes", "my.tkb.txt", "notebook.ipynb"])
def test_the_default_excludes_keep_everything_else(rel):
    assert excluded(DEFAULT_EXCLUDE, rel) is None


def test_a_pattern_with_a_slash_matches_from_the_top_and_takes_what_is_under_it():
    assert excluded(["data/raw"], "data/raw/big.bin") == "data/raw"
    assert excluded(["data/raw"], "other/data/raw/x") is None
    assert excluded(["data/*.parquet"], "data/a.parquet") == "data/*.parquet"


@pytest.mark.parametrize("toml, error", [
    ("[workspace]\nmax_mib = 0\n", "workspace.max_mib must be positive"),
    ("[workspace]\nexclude = \".git\"\n", "workspace.exclude must be a list, not str"),
    ("[workspace]\nsize = 3\n", "unknown key workspace.size"),
])
def test_a_bad_workspace_section_is_one_line_naming_the_key(toml, error):
    with pytest.raises(PolicyError, match=error.replace(".", r"\.")):
        Policy.from_toml(toml, "p.toml")


def test_a_policy_from_a_bundle_may_not_name_a_host_folder():
    assert Policy.from_toml('[workspace]\npath = "/home/me"\n').host_reads() == "[workspace] path"
    assert Policy.from_toml('[workspace]\npath = "none"\n').host_reads() is None


def test_a_refusal_line_escapes_what_the_box_named_and_names_rule_and_record():
    line = refusal_line("egress", "connect", {"host": "evil\x1b[2J\n[tkbox] ok", "port": 443, "rule": "egress.allow",
                                              "verdict_reason": "evil:443 is not in [egress] allow"}, 7)
    assert "\n" not in line and "\x1b" not in line and "\\x1b" in line
    assert line.endswith("(rule egress.allow; signed, record 7 of the run)")
    assert refusal_line("exec", "cell", {}, 1) is None and refusal_line("host", "magic", {}, 1) is None


def test_a_cell_shows_five_refusals_then_one_line_then_none():
    shown = Shown()
    out = [shown.admit("cell-1", f"r{i}") for i in range(8)]
    assert out[:5] == ["r0", "r1", "r2", "r3", "r4"] and "counted in the run" in out[5] and out[6:] == [None, None]
    assert shown.admit("cell-2", "x") == "x"
