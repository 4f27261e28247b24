"""The table of doors (rules/door_table.py) is the one place a door is listed.

Adding a door to the table is enough for each part of tkbox that names doors to know it: a real recorder signs its
crossings as its tool on a real signer running the pack made from that table, the bundle reads them back under its
name, the run view gives it a row, the audit compares it under its category, and the policy's dispatch refuses, in
one line, a table door it has no decide function for. And no module of the package spells a door's name where it
means the door, nor a door's tool's name at all: the scan below reads the source as tests/test_door_context.py does.
"""

from __future__ import annotations

import ast
import hashlib
import shutil
from pathlib import Path

import pytest
from conftest import short_tmp

from tkbox_nb.audit import compare
from tkbox_nb.audit.compare import coverage, facts
from tkbox_nb.bundle import read_back
from tkbox_nb.bundle.read_back import open_run
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.cli.main import build_parser
from tkbox_nb.jupyter import run_view
from tkbox_nb.policy import Policy
from tkbox_nb.policy.base import Verdict
from tkbox_nb.policy.core import DECIDERS, check_deciders
from tkbox_nb.policy.refusals import COUNTED_DOORS
from tkbox_nb.rules import door_table
from tkbox_nb.rules.door_table import PACKAGES, TABLE, Counted, Door, door_of_tool, names, tool_of, tools
from tkbox_nb.signing.recorder import RunRecorder
from tkbox_nb.signing.signer import BOX_PACK, MachineSigner, box_pack

NOTARY = Door("notary", "box.notary", "notary", "notary", "notary", (Counted("notarised files"),),
              ("name", "version"), capped=True)
EXTENDED = (*TABLE, NOTARY)
BOX_FACTS = {"backend": "none", "isolation": "none", "image_digest": "none"}
PACKAGE_ROOT = Path(door_table.__file__).resolve().parent.parent

# the text every bundle since the signer's own address rules covered the package door is signed under: the pack
# before it, e67ea34a... (the literal tkbox_nb/signing/signer.py held before the table, with `box.packages` added;
# before that 6d8e7330...), named the egress tool only in TKB-ALWAYS-REFUSED and TKB-METADATA-ADDR; those two now
# name the package door's tool too, and TKB-METADATA-ADDRS and TKB-LOCAL-NAME judge its lookup's addresses and its
# host's name. Then (f96f8226...) TKB-METADATA-ADDR(S) missed IPv6 link-local (fe80::/10) and the IPv4-compatible,
# NAT64 and 6to4 forms of a loopback or link-local IPv4 address, and TKB-LOCAL-NAME a name with trailing dots
# (`localhost.`), which threat-model row I132 claimed the signer refuses: the pack now spells them (signer.EMBEDDED).
# Changed deliberately: a bundle keeps the compiled pack it was signed under, so older ones still verify
# (tests/test_environment.py verifies tests/data/workspace-tree1.tkb, made under an older pack).
PACK_SHA256 = "c201296d3a831811a0e146a392a05c8d8e7f9c1d007cdb577e394fada3c3c779"


def test_the_box_pack_of_today_s_doors_is_the_one_every_bundle_was_signed_under():
    assert hashlib.sha256(BOX_PACK.encode()).hexdigest() == PACK_SHA256
    assert box_pack() == BOX_PACK


def test_each_door_is_signed_as_it_always_was():
    said = {("box", "start"): "box.start", ("box", "stop"): "box.stop", ("exec", "cell"): "box.exec",
            ("exec", "command"): "box.exec", ("egress", "connect"): "box.connect", ("secrets", "swap"): "box.secret",
            ("model", "call"): "box.model", ("patch", "file"): "box.patch", ("host", "magic"): "box.host",
            ("packages", "file"): "box.packages", ("packages", "project"): "box.packages",
            ("nowhere", "x"): "box.nowhere"}
    assert {key: tool_of(*key) for key in said} == said
    assert names() == ("box", "exec", "egress", "secrets", "model", "patch", "host", "packages")
    assert read_back.DOOR_OF_TOOL == door_of_tool() and set(read_back.DOOR_OF_TOOL) == set(tools())
    assert COUNTED_DOORS == ("exec", "egress", "secrets", "model", "packages")
    assert run_view.DOORS == names()
    assert set(compare.DOORS) == {"exec cells", "exec commands", "egress", "secrets", "host magics", "model calls",
                                  "patch files", "package files"}


