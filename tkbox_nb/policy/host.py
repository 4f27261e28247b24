"""The host's own acts (a host-side magic: policy, secret binding, status, bundle, restart). They have no section:
they are the user's acts, not the box's, so they are allowed and recorded, and anything else on this door is refused.
"""

from __future__ import annotations

from typing import Any

from tkbox_nb.policy.base import Verdict


def decide(kind: Any, facts: dict[str, Any]) -> Verdict:
    """A host-side magic, named."""
    if kind == "magic" and isinstance(facts.get("magic"), str):
        return Verdict("allow", "host.magic")
    return Verdict("deny", "host.unknown", f"unknown host event {kind!r}")
