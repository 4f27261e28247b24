"""A real bubblewrap box's bundle names the environment the box ran, as the box saw it, and verify holds it to the
signed box.start (bundle/environment.py)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import platform

import pytest

from conftest import forged_bundle, run_cli
from tkbox_nb import Box, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.archive import read_bundle_file
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.jupyter.run_view import summary

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

PROBE = ("import importlib.metadata as m, json, platform, sys\n"
         "print(json.dumps({'python': platform.python_version(), 'dists': {n: [m.version(n), "
         "str(m.distribution(n).locate_file(''))] for n in ('ipykernel', 'pandas')}}))")


@pytest.fixture(scope="module")
def ran(signer, tmp_path_factory):
    out = tmp_path_factory.mktemp("env") / "box.tkb"
    with Box(backend="bwrap", bundle_path=out) as box:
        seen = json.loads(box.run(["python3", "-c", PROBE]).stdout)
        from tkbox_nb.bundle.environment import status_line
        status = status_line(box.recorder.start_content.get("environment"))
    return out, seen, status


def test_a_bwrap_bundle_names_the_interpreter_and_distributions_as_the_box_saw_them(ran):
    bundle, seen, status = ran
    assert verify_bundle(bundle).valid
    run = open_run(bundle)
    m = run.environment_manifest()
    assert m["backend"] == "bwrap" and m["image_digest"] == "none"
    assert m["environment"]["interpreter"]["version"] == platform.python_version() == seen["python"]
    dists = {d["name"]: d for d in m["environment"]["distributions"]}
    for name in ("ipykernel", "pandas"):
        assert dists[name]["version"] == importlib.metadata.version(name) == seen["dists"][name][0]
        assert dists[name]["location"] == seen["dists"][name][1]  # where it lives, as the box sees it
        assert dists[name]["files_digest"].startswith("sha256:") and dists[name]["hashed"] > 0
    assert run.box["environment"] == next(c for c in run.crossings() if c.tool == "box.start").args["environment"]
    df = run.environment
    pandas = df[(df["kind"] == "distribution") & (df["name"] == "pandas")]
    assert pandas["version"].tolist() == [seen["dists"]["pandas"][0]]
    assert f"cpython {platform.python_version()}" in status  # %box_status's env line
    assert summary(run)["environment"].startswith(f"cpython {platform.python_version()}")  # the run view's line


def test_tkbox_show_environment_prints_it(ran):
    bundle, seen, _ = ran
    r = run_cli("show", str(bundle), "--environment")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.split()[:2] == ["distribution", "pandas"])
    assert line.split()[2] == seen["dists"]["pandas"][0]
    r = run_cli("show", str(bundle), "--environment", "--format", "json")
    assert json.loads(r.stdout)["environment"]["interpreter"]["version"] == platform.python_version()


def _environment_item(files: dict[str, bytes], digest: str) -> tuple[str, int, dict]:
    for name in sorted(n for n in files if n.startswith("box/content-")):
        lines = files[name].split(b"\n")
        for i, line in enumerate(lines):
            if line and json.loads(line)["digest"] == digest:
                return name, i, json.loads(line)
    raise AssertionError("no environment manifest in the bundle")


@pytest.mark.parametrize("how", ["bytes", "bytes-and-digest", "not-json"])
def test_a_tampered_environment_manifest_is_invalid(ran, tmp_path, how):
    """A forger's best: the manifest edited (pandas said to be another version), the bundle's file list recomputed,
    and, the second time, the content renamed to its new digest and the box manifest pointed at it; the third time,
    bytes that are no manifest, which tkbox show --environment refuses in one line, as the signed digest is not
    theirs."""
    bundle = ran[0]
    files = read_bundle_file(bundle)
    box = json.loads(files["box/manifest.json"])
    name, i, item = _environment_item(files, box["environment"])
    m = json.loads(base64.b64decode(item["b64"]))
    next(d for d in m["environment"]["distributions"] if d["name"] == "pandas")["version"] = "1.5.3"
    forged = json.dumps(m, sort_keys=True, separators=(",", ":")).encode() if how != "not-json" else b"\xff{"
    item["b64"] = base64.b64encode(forged).decode()
    if how != "bytes":
        item["digest"] = box["environment"] = "sha256:" + hashlib.sha256(forged).hexdigest()
        files["box/manifest.json"] = json.dumps(box).encode()
    lines = files[name].split(b"\n")
    lines[i] = json.dumps(item).encode()
    files[name] = b"\n".join(lines)
    report = verify_bundle(forged_bundle(files, tmp_path / "forged.tkb"))
    assert not report.valid and report.exit_code == 1, report.summary()
    assert report.first_failure.name in ("content", "box manifest"), report.summary()
    r = run_cli("verify", str(tmp_path / "forged.tkb"))
    assert r.returncode == 1 and r.stdout.startswith("INVALID")
    if how == "not-json":
        r = run_cli("show", str(tmp_path / "forged.tkb"), "--environment")
        # Run.content gives only the bytes the signed digest names: the forged bytes are never read as a manifest
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is not in the bundle" in r.stderr, r.stderr


def test_box_status_shows_the_environment_the_box_runs(signer, tmp_path, monkeypatch, capsys):
    """%box_status in the IPython extension: an env line with the interpreter and the manifest's digest."""
    from IPython.core.interactiveshell import InteractiveShell
    monkeypatch.setenv("TKBOX_BUNDLE_DIR", str(tmp_path / "bundles"))
    ip = InteractiveShell.instance()
    try:
        ip.run_cell("%load_ext tkbox_nb")
        assert ip.run_cell("%%box\n1 + 1").success
        capsys.readouterr()
        ip.run_cell("%box_status")
        out = capsys.readouterr().out
        ip.run_cell("%unload_ext tkbox_nb")
    finally:
        InteractiveShell.clear_instance()
    line = next(x for x in out.splitlines() if x.startswith("env "))
    run = open_run(sorted((tmp_path / "bundles").glob("*.tkb"))[0])
    assert f"cpython {platform.python_version()} (" in line and "distributions" in line
    assert run.box["environment"][:19] in line  # the digest the box.start committed to
