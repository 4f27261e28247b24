"""The package door's pure parts: the index page reader (rules/package_index.py) and the [packages] section
(policy/packages.py), on the pages and policies a user or a hostile index would give."""

from __future__ import annotations

import json

import pytest

from tkbox_nb import Policy
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.rules.addresses import refused_name
from tkbox_nb.rules.package_index import (IndexFile, IndexPageError, file_request, file_version, parse_html, parse_json,
                                          parse_page, pin_files, project_of, render_page)

PAGE = "http://198.18.37.2:8080/simple/tinypkg/"
A, B = "a" * 64, "B" * 64


def link(href: str, extra: str = "") -> bytes:
    return f'<!DOCTYPE html><html><body><a href="{href}"{extra}>x</a></body></html>'.encode()


def test_a_pep_503_page_gives_its_wheels_and_sdists_with_their_hashes_and_leaves_out_the_rest():
    page = (f'<a href="../../files/tinypkg-1.0-py3-none-any.whl#sha256={A}" data-requires-python="&gt;=3.8">w</a>'
            f'<a href="tinypkg-1.0.tar.gz#sha256={B}" data-yanked="broken">s</a>'
            f'<a href="tinypkg-1.0.win32.exe#sha256={A}">an installer</a>'
            f'<a href="otherpkg-1.0.tar.gz#sha256={A}">another project</a><a name="no-href"></a>').encode()
    files = parse_html(page, "tinypkg", PAGE)
    assert [(f.filename, f.url, f.sha256, f.requires_python, f.yanked) for f in files] == [
        ("tinypkg-1.0-py3-none-any.whl", "http://198.18.37.2:8080/files/tinypkg-1.0-py3-none-any.whl", A, ">=3.8",
         None),
        ("tinypkg-1.0.tar.gz", PAGE + "tinypkg-1.0.tar.gz", B.lower(), "", "broken")]


@pytest.mark.parametrize("page, why", [
    (link(f"http://198.18.99.9:8080/tinypkg-1.0.tar.gz#sha256={A}"), "a link to a file on another host"),
    (link(f"http://198.18.37.2:9999/tinypkg-1.0.tar.gz#sha256={A}"), "a link to a file on another host"),
    (link(f"https://198.18.37.2/tinypkg-1.0.tar.gz#sha256={A}"), "a link to a file on another host"),
    (link("tinypkg-1.0.tar.gz"), "no sha256"),
    (link("tinypkg-1.0.tar.gz#md5=" + "a" * 32), "no sha256"),
    (link(f"tinypkg-1.0.tar.gz#sha256={A[:-1]}"), "no sha256"),
    (link(f"..%2Ftinypkg-1.0.tar.gz#sha256={A}"), "a file name the door does not take"),
    (link(f"tinypkg..1.0.tar.gz#sha256={A}"), "a file name the door does not take"),
    (link(f"x\\tinypkg-1.0.tar.gz#sha256={A}"), "backslash"),
    (link(f"ftp://198.18.37.2/tinypkg-1.0.tar.gz#sha256={A}"), "not plain http"),
    (link(f"http://user:pw@198.18.37.2:8080/tinypkg-1.0.tar.gz#sha256={A}"), "not plain http"),
    (link(f"tinypkg-1.0.tar.gz#sha256={A}", ' data-requires-python="&gt;=3.8\nX: y"'), "requires-python"),
    (link(f"tinypkg-1.0.tar.gz#sha256={A}") * 2, "listed twice"),
    (b"\xff<a>", "not UTF-8"),
])
def test_a_page_with_one_bad_link_is_refused_whole_in_one_line(page, why):
    with pytest.raises(IndexPageError, match=why) as e:
        parse_html(page, "tinypkg", PAGE)
    assert "\n" not in str(e.value)


def test_a_page_over_its_limit_is_refused_before_it_is_read():
    from tkbox_nb.rules import package_index
    with pytest.raises(IndexPageError, match="a page over"):
        parse_html(b" " * (package_index.MAX_PAGE_BYTES + 1), "tinypkg", PAGE)


def test_file_hosts_names_the_other_host_a_file_may_come_from():
    page = link(f"https://files.example.org/packages/tinypkg-1.0.tar.gz#sha256={A}")
    with pytest.raises(IndexPageError):
        parse_html(page, "tinypkg", "https://pypi.example.org/simple/tinypkg/")
    files = parse_html(page, "tinypkg", "https://pypi.example.org/simple/tinypkg/", ["files.example.org"])
    assert files[0].url == "https://files.example.org/packages/tinypkg-1.0.tar.gz"


