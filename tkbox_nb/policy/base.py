"""What every section of a policy shares: the verdict a decision gives, and the view of a policy a decision reads.

Each door's section (its keys and defaults, its checks beyond types, and its decide function) is a module of this
package that knows only this module, never the box or another section; core.py loads the TOML and validates the
whole document strictly, then hands each crossing to its door's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

MAX_LIST = 1024


@dataclass(frozen=True)
class Verdict:
    """The box policy's answer for one crossing: `verdict` is allow or deny, `rule` names the policy entry."""

    verdict: str
    rule: str
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.verdict == "allow"


class Settings(Protocol):
    """A policy as a decision reads it: its validated tables (`data`) and one setting or its default (`get`)."""

    data: dict[str, dict[str, Any]]

    def get(self, section: str, key: str) -> Any: ...


def tname(t: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    if isinstance(t, tuple):
        return "a number" if set(t) == {int, float} else " or ".join(names[x] for x in t)
    return names[t]


def seconds_problem(value: Any, cap: float) -> str:
    """Why a number of seconds is unusable (nan, infinite, not positive, past `cap`), or ""."""
    import math
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not 0 < value <= cap:
        return f"must be a number of seconds above 0 and at most {cap:g}"
    return ""
