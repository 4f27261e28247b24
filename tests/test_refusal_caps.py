"""The refusal caps (signing/refusal_caps.py) and the verdict of a count record (policy/refusals.py), as pure
functions."""

from __future__ import annotations

import pytest

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy
from tkbox_nb.signing.refusal_caps import OTHER, RefusalCaps, Tally


def test_each_door_signs_its_first_refusals_then_counts_them():
    caps = RefusalCaps()
    assert [caps.admit("egress", "connect", "egress.allow", 3) for _ in range(5)] == [True] * 3 + [False] * 2
    assert [caps.admit("model", "call", "models.allow", 3) for _ in range(4)] == [True] * 3 + [False]
    assert caps.counted == {"egress": 2, "model": 1}
    assert caps.admit("egress", "connect", "egress.allow", 0) is False  # a cap of 0: every refusal only counted


def test_doors_a_box_does_not_drive_and_the_counts_themselves_are_never_capped():
    caps = RefusalCaps()
    for door, kind in (("box", "start"), ("host", "magic"), ("patch", "file"), ("egress", "refused_count")):
        assert all(caps.admit(door, kind, "r", 0) for _ in range(3))
    assert caps.pending == {} and caps.counted == {}


def test_counts_are_taken_at_most_once_per_interval_and_all_at_the_stop():
    caps = RefusalCaps(flush_s=1.0)
    assert caps.due_in(0.0) is None and caps.take(0.0) == []
    caps.admit("egress", "connect", "egress.allow", 0)
    assert caps.due_in(10.0) == 0.0  # the first count is due at once
    assert caps.take(10.0) == [("egress", {"count": 1, "kinds": {"connect": 1}, "rules": {"egress.allow": 1}})]
    for _ in range(1000):
        caps.admit("egress", "connect", "egress.allow", 0)
    caps.admit("secrets", "misuse", "secrets.misuse", 0)
    assert caps.due_in(10.4) == pytest.approx(0.6) and caps.take(10.4) == []
    taken = caps.take(10.5, final=True)  # the box stops: everything counted, one record a door, in door order
    assert [(d, f["count"]) for d, f in taken] == [("egress", 1000), ("secrets", 1)]
    assert caps.pending == {} and caps.take(20.0, final=True) == []


def test_a_count_names_at_most_sixteen_kinds_and_rules_and_sums_the_rest():
    t = Tally()
    for i in range(40):
        t.add(f"kind{i}", "egress.allow" if i % 2 else f"egress.rule{i}")
    facts = t.facts()
    assert facts["count"] == 40 and len(facts["kinds"]) == 17 and facts["kinds"][OTHER] == 24
    assert sum(facts["rules"].values()) == 40 and len(facts["rules"]) == 17


def test_a_count_record_is_a_refusal_re_derived_from_its_statement():
    pol = Policy.default()
    t = Tally()
    for _ in range(7):
        t.add("connect", "egress.allow")
    v = pol.decide(dict(t.facts(), door="egress", kind="refused_count"))
    assert (v.verdict, v.rule) == ("deny", "refusals.counted") and "7 more refused" in v.reason
    for bad in ({"count": 0}, {"count": True}, {"count": 8}, {"kinds": {"connect": -7}}, {"rules": {}},
                {"rules": {"": 7}}, {"host": "x"}):
        v = pol.decide(dict(t.facts(), door="egress", kind="refused_count", **bad))
        assert (v.verdict, v.rule) == ("deny", "refusals.malformed"), bad
    v = pol.decide(dict(t.facts(), door="patch", kind="refused_count"))  # patch refusals are never counted
    assert (v.verdict, v.rule) == ("deny", "refusals.malformed")


@pytest.mark.parametrize("line, error", [
    ("max_refusals = -1", "box.max_refusals must be from 0 to 100000, not -1"),
    ("max_refusals = 100001", "box.max_refusals must be from 0 to 100000, not 100001"),
    ("max_refusals = 1.5", "box.max_refusals must be an integer"),
    ("max_run_mib = 0", "box.max_run_mib must be from 1 to 448, not 0"),
    ("max_run_mib = 512", "box.max_run_mib must be from 1 to 448, not 512")])
def test_the_caps_are_validated_with_one_line_errors(line, error):
    with pytest.raises(PolicyError, match="^p.toml: " + error) as e:
        Policy.from_toml(f"[box]\n{line}\n", "p.toml")
    assert "\n" not in str(e.value)
    assert Policy.default().get("box", "max_refusals") == 1000 and Policy.default().get("box", "max_run_mib") == 384


def test_verify_recounts_the_allowed_connections_each_connection_states():
    from tkbox_nb.bundle.verify_recount import connection_totals as _connection_totals

    def record(seq, before, decision):
        return ({"type": "policy.decision", "data": {"decision": decision}},
                {"args": {"door": "egress", "kind": "connect", "run_connections": before}})
    runs = {"honest": [(0, "allow"), (1, "deny"), (1, "allow"), (2, "allow")],
            "hidden": [(0, "allow"), (0, "allow"), (1, "allow")]}  # the second states none before it: it hides one
    for name, stated in runs.items():
        events, disclosed, failed = {}, {}, []
        for seq, (before, decision) in enumerate(stated, 2):
            events[seq], disclosed[(seq, "policy.decision")] = record(seq, before, decision)
        _connection_totals(events, disclosed, lambda seq, check, why: failed.append((seq, check)))
        assert failed == ([] if name == "honest" else [(3, "connection totals"), (4, "connection totals")]), name


def test_max_connections_refuses_a_connection_past_the_run_s_allowed_ones():
    pol = Policy.from_toml('[egress]\nallow = ["198.18.34.2:8080"]\nallow_cidrs = ["198.18.0.0/15"]\n'
                           'max_connections = 2\n')
    facts = {"door": "egress", "kind": "connect", "host": "198.18.34.2", "port": 8080, "addresses": ["198.18.34.2"]}
    assert pol.decide(facts).rule == "egress.allow[0]"  # a statement without the total (older runs): as before
    assert [pol.decide(dict(facts, run_connections=n)).rule for n in (0, 1, 2, 9)] == \
        ["egress.allow[0]"] * 2 + ["egress.max_connections"] * 2
    assert pol.decide(dict(facts, run_connections="1")).rule == "egress.max_connections"
    assert Policy.default().get("egress", "max_connections") == 10_000
    with pytest.raises(PolicyError, match="^p.toml: egress.max_connections must be from 0 .no limit. to 1000000"):
        Policy.from_toml("[egress]\nmax_connections = -1\n", "p.toml")