def test_a_pep_691_json_page_and_its_bad_shapes():
    doc = {"meta": {"api-version": "1.1"}, "name": "TinyPkg", "files": [
        {"filename": "tinypkg-1.0.tar.gz", "url": "tinypkg-1.0.tar.gz", "hashes": {"sha256": A},
         "requires-python": ">=3.8", "yanked": True}]}
    files = parse_page(json.dumps(doc).encode(), "application/vnd.pypi.simple.v1+json", "tinypkg", PAGE)
    assert [(f.filename, f.sha256, f.requires_python, f.yanked) for f in files] == [
        ("tinypkg-1.0.tar.gz", A, ">=3.8", "")]
    for bad, why in ((b"[]", "meta.api-version"), (b"{", "not JSON"),
                     (json.dumps({**doc, "meta": {"api-version": "2.0"}}).encode(), "api-version"),
                     (json.dumps({**doc, "name": "other"}).encode(), "not 'tinypkg'"),
                     (json.dumps({**doc, "files": [{"filename": "x"}]}).encode(), "without a url"),
                     (json.dumps({**doc, "files": [{**doc["files"][0], "hashes": {"md5": "x"}}]}).encode(),
                      "no sha256"),
                     (json.dumps({**doc, "files": [{**doc["files"][0], "filename": "tinypkg-2.0.tar.gz"}]}).encode(),
                      "is not its URL's"),
                     (json.dumps({**doc, "files": [{**doc["files"][0], "yanked": 3}]}).encode(), "yanked")):
        with pytest.raises(IndexPageError, match=why):
            parse_json(bad, "tinypkg", PAGE)
    with pytest.raises(IndexPageError, match="content type"):
        parse_page(b"", "application/octet-stream", "tinypkg", PAGE)


def test_the_doors_page_links_each_file_on_the_door_by_its_hash_and_reads_back_the_same():
    page = (f'<a href="/f/tinypkg-1.0.tar.gz#sha256={A}" data-requires-python="&lt;4,&gt;=3.8" '
            f'data-yanked="a &quot;reason&quot;">x</a>').encode()
    files = parse_html(page, "tinypkg", PAGE)
    served = render_page("tinypkg", files)
    assert b"198.18.37.2" not in served and f"/files/{A}/tinypkg-1.0.tar.gz".encode() in served
    again = parse_html(served, "tinypkg", "http://127.0.0.1:3130/simple/tinypkg/")
    assert [(f.filename, f.sha256, f.requires_python, f.yanked) for f in again] == \
        [(f.filename, f.sha256, f.requires_python, f.yanked) for f in files]
    assert file_request(f"/files/{A}/tinypkg-1.0.tar.gz") == (A, "tinypkg-1.0.tar.gz")
    assert file_request(f"/files/{A}/..%2Fx") is None and file_request("/files/xyz/a.whl") is None


def test_names_in_pep_503_normal_form_and_versions_from_file_names():
    assert project_of("/simple/Tiny_Pkg.Extra/") == "tiny-pkg-extra"
    assert project_of("/simple/") is None and project_of("/simple/a/b/") is None and project_of("/x") is None
    assert file_version("tiny-pkg", "Tiny_Pkg-1.0.post1-py3-none-any.whl") == "1.0.post1"
    assert file_version("tiny-pkg", "tiny-pkg-2.0.tar.gz") == "2.0"
    assert file_version("tiny-pkg", "other-1.0.tar.gz") is None and file_version("tiny-pkg", "tiny-pkg.egg") is None


