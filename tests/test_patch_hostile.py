"""The patch door against a hostile box, in its pure parts: a rename's source, a rename onto itself, an add over a
file the box started with, and modes (a review's findings; the end-to-end side is in tests/e2e/test_patch.py)."""

from __future__ import annotations

import os
import subprocess

from tkbox_nb.rules import patch_rules as rules
from tkbox_nb.rules.patch_diff import DiffFile, render
from tkbox_nb.policy import Policy
from tkbox_nb.doors.workspace_writer import FileChange, apply_changes, sha256_file_digest

POLICY = Policy.from_toml('[patch]\nallow = ["src/**"]\ndeny = ["secret/**"]\n')
BASE = sha256_file_digest(b"x")


def decide(path, op="rename", policy=POLICY, **extra):
    facts = dict(dict(door="patch", kind="file", path=path, op=op, type="file", mode=0o644, size=1, index=0,
                      total_before=0, binary=False, base=None, rules=2), **extra)
    v = policy.decide(facts)
    return v.verdict, v.rule, v.reason


def test_a_rename_passes_only_where_deleting_its_source_would():
    for source, rule, why in [
            (".github/workflows/ci.yml", "patch.deny_default[0]", "the rename source .github/workflows/ci.yml matches"),
            (".env", "patch.deny_default[2]", "the rename source .env matches **/.env"),
            ("secret/keep.txt", "patch.deny[0]", "the rename source secret/keep.txt matches secret/**"),
            ("README", "patch.allow", "the rename source README is not in [patch] allow")]:
        verdict, got, reason = decide("src/x", **{"from": source, "from_base": BASE})
        assert (verdict, got) == ("deny", rule) and reason.startswith(why), (source, got, reason)
        # each is the rule that refuses the delete of the same source
        assert decide(source, op="delete", base=BASE)[1] == rule
    assert decide("src/y", **{"from": "src/x", "from_base": BASE})[:2] == ("allow", "patch.allow[0]")
    # the target's own refusal is named as the target's
    assert decide("secret/y", **{"from": "src/x", "from_base": BASE})[2] == "secret/y matches secret/**"
    # one source, one rename (the door states which target took it)
    assert decide("src/y", **{"from": "src/x", "from_base": BASE, "from_taken": "src/z"}) == (
        "deny", "patch.from", "the rename source went to 'src/z' already")
    # a source that is not a regular file the box started with (a symlink, nothing) is no rename
    assert decide("src/y", **{"from": "src/x", "from_base": None})[:2] == ("deny", "patch.from")


def test_a_rename_onto_itself_is_refused_in_any_spelling():
    for source in ("src/a.txt", "src/A.TXT", "src/a\u0301.txt"):
        target = "src/a.txt" if source != "src/a\u0301.txt" else "src/\u00e1.txt"
        verdict, rule, why = decide(target, **{"from": source, "from_base": BASE})
        assert (verdict, rule, why) == ("deny", "patch.from", "the rename source is its own target")


def test_an_add_or_rename_onto_a_file_the_box_started_with_is_refused():
    assert decide("src/a", op="add")[0] == "allow"
    assert decide("src/a", op="add", base=BASE)[:2] == ("deny", "patch.overwrite")
    assert decide("src/a", base=BASE, **{"from": "src/b", "from_base": BASE})[:2] == ("deny", "patch.overwrite")
    assert decide("src/a", op="modify", base=BASE)[0] == "allow"


def test_statements_from_before_the_rules_fact_are_decided_as_then():
    """A bundle made before the door stated `rules` still verifies: its decisions re-derive as they were made."""
    old = dict(door="patch", kind="file", op="rename", type="file", mode=0o644, size=1, index=0, total_before=0,
               binary=False, base=BASE, from_base=BASE)
    everything = Policy.from_toml("[patch]\n")
    assert everything.decide(dict(old, path="src/ci.yml", **{"from": ".github/workflows/ci.yml"})).verdict == "allow"
    assert everything.decide(dict(old, path="data.txt", **{"from": "data.txt"})).verdict == "allow"
    assert everything.decide(dict(old, op="add", path="data.txt")).verdict == "allow"
    assert POLICY.decide(dict(old, path="src/x", **{"from": "README"})).rule == "patch.allow[0]"


def test_the_writer_never_unlinks_a_path_the_patch_writes(tmp_path):
    """A rename onto itself (allowed under the rules of a bundle made before they refused it) leaves the file."""
    (tmp_path / "data.txt").write_bytes(b"precious\n")
    base = sha256_file_digest(b"precious\n")
    [o] = apply_changes(str(tmp_path), [FileChange("data.txt", "rename", b"precious\n", 0o644, base, "data.txt", base)])
    assert o.applied and (tmp_path / "data.txt").read_bytes() == b"precious\n"
    [o] = apply_changes(str(tmp_path), [FileChange("DATA.txt", "rename", b"new\n", 0o644, None, "data.txt", base)])
    assert (tmp_path / "data.txt").read_bytes() == b"precious\n"  # written under another case: the source stays
    (tmp_path / "b").write_bytes(b"B")
    out = apply_changes(str(tmp_path), [FileChange("a", "rename", b"B", 0o644, None, "b", sha256_file_digest(b"B")),
                                        FileChange("b", "modify", b"B2", 0o644, sha256_file_digest(b"B"))])
    assert (tmp_path / "b").read_bytes() == b"B2" and (tmp_path / "a").read_bytes() == b"B", out


