"""What a run had installed is part of its record and of its audit: pairs of real signed runs (a real signer and
recorder, no box behind them), each with an environment manifest committed by its box.start and package door
crossings as doors/packages.py states them, differing in the interpreter, a distribution's version or files, and
in the files installed during the run. The audit names each difference package by package, never as a digest of
the whole; `Run.installs`, `Run.environment`, `tkbox show --environment` and the run view show what came in."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from conftest import run_cli
from tkbox_nb import open_run
from tkbox_nb.audit.compare import audit
from tkbox_nb.bundle.environment import canonical, manifest
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.jupyter.run_view import environment_line
from tkbox_nb.policy import Policy
from tkbox_nb.signing.recorder import RunRecorder

POLICY = '[exec]\ncells = true\n[packages]\nindex = ["http://198.18.37.2:8080/simple/"]\nallow = ["*"]\n' \
         'deny = ["evilpkg"]\nallow_cidrs = ["198.18.0.0/15"]\n'
# where the door reached the index, as it states it (doors/package_fetch.py)
REACHED = {"host": "198.18.37.2", "addresses": ["198.18.37.2"], "address": "198.18.37.2"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def environment(python: str = "3.11.2", pandas: str = "3.1.1", numpy_files: str = "a", extra: tuple = ()) -> bytes:
    dists = [{"name": "pandas", "version": pandas}, {"name": "numpy", "version": "2.0.0"}, *extra]
    return manifest(canonical({
        "interpreter": {"implementation": "cpython", "version": python, "platform": "linux-x86_64",
                        "executable": "/usr/bin/python3"},
        "paths": ["/venv/lib/site-packages"],
        "distributions": [{"location": "/venv/lib/site-packages", "dist_info": f"{d['name']}-{d['version']}.dist-info",
                           "record_digest": "sha256:" + sha(d["name"].encode()), "files": 2, "hashed": 1,
                           "files_digest": "sha256:" + sha((d["name"] + (numpy_files if d["name"] == "numpy"
                                                                         else "")).encode()), **d} for d in dists],
        "debian": {"packages": [{"name": "libc6", "version": "2.36-9", "architecture": "amd64"}]}}),
        "bwrap", "none")


def record(signer, out: Path, env: bytes, installs: list[tuple[str, str, bytes]]) -> Path:
    """A run whose box.start commits to `env`, with one cell and, for each (project, version, bytes), the package
    door's page and file crossings; a project named evilpkg is refused by name, before any file."""
    rec = RunRecorder(signer, Policy.from_toml(POLICY), {
        "backend": "bwrap", "isolation": "none", "image_digest": "none",
        "environment": "sha256:" + sha(env)})
    rec.start_content = {"environment": env}
    rec.open()
    c = rec.decide("exec", "cell", {}, {"code": b"import tinypkg\n"})
    rec.complete(c, "ok", {"execution_count": 1}, {"outputs": b"[]"})
    n = 0
    for project, version, data in installs:
        page = rec.decide("packages", "project", {"project": project, "index": "http://198.18.37.2:8080/simple/",
                                                   "source": "index", "files": 1, **REACHED})
        if not page.allowed:
            continue
        rec.complete(page, "ok", {"bytes": 100})
        f = rec.decide("packages", "file", {
            "project": project, "filename": f"{project}-{version}-py3-none-any.whl", "version": version,
            "sha256": sha(data), "got_sha256": sha(data), "size": len(data), "source": "index",
            "index": "http://198.18.37.2:8080/simple/", "run_bytes": n, **REACHED})
        rec.complete(f, "ok", {"bytes": len(data)})
        n += len(data)
    rec.close("test done")
    return rec.write_bundle(out)


def test_installs_are_the_runs_environment_in_run_installs_environment_show_and_the_run_view(signer, tmp_path):
    path = record(signer, tmp_path / "a.tkb", environment(), [("tinypkg", "1.0", b"tiny"), ("evilpkg", "1.0", b"")])
    assert verify_bundle(path).valid
    run = open_run(path)
    df = run.installs
    assert [(r.kind, r.project, r.version, r.filename, r.sha256, r.size, r.decision) for r in df.itertuples()] == [
        ("file", "tinypkg", "1.0", "tinypkg-1.0-py3-none-any.whl", sha(b"tiny"), 4, "allow"),
        ("project", "evilpkg", "", "", "", 0, "deny")]
    assert df.loc[1, "rule"] == "packages.deny[0]"
    env = run.environment
    installed = env[env["kind"] == "installed"]
    assert installed[["name", "version", "location", "digest"]].values.tolist() == [
        ["tinypkg", "1.0", "tinypkg-1.0-py3-none-any.whl", "sha256:" + sha(b"tiny")]]
    assert set(env["kind"]) == {"python", "distribution", "debian", "installed"}
    assert environment_line(run).endswith("; 1 file installed during the run (tinypkg 1.0), 1 refused")
    r = run_cli("show", str(path), "--environment")
    assert r.returncode == 0, r.stderr
    assert "package door: 1 file installed during the run (tinypkg 1.0), 1 refused" in r.stdout
    assert any(line.split()[:3] == ["installed", "tinypkg", "1.0"] for line in r.stdout.splitlines()), r.stdout
    r = run_cli("show", str(path), "--environment", "--format", "json")
    got = json.loads(r.stdout)
    assert got["environment"]["interpreter"]["version"] == "3.11.2"
    assert [(i["project"], i["sha256"], i["decision"]) for i in got["installed_during_run"]] == [
        ("tinypkg", sha(b"tiny"), "allow"), ("evilpkg", "", "deny")]