def test_an_sdist_s_version_is_what_follows_the_project_s_name_as_pip_reads_it():
    """An sdist's name is not split at its last `-` (a legacy name's version may hold one: `pkg-1.0-1.tar.gz`, which
    pip reads as 1.0-1, i.e. 1.0.post1) but where the part before it is the project's name in normal form; the door
    left such a file off the page it served, so pip could not install it."""
    assert file_version("pkg", "pkg-1.0-1.tar.gz") == "1.0-1"
    assert file_version("tiny-pkg", "Tiny.Pkg-1.0-1.zip") == "1.0-1"
    assert file_version("pkg-1", "pkg-1-2.0.tar.gz") == "2.0"  # the project's own `-` is not the version's
    assert file_version("src-pkg", "src_pkg-1.0.tar.gz") == "1.0" and file_version("pkg", "Pkg-1.0rc1.zip") == "1.0rc1"
    assert file_version("pkg", "pkg-.tar.gz") is None and file_version("pkg", "pkg.tar.gz") is None
    assert file_version("pkg", "pkg-1.0/x.tar.gz") is None and file_version("pkg", "pkgx-1.0.tar.gz") is None
    assert file_version("pkg", "pkg-1.0-1-py3-none-any.whl") == "1.0"  # a wheel's build tag is not its version
    page = f'<a href="../../files/pkg-1.0-1.tar.gz#sha256={A}">s</a>'.encode()
    assert [f.filename for f in parse_html(page, "pkg", "http://198.18.37.2:8080/simple/pkg/")] == ["pkg-1.0-1.tar.gz"]


POLICY = '[packages]\nindex = ["https://pypi.example.org/simple/"]\nallow = ["Scikit_Learn", "numpy*"]\n' \
         'deny = ["numpy-evil"]\nmax_file_bytes = 100\nmax_total_bytes = 150\n'


def decide(kind: str, **facts):
    return Policy.from_toml(POLICY).decide({"door": "packages", "kind": kind, **facts})


def test_projects_are_decided_by_name_in_normal_form_deny_first():
    assert decide("project", project="scikit-learn").rule == "packages.allow[0]"
    assert decide("project", project="numpy").allowed
    assert decide("project", project="numpy-evil").rule == "packages.deny[0]"
    assert decide("project", project="requests").rule == "packages.allow"
    assert decide("project", project="Scikit_Learn").rule == "packages.project"  # the door states normal form
    assert decide("project", project="numpy", index_error="a link to a file on another host").rule == \
        "packages.index_page"
    assert not Policy.default().decide({"door": "packages", "kind": "project", "project": "numpy"}).allowed


def test_a_file_is_decided_on_its_hash_its_size_and_the_runs_bytes():
    ok = {"project": "numpy", "sha256": A, "got_sha256": A, "size": 100, "run_bytes": 0}
    assert decide("file", **ok).allowed
    assert decide("file", **{**ok, "got_sha256": "b" * 64}).rule == "packages.hash"
    assert decide("file", **{**ok, "sha256": ""}).rule == "packages.hash"
    assert decide("file", **{**ok, "size": 101}).rule == "packages.max_file_bytes"
    assert decide("file", **{**ok, "run_bytes": 51}).rule == "packages.max_total_bytes"
    assert decide("file", **{**ok, "size": True}).rule == "packages.size"
    assert decide("file", **{**ok, "fetch_error": "timeout"}).rule == "packages.fetch"
    assert decide("what", **ok).rule == "packages.kind"


def test_the_host_the_door_reached_is_decided_on_its_name_and_every_address_of_its_lookup():
    """verify re-derives the door's refusal from the stated answer: one refused address refuses it, in any form."""
    ok = {"project": "numpy", "source": "index", "host": "pypi.example.org", "addresses": ["151.101.0.223"],
          "address": "151.101.0.223", "files": 1}
    assert decide("project", **ok).allowed
    for addresses, rule in ((["151.101.0.223", "127.0.0.1"], "packages.always"),
                            (["::ffff:169.254.169.254"], "packages.always"), (["10.1.2.3"], "packages.always"),
                            (["198.18.0.9"], "packages.special"), (["not an address"], "packages.resolve"),
                            ("151.101.0.223", "packages.resolve")):
        assert decide("project", **{**ok, "addresses": addresses}).rule == rule, addresses
    assert decide("project", **{**ok, "host": "metadata.google.internal"}).rule == "packages.always"
    assert decide("project", **{**ok, "address": "127.0.0.1"}).rule == "packages.resolve"  # dialled unchecked
    assert decide("project", **{k: v for k, v in ok.items() if k != "host"}).rule == "packages.host"
    opened = Policy.from_toml('[packages]\nindex = ["https://pypi.example.org/simple/"]\nallow = ["*"]\n'
                              'allow_cidrs = ["198.18.0.0/15", "127.0.0.0/8"]\n')
    facts = {"door": "packages", "kind": "project", **ok}
    assert opened.decide({**facts, "addresses": ["198.18.0.9"], "address": "198.18.0.9"}).allowed
    assert opened.decide({**facts, "addresses": ["127.0.0.1"], "address": "127.0.0.1"}).rule == "packages.always"


