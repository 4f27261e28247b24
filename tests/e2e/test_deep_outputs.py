"""A cell's output nested deeper than nbformat, a notebook's writer or the audit can recurse (application/json 700
levels deep, which the box's allowlist passes) is a VALID bundle: replay and audit read it, eliding what is past
replay.MAX_DEPTH with a placeholder naming its digest, so two outputs that differ only down there still differ."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from conftest import run_cli

from tkbox_nb import Box
from tkbox_nb.audit.compare import audit
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

# the same code in both runs; the innermost value (a random number) differs, 700 levels down
CELL = ("import json, random\nfrom IPython.display import display\ninner = str(random.randrange(10 ** 12))\n"
        "display({'application/json': json.loads('[' * 700 + inner + ']' * 700), 'text/plain': 'deep'}, raw=True)")


def deep_run(out: Path) -> Path:
    with Box(policy="[exec]\ncells = true\n", backend="bwrap", bundle_path=out) as box:
        box.execute(CELL)
    return out


def test_a_deeply_nested_output_replays_and_audits(signer, tmp_path):
    a, b = deep_run(tmp_path / "a.tkb"), deep_run(tmp_path / "b.tkb")
    assert verify_bundle(a).valid and verify_bundle(b).valid
    r = run_cli("replay", str(a), "-o", str(tmp_path / "a.ipynb"))
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(tmp_path / "a.ipynb", as_version=4)
    shown = nbformat.writes(nb)
    assert "deep" in shown and "tkbox: elided, nested past 64 levels; sha256:" in shown
    assert audit(a, a).equivalent
    report = audit(a, b)
    assert [d.kind for d in report.differences] == ["cell outputs"], report.differences
    r = run_cli("audit", str(a), str(b))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