def test_the_audit_names_environment_and_install_differences_package_by_package(signer, tmp_path):
    a = record(signer, tmp_path / "a.tkb", environment(),
               [("tinypkg", "1.0", b"tiny 1"), ("samepkg", "1.0", b"same"), ("onlyapkg", "1.0", b"a")])
    same = record(signer, tmp_path / "same.tkb", environment(),
                  [("tinypkg", "1.0", b"tiny 1"), ("samepkg", "1.0", b"same"), ("onlyapkg", "1.0", b"a")])
    b = record(signer, tmp_path / "b.tkb",
               environment(python="3.12.1", pandas="1.5.3", numpy_files="b",
                           extra=({"name": "polars", "version": "1.0"},)),
               [("samepkg", "1.0", b"same"), ("tinypkg", "2.0", b"tiny 2"), ("otherpkg", "1.0", b"o")])
    assert audit(a, same).equivalent  # the same environment and the same files: nothing to name
    report = audit(a, b, rtol=0.5, atol=1.0)  # tolerances loosen numbers in outputs, never what was installed
    assert not report.equivalent
    by_what = {d.what: d for d in report.differences}
    assert set(by_what) == {"environment", "packages onlyapkg", "packages onlyapkg #2", "packages otherpkg",
                            "packages otherpkg #2", "packages tinypkg #2"}, list(by_what)
    from tkbox_nb.audit.report import readable
    assert readable(by_what["environment"]) == [
        "python: cpython 3.11.2 linux-x86_64 in A, cpython 3.12.1 linux-x86_64 in B",
        f"distribution numpy 2.0.0: other files (sha256:{sha(b'numpya')[:12]} in A, sha256:{sha(b'numpyb')[:12]} "
        "in B)",
        "distribution pandas: 3.1.1 in A, 1.5.3 in B",
        "only in B: distribution polars 1.0"]
    assert readable(by_what["packages tinypkg #2"]) == [
        "tinypkg: 1.0 in A, 2.0 in B", "tinypkg: file tinypkg-1.0-py3-none-any.whl in A, "
                                       "tinypkg-2.0-py3-none-any.whl in B"]
    assert readable(by_what["packages onlyapkg #2"])[0].startswith("onlyapkg: only in A (onlyapkg 1.0 ")
    assert readable(by_what["packages otherpkg"])[0].startswith("otherpkg: only in B (otherpkg (index page) allow")
    text = report.table()
    assert "distribution pandas: 3.1.1 in A, 1.5.3 in B" in text and "tinypkg: 1.0 in A, 2.0 in B" in text
    assert "pandas" in report.html() and json.dumps(report.as_dict())
    r = run_cli("audit", str(a), str(b))
    assert r.returncode == 1 and "distribution pandas: 3.1.1 in A, 1.5.3 in B" in r.stdout, r.stdout + r.stderr


def test_the_same_files_other_bytes_are_named_by_their_sha256(signer, tmp_path):
    a = record(signer, tmp_path / "a.tkb", environment(), [("tinypkg", "1.0", b"tiny")])
    b = record(signer, tmp_path / "b.tkb", environment(), [("tinypkg", "1.0", b"other bytes")])
    report = audit(a, b)
    assert [d.what for d in report.differences] == ["packages tinypkg #2"]
    from tkbox_nb.audit.report import readable
    assert readable(report.differences[0]) == [
        f"tinypkg 1.0: other bytes (tinypkg-1.0-py3-none-any.whl: sha256 {sha(b'tiny')[:16]} in A, "
        f"{sha(b'other bytes')[:16]} in B)"]


def test_a_run_without_a_manifest_against_one_with_is_named_not_called_equal(signer, tmp_path):
    a = record(signer, tmp_path / "a.tkb", environment(), [])
    b = record(signer, tmp_path / "b.tkb", manifest(None, "qemu", "sha256:" + "0" * 64, "the image keeps none"), [])
    report = audit(a, b)
    from tkbox_nb.audit.report import readable
    assert [readable(d) for d in report.differences] == [
        ["environment: cpython 3.11.2 linux-x86_64 with 2 distributions in A, not recorded (the image keeps none) "
         "in B"]]