def test_a_door_added_to_the_table_is_signed_read_back_shown_and_compared(tmp_path):
    assert tool_of("notary", "install", EXTENDED) == "box.notary"
    assert door_of_tool(EXTENDED)["box.notary"] == "notary"
    assert "  'box.notary': app\n" in box_pack(EXTENDED) and "box.notary" not in BOX_PACK
    assert "notary" in door_table.capped(EXTENDED)

    home = short_tmp("tkd-")
    signer = MachineSigner(home)
    signer.pack = box_pack(EXTENDED)  # the signer runs the pack of the longer table
    try:
        signer.ensure()
        rec = RunRecorder(signer, Policy.default(), BOX_FACTS)
        rec.doors = EXTENDED
        rec.open()
        crossing = rec.decide("notary", "install", {"name": "numpy", "version": "2.1.0"})
        cell = rec.decide("exec", "cell", {}, {"code": b"print(1)\n"})
        rec.complete(cell, "ok", {"execution_count": 1}, {"outputs": b"[]"})
        rec.close("test done")
        bundle = rec.write_bundle(tmp_path / "notary.tkb")
        # signed as the door's tool; refused, as the policy has no decide function for it (door.unknown)
        assert crossing.tool == "box.notary" and crossing.decision_id is not None
        assert crossing.args["rule"] == "door.unknown"
        assert verify_bundle(bundle, signer.trust_path).valid
    finally:
        signer.stop()
        shutil.rmtree(home, ignore_errors=True)

    run = open_run(bundle)
    read = next(c for c in run.crossings() if c.tool == "box.notary")
    assert read.door == "notary"
    svg = run_view.timeline_svg(run.to_dataframe(), table=EXTENDED)
    assert ">notary</text>" in svg  # its row, named by its label
    assert ">notary</text>" not in run_view.timeline_svg(run.to_dataframe())  # the table of today has none

    compared = facts(run, [], EXTENDED)
    [item] = compared["notary"]
    assert item.seq == read.seq and '"numpy"' in item.fields["notary"][0] and "deny (door.unknown)" in \
        item.fields["notary"][0]
    assert coverage(compared, EXTENDED)["notarised files"] == 1
    assert "notary" not in facts(run, []) and "notarised files" not in coverage(facts(run, []))


def test_the_policy_refuses_a_table_door_it_cannot_decide_in_one_line():
    with pytest.raises(RuntimeError) as e:
        check_deciders(DECIDERS, EXTENDED)
    said = str(e.value)
    assert "\n" not in said
    assert "notary (no decide function)" in said and "notary (reads [notary], which no policy has)" in said
    with pytest.raises(RuntimeError, match=r"ghost \(decided but not in the door table\)"):
        check_deciders({**DECIDERS, "ghost": DECIDERS["exec"]}, TABLE)
    check_deciders(DECIDERS, TABLE)  # today's table and deciders agree (as the import of policy/core.py checked)
    decided = (*TABLE, Door("notary", "box.notary", None, "notary", "notary", (Counted("notary"),)))
    check_deciders({**DECIDERS, "notary": DECIDERS["host"]}, decided)
    assert Policy.default().decide({"door": "notary", "kind": "install"}).rule == "door.unknown"


class AllowingPolicy(Policy):
    """A box policy whose code is wrong: it allows every crossing. What the signer's own rules are for."""

    def decide(self, facts):
        return Verdict("allow", "wrong.allow")