def test_a_modified_file_keeps_its_host_mode_but_for_the_execute_bits_the_box_changed(tmp_path):
    f = tmp_path / "credentials.yml"
    for host, old, box, want in [(0o600, 0o600, 0o600, 0o600),   # content only: 0600 stays 0600
                                 (0o600, 0o644, 0o644, 0o600),   # the box's 0644 is no reason to widen it
                                 (0o600, 0o600, 0o755, 0o700),   # +x only where the host file is readable
                                 (0o750, 0o750, 0o640, 0o640),   # -x
                                 (0o640, 0o644, 0o755, 0o750),
                                 (0o600, None, 0o644, 0o600),    # a statement without old_mode
                                 (0o600, None, 0o755, 0o700)]:
        f.write_bytes(b"a")
        os.chmod(f, host)
        [o] = apply_changes(str(tmp_path), [FileChange(f.name, "modify", b"b", box, sha256_file_digest(b"a"),
                                                       old_mode=old)])
        assert o.applied and f.stat().st_mode & 0o7777 == want, (oct(host), oct(box), oct(f.stat().st_mode))
    # a mode change alone (the same content) is applied too
    f.write_bytes(b"a")
    os.chmod(f, 0o644)
    [o] = apply_changes(str(tmp_path), [FileChange(f.name, "modify", b"a", 0o755, sha256_file_digest(b"a"),
                                                   old_mode=0o644)])
    assert o.applied and f.stat().st_mode & 0o777 == 0o755
    # a renamed file keeps its source's host mode
    (tmp_path / "key").write_bytes(b"k")
    os.chmod(tmp_path / "key", 0o600)
    apply_changes(str(tmp_path), [FileChange("moved", "rename", b"k", 0o644, None, "key", sha256_file_digest(b"k"),
                                             0o644)])
    assert (tmp_path / "moved").stat().st_mode & 0o7777 == 0o600 and not (tmp_path / "key").exists()


def test_a_new_file_is_0644_or_0755_less_the_host_umask(tmp_path):
    from tkbox_nb.doors.workspace_writer import host_umask
    mask = os.umask(0o027)
    try:
        assert host_umask() == 0o027
        out = apply_changes(str(tmp_path), [FileChange("a", "add", b"a", 0o666, None),
                                            FileChange("b", "add", b"b", 0o4777, None)])
    finally:
        os.umask(mask)
    assert all(o.applied for o in out)
    assert [(tmp_path / n).stat().st_mode & 0o7777 for n in "ab"] == [0o640, 0o750]


def test_the_diff_shows_every_change_of_mode(tmp_path):
    assert rules.planned_mode("modify", 0o644, 0o600) == 0o600
    assert rules.planned_mode("modify", 0o755, 0o600) == 0o700
    assert rules.planned_mode("add", 0o600, None) == 0o644
    diff = render([DiffFile("c.yml", "modify", b"a\n", b"a\nb\n", rules.planned_mode("modify", 0o644, 0o600), 0o600),
                   DiffFile("run", "modify", b"x\n", b"x\n", rules.planned_mode("modify", 0o755, 0o600), 0o600),
                   DiffFile("gone", "delete", b"g\n", None, 0o600, 0o600)]).decode()
    assert "diff --git a/c.yml b/c.yml\n---" in diff  # 0600 before and after: no mode line, none hidden
    assert "diff --git a/run b/run\nold mode 100600\nnew mode 100700\n" in diff
    assert "deleted file mode 100600\n" in diff
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for name, data, mode in (("c.yml", b"a\n", 0o600), ("run", b"x\n", 0o600), ("gone", b"g\n", 0o600)):
        (tmp_path / name).write_bytes(data)
        os.chmod(tmp_path / name, mode)
    (tmp_path / "p.diff").write_text(diff)
    r = subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.access(tmp_path / "run", os.X_OK) and not (tmp_path / "gone").exists()


def test_a_long_multibyte_name_is_written_and_the_rest_of_the_patch_too(tmp_path):
    """A legal name of 255 bytes in 2-byte characters: its temporary name stays under the filesystem's limit, so the
    patch applies whole (it once failed: the temporary took 200 characters of the name, 400 bytes)."""
    name = "\u00e9" * 125 + ".txt"  # 254 bytes
    assert rules.path_problem(name) is None and len(name.encode()) == 254
    apply_changes(str(tmp_path), [FileChange("good.txt", "add", b"hello\n", 0o644, None),
                                  FileChange(name, "add", b"x\n", 0o644, None)])
    assert sorted(os.listdir(tmp_path)) == sorted(["good.txt", name])
    assert (tmp_path / name).read_bytes() == b"x\n"