def test_a_replay_lists_installs_from_a_hostile_bundle_as_text_never_as_markdown(signer, tmp_path):
    """What the replay writes of the package door's rows comes from the bundle: a file name, version or index that
    holds backticks, a newline, a heading or an image stays inline code in its installs cell. These crossings fall in
    no cell (the recorder decided them after the cell's result), so they come in one cell at the end."""
    from tkbox_nb.audit.replay import to_notebook
    rec = RunRecorder(signer, Policy.from_toml(POLICY), {"backend": "bwrap", "isolation": "none",
                                                         "image_digest": "none"})
    rec.open()
    c = rec.decide("exec", "cell", {}, {"code": b"x = 1\n"})
    rec.complete(c, "ok", {"execution_count": 1}, {"outputs": b"[]"})
    hostile = "`` x\n# Owned ![i](https://leak.example/?d=1) |"
    f = rec.decide("packages", "file", {
        "project": "tinypkg", "filename": "tinypkg-1.0.tar.gz" + hostile, "version": "1.0" + hostile,
        "sha256": sha(b"t"), "got_sha256": sha(b"t"), "size": 1, "source": "cache", "index": hostile, "run_bytes": 0})
    rec.complete(f, "ok", {"bytes": 1})
    rec.close("test done")
    nb = to_notebook(open_run(rec.write_bundle(tmp_path / "h.tkb")))
    cell = nb.cells[-1]
    assert cell.metadata.tags == ["tkbox-installs"] and cell.source.startswith("Package door, while no cell")
    [line] = [x for x in cell.source.splitlines() if x.startswith("- ")]
    assert not any(x.lstrip().startswith("#") for x in cell.source.splitlines())
    assert "``` tinypkg-1.0.tar.gz`` x\\x0a# Owned ![i](https://leak.example/?d=1) | ```" in line
    assert line.endswith(": installed") and sha(b"t") in line
    assert cell.metadata["tkbox"]["installs"][0]["index"] == hostile  # the rows as the bundle has them


class _PolicyThatLetsAHostBy(Policy):
    """A box policy whose code is wrong about hosts: it decides every package crossing as `[packages] allow` does,
    never reading the host (what the signer's own pack is for, tests/test_door_table.py)."""

    def decide(self, facts):
        if facts.get("door") == "packages":
            return super().decide({k: v for k, v in facts.items()
                                   if k not in ("host", "addresses", "address", "address_class", "source")})
        return super().decide(facts)


def test_a_replay_names_the_signer_s_rule_when_the_signer_refused_a_file_the_box_policy_allowed(signer, tmp_path):
    """A file the box policy allowed (packages.allow[0]) and the signer refused (its host is loopback, TKB-METADATA-
    ADDR and TKB-METADATA-ADDRS): the installs cell names the signer's rules, the record's rule_ids, never the box
    policy's rule as if that had refused it; a file the box policy refused still names the box policy's rule."""
    from tkbox_nb.audit.replay import to_notebook
    rec = RunRecorder(signer, _PolicyThatLetsAHostBy.from_toml(POLICY), {"backend": "bwrap", "isolation": "none",
                                                                         "image_digest": "none"})
    rec.open()
    loopback = {"host": "127.0.0.1", "addresses": ["127.0.0.1"], "address": "127.0.0.1"}
    bad = rec.decide("packages", "file", {
        "project": "tinypkg", "filename": "tinypkg-1.0.tar.gz", "version": "1.0", "sha256": sha(b"t"),
        "got_sha256": sha(b"t"), "size": 1, "source": "index", "index": "http://127.0.0.1/simple/", "run_bytes": 0,
        **loopback})
    by_box = rec.decide("packages", "file", {
        "project": "evilpkg", "filename": "evilpkg-1.0.tar.gz", "version": "1.0", "sha256": sha(b"e"),
        "got_sha256": sha(b"e"), "size": 1, "source": "cache", "index": "http://198.18.37.2:8080/simple/",
        "run_bytes": 0})
    rec.close("test done")
    assert bad.args["verdict"] == "allow" and bad.args["rule"] == "packages.allow[0]" and not bad.allowed
    assert bad.rule_ids == ["TKB-METADATA-ADDR", "TKB-METADATA-ADDRS"] and not by_box.allowed
    run = open_run(rec.write_bundle(tmp_path / "s.tkb"))
    cell = to_notebook(run).cells[-1]
    signer_line, box_line = [x for x in cell.source.splitlines() if x.startswith("- ")]
    assert signer_line.endswith(": refused by the signer (`TKB-METADATA-ADDR, TKB-METADATA-ADDRS`)"), signer_line
    assert "packages.allow" not in signer_line
    assert box_line.endswith(": refused (`packages.deny[0]`)"), box_line
    assert [r["rule_ids"] for r in cell.metadata["tkbox"]["installs"]] == ["TKB-METADATA-ADDR,TKB-METADATA-ADDRS",
                                                                          "TKB-POLICY-DENY"]
    assert run.installs["rule_ids"].tolist() == ["TKB-METADATA-ADDR,TKB-METADATA-ADDRS", "TKB-POLICY-DENY"]
