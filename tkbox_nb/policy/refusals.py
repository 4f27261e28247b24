"""The verdict of a refusal count: the record a door signs for the refused crossings it counted past its cap.

A box can be refused as often as it asks; each door signs its first `[box] max_refusals` refusals of a run one by
one and past them only counts them (signing/refusal_caps.py), signing the count at most once a second and as the box
stops. A count is itself a refusal (deny), so `tkbox verify` re-derives it like any decision: this function checks the
count's statement strictly (a positive count, at most `MAX_NAMES` kinds and rules, each a positive count, summing
to it) and names a malformed one by its own rule. Pure.
"""

from __future__ import annotations

from typing import Any

from tkbox_nb.policy.base import Verdict
from tkbox_nb.rules.door_table import capped

KIND = "refused_count"
MAX_NAMES = 17  # kinds or rules named in one count (16 by name and "other", signing/refusal_caps.py)
MAX_NAME = 120
COUNTED_DOORS = capped()  # the doors a box drives (rules/door_table.py; patch, host and box are not capped)


def _tally(v: Any, count: int) -> bool:
    return (isinstance(v, dict) and 0 < len(v) <= MAX_NAMES
            and all(isinstance(k, str) and 0 < len(k) <= MAX_NAME for k in v)
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in v.values())
            and sum(v.values()) == count)


def decide(door: Any, facts: dict[str, Any]) -> Verdict:
    """A count of refused crossings of `door` not each signed: always a refusal, by `refusals.counted` when well
    formed, else by `refusals.malformed`."""
    count = facts.get("count")
    if door not in COUNTED_DOORS:
        return Verdict("deny", "refusals.malformed", f"the {door!r} door's refusals are never counted")
    if not (isinstance(count, int) and not isinstance(count, bool) and 0 < count <= 1 << 40) \
            or not _tally(facts.get("kinds"), count) or not _tally(facts.get("rules"), count) \
            or set(facts) - {"door", "kind", "count", "kinds", "rules"}:
        return Verdict("deny", "refusals.malformed", "a refusal count needs a positive count and the kinds and rules "
                                                     "it sums")
    return Verdict("deny", "refusals.counted", f"{count} more refused crossings of the {door} door, past "
                                               "[box] max_refusals: counted, not each signed")