PUBLIC = {"index": "https://pypi.example/simple/", "host": "pypi.example", "addresses": ["93.184.216.34"],
          "address": "93.184.216.34", "address_class": "ok", "source": "index", "files": 1}


@pytest.mark.parametrize("stated, rules", [
    ({"address_class": "always", "address": ""}, ["TKB-ALWAYS-REFUSED"]),  # the door's own classification
    ({"addresses": ["93.184.216.34", "169.254.169.254"]}, ["TKB-METADATA-ADDRS"]),  # one address of the lookup
    ({"addresses": ["127.0.0.1"], "address": "127.0.0.1"}, ["TKB-METADATA-ADDR", "TKB-METADATA-ADDRS"]),  # dialled
    ({"addresses": ["::1"], "address": ""}, ["TKB-METADATA-ADDRS"]),
    ({"host": "metadata.google.internal", "addresses": [], "address": ""}, ["TKB-LOCAL-NAME"]),  # never looked up
    ({"host": "pkgs.localhost"}, ["TKB-LOCAL-NAME"]),
    ({"host": "localhost."}, ["TKB-LOCAL-NAME"]),  # the fully-qualified spelling
    ({"host": "metadata.google.internal..", "addresses": [], "address": ""}, ["TKB-LOCAL-NAME"]),
    ({"addresses": ["93.184.216.34", "fe80::1"]}, ["TKB-METADATA-ADDRS"]),  # IPv6 link-local
    ({"addresses": ["febf::1"], "address": "febf::1"}, ["TKB-METADATA-ADDR", "TKB-METADATA-ADDRS"]),
    ({"addresses": ["::7f00:1"], "address": "::7f00:1"}, ["TKB-METADATA-ADDR", "TKB-METADATA-ADDRS"]),  # ::127.0.0.1
    ({"addresses": ["64:ff9b::a9fe:a9fe"]}, ["TKB-METADATA-ADDRS"]),  # NAT64 of the metadata address
    ({"addresses": ["2002:7f00::"], "address": "2002:7f00::"}, ["TKB-METADATA-ADDR", "TKB-METADATA-ADDRS"]),  # 6to4
])
def test_the_signer_refuses_a_package_host_no_box_may_reach_whatever_the_box_policy_says(tmp_path, stated, rules):
    """The package door's index and file hosts are judged by the signer's own pack too (TKB-ALWAYS-REFUSED and the
    address and name rules), so a wrong box policy cannot let the host fetch from itself or a metadata service: a
    real recorder on a real signer, the box policy saying allow, the signer refusing; the same crossing naming a
    public host is allowed (the pack refuses what it should, not every package crossing)."""
    home = short_tmp("tkd-")
    signer = MachineSigner(home)
    try:
        signer.ensure()
        rec = RunRecorder(signer, AllowingPolicy.default(), BOX_FACTS)
        rec.open()
        public = rec.decide(PACKAGES, "project", dict(PUBLIC, project="tinypkg"))
        page = rec.decide(PACKAGES, "project", dict(PUBLIC, project="tinypkg", **stated))
        file = rec.decide(PACKAGES, "file", dict(PUBLIC, project="tinypkg", filename="tinypkg-1.0.tar.gz",
                                                 version="1.0", sha256="ab" * 32, got_sha256="ab" * 32, size=10,
                                                 run_bytes=0, **stated))
        rec.complete(public, "ok", {"bytes": 10})
        rec.close("test done")
    finally:
        signer.stop()
        shutil.rmtree(home, ignore_errors=True)
    assert public.allowed and public.args["verdict"] == "allow" and public.rule_ids == []
    for crossing in (page, file):
        assert crossing.tool == "box.packages" and crossing.args["verdict"] == "allow"  # the box policy let it by
        assert crossing.decision == "deny" and crossing.decision_id is not None and not crossing.allowed
        assert crossing.rule_ids == rules


