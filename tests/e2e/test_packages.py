"""The package door with real boxes: pip in a bubblewrap box installs from a PEP 503 index served in a network
namespace (198.18.37.0/24) through the door, every file signed with its sha256, kept in the host's cache for the next
box, and refused, signed, when the policy or the bytes say so. The wheels are built here, by hand."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_cli
from testnet import NamespaceNet, available
from wheels import backend_wheel, sdist, wheel

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.verify import verify_bundle
from tkbox_nb.core.home import trust_path

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(not available()[0], reason=available()[1])]

NET_INDEX = 37  # 198.18.37.0/24: no other test module uses it
MAX_FILE = 20_000




def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


TINY = wheel("tinypkg", "1.0", "VALUE = 42\n")
BIG = wheel("bigpkg", "1.0", "DATA = %r\n" % os.urandom(3 * MAX_FILE).hex())
BAD = wheel("badpkg", "1.0", "VALUE = 'not what the index hashed'\n")


def publish(net: NamespaceNet, project: str, filename: str, data: bytes, stated: str | None = None) -> None:
    """The file under /files/ and the project's page under /simple/, linking it with a relative URL and a hash."""
    net.add_file(f"files/{filename}", data)
    net.add_file(f"simple/{project}/index.html", (
        f'<!DOCTYPE html><html><body><a href="../../files/{filename}#sha256={stated or sha(data)}" '
        f'data-requires-python="&gt;=3.8">{filename}</a></body></html>').encode())


@pytest.fixture
def index():
    with NamespaceNet(index=NET_INDEX) as n:
        publish(n, "tinypkg", "tinypkg-1.0-py3-none-any.whl", TINY)
        publish(n, "bigpkg", "bigpkg-1.0-py3-none-any.whl", BIG)
        publish(n, "badpkg", "badpkg-1.0-py3-none-any.whl", BAD, stated=sha(b"other bytes"))
        publish(n, "evilpkg", "evilpkg-1.0-py3-none-any.whl", wheel("evilpkg", "1.0", ""))
        n.add_file("simple/hostpkg/index.html", (  # a file on a host the policy never named
            f'<a href="http://{n.prefix}.9:8080/files/hostpkg-1.0-py3-none-any.whl#sha256={sha(TINY)}">x</a>').encode())
        yield n


OPEN_TEST_NET = 'allow_cidrs = ["198.18.0.0/15"]\n'  # the test network's range is special-purpose (benchmarking)


def policy(net: NamespaceNet) -> Policy:
    return Policy.from_toml(f'[packages]\nindex = ["http://{net.web}:8080/simple/"]\n{OPEN_TEST_NET}'
                            f'allow = ["TinyPkg", "BigPkg*", "badpkg", "hostpkg"]\nmax_file_bytes = {MAX_FILE}\n')


