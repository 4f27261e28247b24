"""Where this machine's tkbox state lives ($TKBOX_HOME): below everything that reads a path there, so that verifying
a bundle or sweeping scratch space need not import the signer for a file name."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    env = os.environ.get("TKBOX_HOME")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "tkbox"


def trust_path(home: str | Path | None = None) -> Path:
    """This machine's pinned trust config: what `tkbox verify` checks a bundle against when given none."""
    return Path(home or default_home()) / "trust.json"
