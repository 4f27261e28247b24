"""The tree passes `ruff check` under the rules pyproject.toml selects ([tool.ruff.lint]: pycodestyle errors and
warnings, pyflakes; lines up to 120 columns), so a finding fails here rather than piling up unseen."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed in this environment "
                           "(the `test` extra brings it: pip install -e '.[test]')")
def test_ruff_check_reports_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"`ruff check .` reports (exit {r.returncode}):\n{r.stdout}{r.stderr}"