def test_the_signer_s_address_rules_leave_public_addresses_and_names_alone():
    """The pack's address and name rules (read here with Python's re, as the pack's patterns are plain regular
    expressions) refuse what they name and not a public address or name that merely looks like one. The pack's
    language has no flags, so a name is matched as the door states it, lower case (rules/hostnames.check_host);
    the host's refused_name reads any case."""
    import re
    import yaml
    rules = {r["id"]: re.compile(r["pattern"]) for r in yaml.safe_load(BOX_PACK)["deny"]}
    for public in ("2606:4700::1111", "2a00:1450:4001::64", "fe7f::1", "2002:5db8:d822::", "64:ff9b::5db8:d822",
                   "::5db8:d822", "127a::1", "93.184.216.34"):
        assert not rules["TKB-METADATA-ADDR"].search(public), public
        assert not rules["TKB-METADATA-ADDRS"].search(f'["{public}"]'), public
    for name in ("pypi.org", "pypi.org.", "notlocalhost.", "localhost.example"):
        assert not rules["TKB-LOCAL-NAME"].search(name), name
    for name in ("localhost.", "x.metadata.google.internal..", "metadata"):
        assert rules["TKB-LOCAL-NAME"].search(name), name


@pytest.mark.parametrize("wrong, said", [
    ((*TABLE, TABLE[1]), "the door exec twice"),
    ((*TABLE, Door("package", "box.exec", None, "p", None)), "the tool box.exec twice"),
    ((*TABLE, Door("package", "pkg.install", None, "p", None)), "pkg.install are not under box."),
    ((*TABLE, Door("package", "box.package", None, "p", "p", (Counted("egress"),))), "audit category egress twice"),
])
def test_a_table_that_names_a_door_tool_or_category_twice_is_refused(wrong, said):
    with pytest.raises(ValueError, match=said):
        door_table.check(wrong)


def test_tkbox_show_filters_by_every_door_of_the_table():
    """It offered every door but host before the table (`tkbox show --door host` was refused)."""
    parser = build_parser()
    for name in names():
        assert parser.parse_args(["show", "x.tkb", "--door", name]).door == name


# -- no door's name outside the table ------------------------------------------------------------------------------
# What may still spell a door's name, and why: each (module, the code) here is not the door but a name that is also
# a policy section's (the door table's `section` says which section each door reads), or a stream's kind.
STREAM_KIND = "the kind of stream the box opens (guest/agent.py's forwarders): the guest protocol's wire format"
ALLOWED = {
    ("policy/core.py", "_SCHEMA: dict["): "the policy's sections by name ([box], [exec], ...), not doors",
    ("policy/core.py", "_DEFAULTS: dict["): "the policy sections' defaults by name, not doors",
    ("doors/egress.py", 'body.get("kind") != "egress"'): STREAM_KIND,
    ("doors/model.py", 'body.get("kind") != "model"'): STREAM_KIND,
    ("doors/packages.py", 'body.get("kind") != "packages"'): STREAM_KIND,
}
# the door table's constants (BOX, EXEC, ...): a literal beside one in a comparison, list or map means a door too
CONSTANTS = frozenset(k for k, v in vars(door_table).items() if k.isupper() and isinstance(v, str) and v in names())


