"""The totals a door states in its decisions, recounted from the signed records in order (`tkbox verify`).

A door that decides on the run's totals (the model door's budgets, the egress door's `max_connections`) states them
in each decision; a verifier re-derives each decision from those stated facts (bundle/verify.py), so they must be the
totals the signed records before it give, or a door could state less than it had let through. And a model call
states the provider-side fetches its request body names, so the decision covered every one of them.
"""

from __future__ import annotations

from tkbox_nb.rules.door_table import EGRESS, MODEL


def unstated_fetches(args: dict, content: dict) -> str:
    """For a model call whose request body is in the bundle: "" when the server-side tools, MCP servers and URLs it
    states (`fetches`) are those the body names (rules/model_fetches.py), else why not, so a door that left one out
    of the decision fails verification."""
    if args.get("door") != MODEL or args.get("kind") != "call" or args.get("request") not in content:
        return ""
    from tkbox_nb.rules.model_fetches import provider_fetches
    from tkbox_nb.guest.protocol import loads_one_reading
    try:
        doc = loads_one_reading(content[args["request"]])
    except (ValueError, RecursionError):
        return ""  # the door decides no body it cannot read (a request error) and states no fetches for it
    named = provider_fetches(doc) if isinstance(doc, dict) else []
    if named != (args.get("fetches") or []):
        return f"the call states {len(args.get('fetches') or [])} server-side fetch(es), its request body names " \
               f"{len(named)}"
    return ""


def connection_totals(events: dict[int, dict], disclosed: dict[tuple[int, str], dict], fail_record) -> None:
    """The egress door states in each connection the run's allowed ones before it (`[egress] max_connections`),
    deciding them one at a time: recount them from the signed records in order."""
    allowed = 0
    for seq in sorted(events):
        args = (disclosed.get((seq, "policy.decision")) or {}).get("args")
        if events[seq].get("type") != "policy.decision" or not isinstance(args, dict) \
                or args.get("door") != EGRESS or args.get("kind") != "connect" or "run_connections" not in args:
            continue
        if args.get("run_connections") != allowed:
            fail_record(seq, "connection totals", f"the connection states {str(args.get('run_connections'))[:20]} "
                                                  f"allowed before it, the signed records before it give {allowed}")
        allowed += (events[seq].get("data") or {}).get("decision") == "allow"


def model_totals(events: dict[int, dict], disclosed: dict[tuple[int, str], dict], fail_record) -> None:
    """The model door decides budgets on the run's totals it states in each call (docs/policy.md#models); recount
    them from the signed records in order: calls allowed before, tokens the results before reported, and output
    tokens asked for by calls allowed and not yet ended. The door signs a call's result and moves its totals under
    one lock, so the recount is exact."""
    calls = used_in = used_out = 0
    in_flight: dict[str, int] = {}
    for seq in sorted(events):
        e, data = events[seq], events[seq].get("data") or {}
        if e.get("type") == "policy.decision" and (seq, "policy.decision") in disclosed:
            args = disclosed[(seq, "policy.decision")].get("args")
            if not isinstance(args, dict) or args.get("door") != MODEL or args.get("kind") != "call" \
                    or "run_calls" not in args:
                continue
            want = {"run_calls": calls, "run_input_tokens": used_in,
                    "run_output_tokens": used_out + sum(in_flight.values())}
            stated = {k: args.get(k) for k in want}
            if stated != want:
                fail_record(seq, "model totals", f"the call states {stated}, the signed records before it give {want}")
            if data.get("decision") == "allow":
                calls += 1
                asked = args.get("max_output")
                in_flight[str(data.get("decision_id"))] = asked if isinstance(asked, int) else 0
        elif e.get("type") == "tool.result" and str(data.get("decision_id")) in in_flight:
            in_flight.pop(str(data.get("decision_id")))
            result = (disclosed.get((seq, "tool.result")) or {}).get("result")
            usage = result.get("usage") if isinstance(result, dict) else None
            for key, n in (("input_tokens", 0), ("output_tokens", 1)):
                v = usage.get(key) if isinstance(usage, dict) else None
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    if n == 0:
                        used_in += v
                    else:
                        used_out += v