@pytest.mark.parametrize("host", ["localhost.", "metadata.google.internal.", "pkgs.localhost.", "LocalHost.",
                                  "localhost..", "x.metadata.internal."])
def test_a_stated_host_named_with_a_trailing_dot_is_refused_as_its_name_without_it(host):
    """`localhost.` is the fully-qualified spelling of `localhost` (resolvers read both alike): a bundle stating it
    as the host the door reached is refused by name, as `tkbox verify` re-derives the decision, and so is any case."""
    assert refused_name(host) is not None
    ok = {"project": "numpy", "source": "index", "host": host, "addresses": ["151.101.0.223"],
          "address": "151.101.0.223", "files": 1}
    assert decide("project", **ok).rule == "packages.always"
    assert refused_name("pypi.org.") is None and refused_name("notlocalhost.") is None


def test_a_rerun_is_offered_only_the_files_its_run_installed_and_refuses_other_bytes_naming_the_file():
    now = [IndexFile("numpy-2.0-py3-none-any.whl", "https://i.example/n2.whl", "b" * 64, ">=3.9"),
           IndexFile("numpy-2.1-py3-none-any.whl", "https://i.example/n21.whl", "c" * 64)]
    pinned = pin_files(now, {"numpy-2.0-py3-none-any.whl": A, "numpy-1.0.tar.gz": "d" * 64})
    assert pinned == [IndexFile("numpy-1.0.tar.gz", "", "d" * 64),  # on the page no more: the cache alone has it
                      IndexFile("numpy-2.0-py3-none-any.whl", "https://i.example/n2.whl", A, ">=3.9")]
    ok = {"project": "numpy", "filename": "numpy-2.0-py3-none-any.whl", "sha256": A, "got_sha256": A, "size": 1,
          "run_bytes": 0, "pinned": A}
    assert decide("file", **ok).allowed
    refused = decide("file", **{**ok, "got_sha256": "b" * 64})
    assert refused.rule == "packages.rerun" and refused.reason.startswith("numpy-2.0-py3-none-any.whl: ")
    assert decide("file", **{**ok, "pinned": "b" * 64}).rule == "packages.rerun"


def test_the_door_sends_each_request_to_the_checked_address_naming_the_host_in_host_and_sni():
    from tkbox_nb.doors.package_fetch import pinned_request
    assert pinned_request("https://pypi.example.org/simple/numpy/", "151.101.0.223") == (
        "https://151.101.0.223/simple/numpy/", {"Host": "pypi.example.org"}, {"sni_hostname": "pypi.example.org"})
    assert pinned_request("http://files.example.org:8080/f/x.whl?a=1", "2001:db8::5") == (
        "http://[2001:db8::5]:8080/f/x.whl?a=1", {"Host": "files.example.org:8080"}, {})
    assert pinned_request("https://[2001:db8::5]/simple/", "2001:db8::5")[1:] == ({"Host": "[2001:db8::5]"}, {})


@pytest.mark.parametrize("body, why", [
    ('index = ["pypi.org/simple"]', "must be an http:// or https:// URL"),
    ('index = ["https://user:token@pypi.example.org/simple/"]', "must not carry a user name or password"),
    ('index = ["https://pypi.example.org/simple/?x=1"]', "no query"),
    ('index = "https://pypi.example.org/simple/"', "packages.index must be a list"),
    ('allow = ["num py"]', "packages.allow entry"),
    ('file_hosts = ["https://files.example.org"]', "packages.file_hosts entry"),
    ("max_file_bytes = 0", "packages.max_file_bytes must be from 1"),
    ("max_total_bytes = -1", "packages.max_total_bytes must be from 1"),
    ("mirror = true", "unknown key packages.mirror"),
    ('allow_cidrs = ["198.18.0.0/33"]', "packages.allow_cidrs entry"),
    ('nameservers = ["dns.example.org"]', "packages.nameservers entry"),
])
def test_a_bad_packages_section_is_one_line_naming_it(body, why):
    with pytest.raises(PolicyError, match=why) as e:
        Policy.from_toml(f"[packages]\n{body}\n")
    assert "\n" not in str(e.value)