def door_literals(source: str, doors: set[str], tools: frozenset[str] = frozenset()) -> list[tuple[int, str, str]]:
    """(line, name, how) for each string literal spelling a door's name where it means the door: compared with a
    door, a kind or a door's constant (`c.door == "exec"`, `args.get("door") != "model"`, `d.kind == "patch"`,
    `name in (EXEC, "host")`), the door of a crossing decided (`.decide("host", ...)`, `.verdict`), a (door, kind)
    pair, a list or map of doors (or of literals and constants together), a `door=` argument; and any literal
    spelling a door's tool (`c.tool == "box.start"`, `{"box.stop": ...}`), whose name means nothing else."""
    def lit(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in doors

    def const(n: ast.AST | None) -> bool:
        return isinstance(n, ast.Name) and n.id in CONSTANTS

    def names_a_door(n: ast.AST) -> bool:
        return any(isinstance(x, ast.Name) and ("door" in x.id.lower() or "kind" in x.id.lower() or const(x))
                   or isinstance(x, ast.Attribute) and ("door" in x.attr.lower() or "kind" in x.attr.lower())
                   or isinstance(x, ast.Constant) and x.value in ("door", "kind") for x in ast.walk(n))

    def doors_in(elts: list) -> bool:
        return sum(map(lit, elts)) >= 1 and sum(map(lit, elts)) + sum(map(const, elts)) >= 2

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in tools:
            out.append((node.lineno, node.value, "a door's tool"))
        if isinstance(node, ast.Compare) and names_a_door(node):
            out += [(x.lineno, x.value, "compared with a door") for x in ast.walk(node) if lit(x)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("decide", "verdict") and node.args and lit(node.args[0]):
            out.append((node.lineno, node.args[0].value, f"the door of .{node.func.attr}()"))
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and lit(node.elts[0]) and \
                isinstance(node.elts[1], ast.Constant) and isinstance(node.elts[1].value, str):
            out.append((node.lineno, node.elts[0].value, "a (door, kind) pair"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and doors_in(node.elts):
            out.append((node.lineno, ", ".join(e.value for e in node.elts if lit(e)), "a list of doors"))
        elif isinstance(node, ast.Dict) and doors_in(node.keys):
            out.append((node.lineno, ", ".join(k.value for k in node.keys if k is not None and lit(k)),
                        "a map keyed by doors"))
        elif isinstance(node, ast.keyword) and node.arg and "door" in node.arg and lit(node.value):
            out.append((node.lineno, node.value.value, "a door= argument"))
    return out


def test_the_scan_finds_a_door_spelled_each_way():
    source = ('rec.decide("exec", "cell", {})\nif c.door == "model": pass\nif a.get("door") != "egress": pass\n'
              'skip = {("patch", "file")}\nDOORS = ["box", "host"]\nm = {"exec": 1, "secrets": 2}\nf(door="host")\n'
              'policy.get("exec", "timeout_s")\nfacts.get("host")\nx = {"model": m}\n'
              'if d.kind == "packages": pass\nif name in (EXEC, "patch"): pass\nm = {EXEC: 1, "host": 2}\n'
              'if c.tool == "box.start": pass\nt = {"box.stop": 1}\nif a.get("mode") != "egress": pass\n'
              'if "host" in facts: pass\nk = {EXEC: 1, SECRETS: 2}\n')
    found = {(line, how) for line, _, how in door_literals(source, set(names()), frozenset(tools()))}
    assert found == {(1, "the door of .decide()"), (2, "compared with a door"), (3, "compared with a door"),
                     (4, "a (door, kind) pair"), (5, "a list of doors"), (6, "a map keyed by doors"),
                     (7, "a door= argument"), (11, "compared with a door"), (12, "compared with a door"),
                     (12, "a list of doors"), (13, "a map keyed by doors"), (14, "a door's tool"),
                     (15, "a door's tool")}


def test_no_module_spells_a_door_name_where_it_means_the_door():
    doors, found, allowed_seen = set(names()), [], set()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        rel = path.relative_to(PACKAGE_ROOT).as_posix()
        if rel == "rules/door_table.py" or rel.startswith("guest/"):  # the table; the box's agent imports no host
            continue
        lines = path.read_text().splitlines()
        for line, name, how in door_literals(path.read_text(), doors, frozenset(tools())):
            allowed = [key for key in ALLOWED if key[0] == rel and key[1] in lines[line - 1]]
            allowed_seen.update(allowed)
            if not allowed:
                found.append(f"{rel}:{line}: {name} ({how}): use rules/door_table.py's constant or tool_of")
    assert found == []
    assert allowed_seen == set(ALLOWED), "an allowed entry no longer matches anything: remove it"