def venv_state() -> list[tuple[str, int, int]]:
    """Every file of the host's environment, with its size and time: pip in the box must change none of it."""
    root = Path(sys.prefix)
    return sorted((str(p), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*") if not p.is_dir())


def pip(box, *args: str):
    return box.run(["python", "-m", "pip", "install", "--no-color", *args], timeout=180)


def package_rows(path: Path):
    return [c for c in open_run(path).crossings() if c.door == "packages"]


PYPI_PAGES = b"max-age=600"  # the Cache-Control PyPI states for its simple pages


def test_pip_installs_through_the_door_then_from_the_cache_with_the_index_gone(private_signer, index, tmp_path):
    index.add_file("simple/.cache-control", PYPI_PAGES)
    before = venv_state()
    with Box(backend="bwrap", policy=policy(index), home=private_signer.home, bundle_path=tmp_path / "a.tkb") as b:
        r = pip(b, "tinypkg")
        assert r.exit_code == 0, r.stdout.decode() + r.stderr.decode()
        r = b.run(["python", "-c", "import tinypkg; print(tinypkg.VALUE, tinypkg.__file__)"])
        assert r.stdout.decode().split() == ["42", "/tmp/tkbox-site-packages/tinypkg/__init__.py"], r.stderr
    rows = package_rows(tmp_path / "a.tkb")
    assert [(c.args["kind"], c.decision) for c in rows] == [("project", "allow"), ("file", "allow")]
    page, file = rows
    assert page.args["project"] == "tinypkg" and page.args["source"] == "index" and page.args["files"] == 1
    assert page.args["index_max_age_s"] == 600
    assert file.args["sha256"] == file.args["got_sha256"] == sha(TINY) and file.args["size"] == len(TINY)
    assert file.args["filename"] == "tinypkg-1.0-py3-none-any.whl" and file.args["version"] == "1.0"
    assert file.args["source"] == "index" and file.result["bytes"] == len(TINY)
    assert verify_bundle(tmp_path / "a.tkb", trust_path(private_signer.home)).valid
    kept = private_signer.home / "packages" / "files" / sha(TINY)[:2] / sha(TINY)
    assert kept.read_bytes() == TINY

    web = index.procs[0]  # the index's server, stopped: the next box installs from the cache alone
    os.killpg(web.pid, signal.SIGKILL)
    web.wait(timeout=10)
    with Box(backend="bwrap", policy=policy(index), home=private_signer.home, bundle_path=tmp_path / "b.tkb") as b:
        cell = b.execute("%pip install tinypkg\nimport tinypkg\nprint('value', tinypkg.VALUE)")  # as a notebook does
        text = "".join(o.get("text", "") for o in cell.outputs)
        assert cell.status == "ok" and "value 42" in text, cell.outputs
    first = page
    page, file = package_rows(tmp_path / "b.tkb")
    assert page.decision == "allow" and page.args["source"] == "cache"  # fresh: the index was not even asked
    assert "index_unreachable" not in page.args and 0 <= page.args["age_s"] < 600 and page.args["fetched_at"]
    assert page.args["page_sha256"] == first.args["page_sha256"]
    assert page.args["served_sha256"] == first.args["served_sha256"]
    assert file.decision == "allow" and file.args["source"] == "cache" and file.args["got_sha256"] == sha(TINY)
    assert verify_bundle(tmp_path / "b.tkb", trust_path(private_signer.home)).valid
    assert venv_state() == before


def test_refused_in_one_signed_line_each_a_project_off_the_list_a_bad_hash_a_large_file_another_host(
        signer, index, tmp_path):
    with Box(backend="bwrap", policy=policy(index), bundle_path=tmp_path / "r.tkb") as b:
        for project in ("evilpkg", "badpkg", "bigpkg", "hostpkg"):
            r = pip(b, project)
            assert r.exit_code != 0, project
        r = b.run(["python", "-c", "import badpkg"])
        assert r.exit_code != 0
    refused = [c for c in package_rows(tmp_path / "r.tkb") if c.decision == "deny"]
    assert [(c.args["kind"], c.args["project"], c.args["rule"]) for c in refused] == [
        ("project", "evilpkg", "packages.allow"), ("file", "badpkg", "packages.hash"),
        ("file", "bigpkg", "packages.max_file_bytes"), ("project", "hostpkg", "packages.index_page")]
    evil, bad, big, other_host = refused
    assert "files" not in evil.args  # a refused name is never asked of the index
    assert bad.args["sha256"] == sha(b"other bytes") and bad.args["got_sha256"] == sha(BAD)
    assert big.args["size"] == MAX_FILE + 1 and big.args["sha256"] == sha(BIG)
    assert "a link to a file on another host" in other_host.args["index_error"]
    assert all(c.rule_ids for c in refused)  # each signed, with the signer's rule
    assert verify_bundle(tmp_path / "r.tkb").valid
    cache = Path(os.environ["TKBOX_HOME"]) / "packages" / "files"
    assert not (cache / sha(BAD)[:2] / sha(BAD)).exists() and not (cache / sha(BIG)[:2] / sha(BIG)).exists()


STALL = wheel("stallpkg", "1.0", "VALUE = 1\n")


class HostileIndex(http.server.BaseHTTPRequestHandler):
    """An index on the host's end of the test network (198.18.37.1) that redirects, never answers, or stops half way
    through a file."""

    def do_GET(self):
        if self.path.startswith("/simple/redirpkg/"):
            self.send_response(302)
            self.send_header("Location", "http://198.18.99.9/simple/redirpkg/")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.startswith("/simple/silentpkg/"):
            time.sleep(6)
        elif self.path.startswith("/simple/stallpkg/"):
            body = f'<a href="/files/stallpkg-1.0-py3-none-any.whl#sha256={sha(STALL)}">s</a>'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path.startswith("/files/stallpkg-1.0-py3-none-any.whl"):
            self.send_response(200)
            self.send_header("Content-Length", str(len(STALL)))
            self.end_headers()
            self.wfile.write(STALL[:len(STALL) // 2])
            self.wfile.flush()
            time.sleep(6)
        else:
            self.send_error(404)

    def log_message(self, *a):
        pass


def test_a_redirect_an_index_that_never_answers_and_a_file_cut_short_are_refused_signed_and_nothing_is_kept(
        private_signer, index, tmp_path):
    server = http.server.ThreadingHTTPServer((index.gateway, 0), HostileIndex)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hostile = Policy.from_toml(f'[packages]\nindex = ["http://{index.gateway}:{server.server_port}/simple/"]\n'
                                   'allow = ["*"]\ntimeout_s = 1\n' + OPEN_TEST_NET)
        with Box(backend="bwrap", policy=hostile, home=private_signer.home, bundle_path=tmp_path / "h.tkb") as b:
            for project in ("redirpkg", "silentpkg", "stallpkg"):
                assert pip(b, project).exit_code != 0, project
    finally:
        server.shutdown()
    rows = package_rows(tmp_path / "h.tkb")
    assert [(c.args["kind"], c.args["project"], c.decision, c.args["rule"]) for c in rows] == [
        ("project", "redirpkg", "deny", "packages.index_page"), ("project", "silentpkg", "deny", "packages.index_page"),
        ("project", "stallpkg", "allow", "packages.allow[0]"), ("file", "stallpkg", "deny", "packages.fetch")]
    assert "answered 302" in rows[0].args["index_error"]
    assert "cannot be reached (ReadTimeout)" in rows[1].args["index_error"]
    assert "could not be fetched (ReadTimeout)" in rows[3].args["fetch_error"] and rows[3].args["size"] == 0
    cache = private_signer.home / "packages"
    assert not (cache / "files").exists() and list((cache / "tmp").iterdir()) == []  # nothing half kept
    assert verify_bundle(tmp_path / "h.tkb", trust_path(private_signer.home)).valid


@pytest.fixture
def loopback_listener():
    """A service on the host's loopback: the package door must never connect to it."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.05)
    yield srv
    srv.close()


@pytest.mark.parametrize("where, why", [
    ("http://127.0.0.1:{port}/simple/", "127.0.0.1 is loopback"),
    ("http://169.254.169.254/simple/", "169.254.169.254 is cloud metadata"),
    ("http://meta.tkb.test:8080/simple/", "169.254.169.254 is cloud metadata"),  # a name that resolves there
    ("http://localhost:{port}/simple/", "localhost is a local or cloud metadata name"),  # never even looked up
    ("http://198.18.37.2:8080/simple/", "198.18.37.2 is benchmarking (allow it with packages.allow_cidrs)"),
])
def test_an_index_at_a_private_or_metadata_address_is_refused_signed_and_never_connected_to(
        signer, index, tmp_path, loopback_listener, where, why):
    url = where.format(port=loopback_listener.getsockname()[1])
    opened = "" if "198.18.37.2" in url else OPEN_TEST_NET  # even with the test range open, these are refused
    bad = Policy.from_toml(f'[packages]\nindex = ["{url}"]\nallow = ["*"]\nnameservers = ["{index.web}"]\n{opened}')
    with Box(backend="bwrap", policy=bad, bundle_path=tmp_path / "m.tkb") as b:
        r = pip(b, "tinypkg")
        assert r.exit_code != 0
    with pytest.raises(socket.timeout):
        loopback_listener.accept()  # nothing connected to the host's loopback
    [row] = package_rows(tmp_path / "m.tkb")
    assert row.decision == "deny" and row.args["kind"] == "project" and why in row.args["verdict_reason"]
    assert row.args["rule"] == ("packages.special" if not opened else "packages.always") and row.rule_ids
    assert "source" not in row.args and "files" not in row.args  # nothing fetched, nothing served
    assert row.args["index"] == url and row.args["address"] == ""
    assert verify_bundle(tmp_path / "m.tkb").valid


def test_an_index_named_by_a_host_name_is_reached_only_at_the_address_the_door_resolved(signer, index, tmp_path):
    """web.tkb.test is known only to the policy's nameserver (in the test namespace): httpx looking it up again
    with the system resolver would fail, so an install shows the door dialled the address it checked."""
    named = Policy.from_toml(f'[packages]\nindex = ["http://web.tkb.test:8080/simple/"]\nallow = ["tinypkg"]\n'
                             f'nameservers = ["{index.web}"]\n{OPEN_TEST_NET}')
    with Box(backend="bwrap", policy=named, bundle_path=tmp_path / "n.tkb") as b:
        r = pip(b, "tinypkg")
        assert r.exit_code == 0, r.stdout.decode() + r.stderr.decode()
    page, file = package_rows(tmp_path / "n.tkb")
    for row in (page, file):
        assert row.decision == "allow" and row.args["host"] == "web.tkb.test"
        assert row.args["addresses"] == [index.web] and row.args["address"] == index.web
    assert verify_bundle(tmp_path / "n.tkb").valid


REPLACED = wheel("tinypkg", "1.0", "VALUE = 'replaced'\n")  # the same name and version, other bytes


def test_a_rerun_installs_the_bytes_its_run_signed_from_the_cache_or_refuses_the_file_the_index_replaced(
        private_signer, index, tmp_path):
    from tkbox_nb.audit.replay import rerun
    home, name = private_signer.home, "tinypkg-1.0-py3-none-any.whl"
    index.add_file("simple/.cache-control", PYPI_PAGES)
    with Box(backend="bwrap", policy=policy(index), home=home, bundle_path=tmp_path / "a.tkb") as b:
        assert pip(b, "tinypkg").exit_code == 0
        b.run(["python", "-c", "import tinypkg; print(tinypkg.VALUE)"])
    publish(index, "tinypkg", name, REPLACED)  # the index moved on: its page now states the new bytes' sha256

    def outs(path):
        run = open_run(path)
        return [run.content(c.result["stdout"]) for c in run.crossings() if c.door == "exec"]

    rerun(tmp_path / "a.tkb", tmp_path / "kept.tkb", home=home, backend="bwrap")  # the host cache has the bytes
    page, file = package_rows(tmp_path / "kept.tkb")
    assert page.decision == "allow" and page.args["source"] == "cache"  # the page kept by the original, still fresh
    assert (file.decision, file.args["source"], file.args["pinned"], file.args["got_sha256"]) == (
        "allow", "cache", sha(TINY), sha(TINY))
    assert outs(tmp_path / "kept.tkb")[-1] == b"42\n"
    assert verify_bundle(tmp_path / "kept.tkb", trust_path(home)).valid

    shutil.rmtree(home / "packages" / "files")  # the host cache cleared
    rerun(tmp_path / "a.tkb", tmp_path / "gone.tkb", home=home, backend="bwrap")  # fetched again: other bytes
    page, file = package_rows(tmp_path / "gone.tkb")
    assert page.decision == "allow"
    assert (file.decision, file.args["rule"], file.args["source"]) == ("deny", "packages.rerun", "index")
    assert file.args["got_sha256"] == sha(REPLACED) and file.args["pinned"] == sha(TINY)
    why = file.args["verdict_reason"]
    assert "\n" not in why and why.startswith(name) and sha(TINY) in why and file.rule_ids
    assert outs(tmp_path / "gone.tkb")[-1] == b""  # nothing installed: the import prints nothing
    assert not (home / "packages" / "files" / sha(REPLACED)[:2] / sha(REPLACED)).exists()
    assert verify_bundle(tmp_path / "gone.tkb", trust_path(home)).valid


def test_a_file_on_a_file_host_that_resolves_to_loopback_is_refused_signed_and_never_connected_to(
        signer, index, tmp_path, loopback_listener):
    port = loopback_listener.getsockname()[1]  # loop.tkb.test answers 127.0.0.1 from the test network's dnsmasq
    fresh = sha(os.urandom(32))  # no cache holds it: the door must fetch it
    index.add_file("simple/loopfile/index.html", (
        f'<a href="http://loop.tkb.test:{port}/files/loopfile-1.0-py3-none-any.whl#sha256={fresh}">x</a>').encode())
    hosts = Policy.from_toml(f'[packages]\nindex = ["http://{index.web}:8080/simple/"]\nallow = ["loopfile"]\n'
                             f'file_hosts = ["loop.tkb.test:{port}"]\nnameservers = ["{index.web}"]\n{OPEN_TEST_NET}')
    with Box(backend="bwrap", policy=hosts, bundle_path=tmp_path / "l.tkb") as b:
        assert pip(b, "loopfile").exit_code != 0
    with pytest.raises(socket.timeout):
        loopback_listener.accept()
    page, file = package_rows(tmp_path / "l.tkb")
    assert page.decision == "allow" and page.args["host"] == index.web and page.args["address"] == index.web
    assert (file.decision, file.args["rule"], file.args["host"], file.args["addresses"]) == (
        "deny", "packages.always", "loop.tkb.test", ["127.0.0.1"])
    assert "127.0.0.1 is loopback" in file.args["verdict_reason"] and file.args["size"] == 0
    assert verify_bundle(tmp_path / "l.tkb").valid


SDIST_NAME, SDIST = sdist("Src_Pkg", "1.0", "VALUE = 7\n")  # src_pkg-1.0.tar.gz, the project src-pkg
BACKEND_NAME, BACKEND = backend_wheel()  # its build requirement, tkbox-test-backend


def test_an_sdist_crosses_like_a_wheel_its_build_backend_too_and_a_rerun_builds_the_same_bytes(
        private_signer, index, tmp_path):
    """pip builds an sdist in an isolated environment (its default, what `%pip install` does) and asks the door for
    the build requirement the sdist names: both files are decided, hashed, signed, kept and served; the wheel pip
    builds in the box never crosses (it is made there). A rerun after the index replaced the sdist (same name,
    other bytes) builds from the bytes the run signed, kept in the host cache."""
    from tkbox_nb.audit.replay import rerun
    home = private_signer.home
    publish(index, "src-pkg", SDIST_NAME, SDIST)  # linked with data-requires-python, as PyPI does
    publish(index, "tkbox-test-backend", BACKEND_NAME, BACKEND)
    both = Policy.from_toml(f'[packages]\nindex = ["http://{index.web}:8080/simple/"]\n{OPEN_TEST_NET}'
                            'allow = ["Src_Pkg", "tkbox_test_backend"]\n')
    with Box(backend="bwrap", policy=both, home=home, bundle_path=tmp_path / "s.tkb") as b:
        cell = b.execute("%pip install Src_Pkg\nimport src_pkg\nprint('value', src_pkg.VALUE, src_pkg.__file__)")
        text = "".join(o.get("text", "") for o in cell.outputs)
        assert cell.status == "ok" and "value 7 /tmp/tkbox-site-packages/src_pkg/__init__.py" in text, cell.outputs
    rows = package_rows(tmp_path / "s.tkb")
    assert [(c.args["kind"], c.args["project"], c.decision) for c in rows] == [
        ("project", "src-pkg", "allow"), ("file", "src-pkg", "allow"),
        ("project", "tkbox-test-backend", "allow"), ("file", "tkbox-test-backend", "allow")]
    source = rows[1]
    assert (source.args["filename"], source.args["version"], source.args["sha256"], source.args["got_sha256"],
            source.args["size"], source.args["source"]) == (SDIST_NAME, "1.0", sha(SDIST), sha(SDIST), len(SDIST),
                                                            "index")
    assert source.rule_ids == [] and source.result["bytes"] == len(SDIST)
    assert (private_signer.home / "packages" / "files" / sha(SDIST)[:2] / sha(SDIST)).read_bytes() == SDIST
    assert verify_bundle(tmp_path / "s.tkb", trust_path(home)).valid
    run = open_run(tmp_path / "s.tkb")
    assert run.installs[["kind", "project", "version", "filename", "sha256", "decision"]].values.tolist() == [
        ["file", "src-pkg", "1.0", SDIST_NAME, sha(SDIST), "allow"],
        ["file", "tkbox-test-backend", "1.0", BACKEND_NAME, sha(BACKEND), "allow"]]
    env = run.environment
    assert env[env["kind"] == "installed"][["name", "version", "location", "digest"]].values.tolist()[0] == [
        "src-pkg", "1.0", SDIST_NAME, f"sha256:{sha(SDIST)}"]

    publish(index, "src-pkg", SDIST_NAME, sdist("Src_Pkg", "1.0", "VALUE = 8\n")[1])  # the index moved on
    rerun(tmp_path / "s.tkb", tmp_path / "again.tkb", home=home, backend="bwrap")
    again = [c for c in package_rows(tmp_path / "again.tkb") if c.args["kind"] == "file"]
    assert [(c.args["filename"], c.decision, c.args["source"], c.args["pinned"], c.args["got_sha256"])
            for c in again] == [(SDIST_NAME, "allow", "cache", sha(SDIST), sha(SDIST)),
                                (BACKEND_NAME, "allow", "cache", sha(BACKEND), sha(BACKEND))]
    cell = next(c for c in open_run(tmp_path / "again.tkb").crossings() if c.door == "exec")
    assert b"value 7" in open_run(tmp_path / "again.tkb").content(cell.result["outputs"])
    assert verify_bundle(tmp_path / "again.tkb", trust_path(home)).valid


def test_replay_shows_what_the_door_let_in_under_the_cell_or_command_that_asked_for_it(
        private_signer, index, tmp_path):
    """A real box: a cell that installs nothing, a cell whose `%pip install` brings tinypkg through the door, a
    command whose pip is refused bigpkg (over max_file_bytes). `tkbox replay` writes each under the cell or command
    during which pip asked: project, version, file, sha256, the index it came from, or the refusal's rule."""
    import nbformat
    home = private_signer.home
    with Box(backend="bwrap", policy=policy(index), home=home, bundle_path=tmp_path / "r.tkb") as b:
        assert b.execute("x = 1").status == "ok"
        assert b.execute("%pip install tinypkg\nimport tinypkg").status == "ok"
        assert pip(b, "bigpkg").exit_code != 0
    r = run_cli("replay", str(tmp_path / "r.tkb"), "-o", str(tmp_path / "r.ipynb"), "--trust", str(trust_path(home)))
    assert r.returncode == 0, r.stderr
    nb = nbformat.read(tmp_path / "r.ipynb", as_version=4)
    kinds = [("installs" if "tkbox-installs" in c.metadata.get("tags", []) else c.cell_type) for c in nb.cells]
    assert kinds == ["markdown", "code", "code", "installs", "markdown", "installs"], kinds
    tiny, big = nb.cells[3], nb.cells[5]
    url = f"http://{index.web}:8080/simple/"
    assert "%pip install tinypkg" in nb.cells[2].source and "pip install --no-color bigpkg" in nb.cells[4].source
    assert tiny.source.startswith("Package door, during the cell above")
    assert f"- `tinypkg` `1.0`: `tinypkg-1.0-py3-none-any.whl`, sha256 `{sha(TINY)}` from `{url}` (`index`): " \
           "installed" in tiny.source
    assert [(i["project"], i["version"], i["sha256"], i["index"], i["decision"]) for i in
            tiny.metadata["tkbox"]["installs"]] == [("tinypkg", "1.0", sha(TINY), url, "allow")]
    assert big.source.startswith("Package door, during the command above")
    assert f"`bigpkg` `1.0`: `bigpkg-1.0-py3-none-any.whl`, sha256 `{sha(BIG)}`" in big.source
    assert "refused (`packages.max_file_bytes`)" in big.source


def test_a_kept_page_is_served_only_fresh_and_whole_else_the_index_is_asked(private_signer, index, tmp_path):
    """A kept page younger than the index's max-age and page_max_age_s is served without asking the index;
    page_max_age_s = 0 asks each time; an older one is fetched again; an index that says no-cache is asked each time;
    an entry changed on the host's disk is never served; an index that cannot be reached is answered from the page
    last kept, however old."""
    home = private_signer.home
    index.add_file("simple/.cache-control", PYPI_PAGES)

    def install(name: str, max_age: float | None = None):
        extra = f"page_max_age_s = {max_age}\n" if max_age is not None else ""
        pol = Policy.from_toml(f'[packages]\nindex = ["http://{index.web}:8080/simple/"]\n{OPEN_TEST_NET}'
                               f'allow = ["tinypkg"]\n{extra}')
        with Box(backend="bwrap", policy=pol, home=home, bundle_path=tmp_path / f"{name}.tkb") as b:
            r = pip(b, "tinypkg")
            assert r.exit_code == 0, r.stdout.decode() + r.stderr.decode()
        assert verify_bundle(tmp_path / f"{name}.tkb", trust_path(home)).valid
        page, file = package_rows(tmp_path / f"{name}.tkb")
        assert page.decision == file.decision == "allow" and file.args["got_sha256"] == sha(TINY)
        return page.args

    first = install("first")
    assert first["source"] == "index" and "fetched_at" not in first
    [entry] = (home / "packages" / "pages").glob("*.page")
    data = entry.read_bytes()
    entry.write_bytes(data[:-20] + b"x" + data[-19:])  # one byte of the kept page changed on the host's disk
    corrupted = install("corrupted")
    assert corrupted["source"] == "index" and corrupted["page_sha256"] == first["page_sha256"]
    assert install("fresh")["source"] == "cache"  # the entry written again, whole
    assert install("always", max_age=0)["source"] == "index"
    time.sleep(1.1)  # older than a max age of 1 s: stale, fetched again
    stale = install("stale", max_age=1)
    assert stale["source"] == "index" and "index_unreachable" not in stale
    index.add_file("simple/.cache-control", b"no-cache")  # as an index that states no max-age: pip asks each time
    assert install("told", max_age=0)["source"] == "index"
    unstated = install("unstated")
    assert unstated["source"] == "index" and unstated["index_max_age_s"] == 0
    web = index.procs[0]  # the index gone: the page last kept is served however old, and the record says why
    os.killpg(web.pid, signal.SIGKILL)
    web.wait(timeout=10)
    down = install("down")
    assert down["source"] == "cache" and down["index_unreachable"] and down["page_sha256"] == first["page_sha256"]


def test_a_page_kept_under_one_policy_s_nameservers_is_never_served_to_a_box_that_resolves_otherwise(
        private_signer, index, tmp_path):
    """web.tkb.test resolves only at the policy's nameserver (the test namespace's): a box under that policy keeps
    its page; a box of the same home naming the same index URL with the system resolver (which does not know the
    name) is not served that page from the cache, fresh as it is, nor as the page last kept when its index cannot be
    reached: its page is its own resolver's, and it has none, refused and signed."""
    home = private_signer.home
    index.add_file("simple/.cache-control", PYPI_PAGES)
    url = 'index = ["http://web.tkb.test:8080/simple/"]\nallow = ["tinypkg"]\n'
    named = Policy.from_toml(f'[packages]\n{url}nameservers = ["{index.web}"]\n{OPEN_TEST_NET}')
    with Box(backend="bwrap", policy=named, home=home, bundle_path=tmp_path / "named.tkb") as b:
        assert pip(b, "tinypkg").exit_code == 0
    assert package_rows(tmp_path / "named.tkb")[0].args["source"] == "index"
    system = Policy.from_toml(f'[packages]\n{url}{OPEN_TEST_NET}')
    with Box(backend="bwrap", policy=system, home=home, bundle_path=tmp_path / "system.tkb") as b:
        assert pip(b, "tinypkg").exit_code != 0
    [page] = package_rows(tmp_path / "system.tkb")
    assert page.decision == "deny" and page.args.get("source") != "cache", page.args
    assert "no page for tinypkg is kept" in page.args["index_error"] or page.args.get("host_error"), page.args
    with Box(backend="bwrap", policy=named, home=home, bundle_path=tmp_path / "again.tkb") as b:
        assert pip(b, "tinypkg").exit_code == 0  # the policy that kept it is served it from the cache
    assert package_rows(tmp_path / "again.tkb")[0].args["source"] == "cache"
