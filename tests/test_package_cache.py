"""The package door's kept index pages (rules/package_cache.py, pure; doors/package_store.py on a real directory):
an entry is served only whole, untouched, of its own index and project, and fresh by `[packages] page_max_age_s`."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from tkbox_nb import Policy
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.doors.package_store import Cache
from tkbox_nb.rules.package_cache import (MAGIC, KeptPage, age_of, evictions, fresh, fresh_enough, index_max_age,
                                         page_key, seal, unseal)

KEY = b"k" * 32
INDEX = "http://198.18.37.2:8080/simple/"
PAGE = KeptPage(INDEX, "tinypkg", INDEX + "tinypkg/", "text/html", 1_700_000_000.25, b"<a href='x'>x</a>\n",
                {"host": "198.18.37.2", "addresses": ["198.18.37.2"], "address": "198.18.37.2", "other": "dropped"},
                600.0)


def test_a_sealed_page_reads_back_whole_with_what_the_door_stated_of_its_host():
    back = unseal(KEY, seal(KEY, PAGE), INDEX, "tinypkg")
    assert back is not None and back.body == PAGE.body and back.url == PAGE.url and back.fetched_at == PAGE.fetched_at
    assert back.content_type == "text/html" and back.sha256 == PAGE.sha256 and back.index_max_age == 600
    assert back.dialled == {"host": "198.18.37.2", "addresses": ["198.18.37.2"], "address": "198.18.37.2"}


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def test_an_entry_cut_short_changed_under_another_key_or_of_another_index_or_project_is_never_read():
    data = seal(KEY, PAGE)
    assert unseal(b"o" * 32, data, INDEX, "tinypkg") is None           # another key's (written by someone else)
    assert unseal(KEY, data, "http://198.18.37.3:8080/simple/", "tinypkg") is None  # another index's
    assert unseal(KEY, data, INDEX, "otherpkg") is None                # another project's
    assert unseal(KEY, data[:-1], INDEX, "tinypkg") is None            # cut short
    assert unseal(KEY, data + b"x", INDEX, "tinypkg") is None          # grown
    for at in range(0, len(data), 7):                                  # any one bit flipped, anywhere
        assert unseal(KEY, _flip(data, at), INDEX, "tinypkg") is None, at
    assert unseal(KEY, b"", INDEX, "tinypkg") is None
    assert unseal(KEY, MAGIC + b"0" * 64 + b"\n{}\n", INDEX, "tinypkg") is None


def test_two_indexes_or_urls_never_share_an_entry():
    keys = {page_key(i, p) for i in (INDEX, INDEX.rstrip("/"), "https://pypi.org/simple/", "http://a/\0b")
            for p in ("tinypkg", "b", "")}
    assert len(keys) == 12
    assert page_key("http://a/", "b\0c") != page_key("http://a/\0b", "c")  # no separator is ambiguous


def test_a_page_kept_under_one_policy_s_nameservers_is_never_read_under_others(tmp_path):
    """Where a page came from is decided by its index URL and by the nameservers that resolved its host: a page a
    policy with a hostile resolver kept (a rerun under a downloaded bundle's policy) is not another box's page. The
    entry's name and its sealed header both carry the sorted nameservers."""
    hostile = replace(PAGE, nameservers=("203.0.113.53",))
    data = seal(KEY, hostile)
    back = unseal(KEY, data, INDEX, "tinypkg", ("203.0.113.53",))
    assert back.body == PAGE.body and back.nameservers == ("203.0.113.53",)
    assert unseal(KEY, data, INDEX, "tinypkg") is None                     # the system resolver's box
    assert unseal(KEY, data, INDEX, "tinypkg", ("198.18.37.2",)) is None   # another resolver's
    assert unseal(KEY, seal(KEY, PAGE), INDEX, "tinypkg", ("203.0.113.53",)) is None
    assert page_key(INDEX, "tinypkg", ("9.9.9.9", "1.1.1.1")) == page_key(INDEX, "tinypkg", ("1.1.1.1", "9.9.9.9"))
    assert len({page_key(INDEX, "tinypkg"), page_key(INDEX, "tinypkg", ("1.1.1.1",)),
                page_key(INDEX, "tinypkg", ("9.9.9.9",)), page_key(INDEX, "tinypkg", ("1.1.1.1", "9.9.9.9"))}) == 4
    cache = Cache(tmp_path)
    cache.keep_page(hostile)
    assert cache.page(INDEX, "tinypkg") is None
    assert cache.page(INDEX, "tinypkg", ["203.0.113.53"]).body == PAGE.body  # kept, for the policy that asked


@pytest.mark.parametrize("fetched, now, max_age, want", [
    (1000.0, 1000.0, 600, True), (1000.0, 1599.9, 600, True), (1000.0, 1600.0, 600, False),  # stale at max age
    (1000.0, 1000.0, 0, False),       # 0: always ask the index
    (1000.0, 997.0, 600, True),       # a clock a little behind is believed
    (1000.0, 900.0, 600, False),      # a page "from the future": the clock went back
])
def test_a_page_is_fresh_while_younger_than_page_max_age_s(fetched, now, max_age, want):
    assert fresh(fetched, now, max_age) is want


@pytest.mark.parametrize("header, want", [
    ("max-age=600", 600), ("public, max-age=600", 600), ('Max-Age="30"', 30), ("max-age=600, max-age=5", 5),
    (None, 0), ("", 0), ("public", 0),            # no max-age stated: asked each time, as pip asks
    ("max-age=600, no-cache", 0), ("no-store, max-age=600", 0), ("max-age=-1", 0), ("max-age=1e9", 0),
    ("max-age=" + "9" * 12, 365 * 24 * 3600),     # read as a year: the policy's cap is far below
])
def test_the_index_s_max_age_is_read_as_pip_s_cache_reads_it(header, want):
    assert index_max_age(header) == want


def test_past_the_bound_the_oldest_pages_go_first():
    entries = [("c", 40, 3.0), ("a", 40, 1.0), ("b", 40, 2.0)]
    assert evictions(entries, 120) == []
    assert evictions(entries, 100) == ["a"]
    assert evictions(entries, 40) == ["a", "b"]


def test_the_host_cache_removes_an_entry_that_does_not_unseal_and_keeps_its_key(tmp_path):
    cache = Cache(tmp_path)
    cache.keep_page(PAGE)
    assert cache.page(INDEX, "tinypkg").body == PAGE.body
    assert (tmp_path / "page.key").stat().st_mode & 0o777 == 0o600
    path = cache.page_path(INDEX, "tinypkg")
    path.write_bytes(_flip(path.read_bytes(), len(path.read_bytes()) - 3))
    assert Cache(tmp_path).page(INDEX, "tinypkg") is None and not path.exists()
    Cache(tmp_path).keep_page(PAGE)
    assert Cache(tmp_path).page(INDEX, "tinypkg").body == PAGE.body  # the same key, read by a second door


@pytest.mark.parametrize("value", ["-1", "604801", "nan", "true", '"600"'])
def test_a_bad_page_max_age_is_one_policy_error(value):
    with pytest.raises(PolicyError, match="packages.page_max_age_s"):
        Policy.from_toml(f'[packages]\nindex = ["{INDEX}"]\npage_max_age_s = {value}\n')


def test_page_max_age_defaults_to_pip_s_600_seconds_and_0_is_allowed():
    assert Policy.from_toml(f'[packages]\nindex = ["{INDEX}"]\n').get("packages", "page_max_age_s") == 600
    assert Policy.from_toml(f'[packages]\nindex = ["{INDEX}"]\npage_max_age_s = 0\n').get(
        "packages", "page_max_age_s") == 0


def test_the_kept_pages_stay_under_their_bound_the_oldest_going_first(tmp_path):
    pages = [KeptPage(INDEX, project, INDEX + project + "/", "text/html", 1.0, PAGE.body) for project in "abc"]
    cache = Cache(tmp_path, max_page_bytes=2 * len(seal(KEY, pages[0])) + 10)  # room for two
    for page in pages:
        project = page.project
        cache.keep_page(page)
        os.utime(cache.page_path(INDEX, project), (time.time() - 100 + ord(project), time.time() - 100 + ord(project)))
    assert cache.page(INDEX, "a") is None and cache.page(INDEX, "b") and cache.page(INDEX, "c")
    assert len(list((tmp_path / "pages").iterdir())) == 2  # no temporary file left either


POLICY = f'[packages]\nindex = ["{INDEX}"]\nallow = ["tinypkg"]\nallow_cidrs = ["198.18.0.0/15"]\n'
# a page the door served from its host cache, as doors/packages.py states it (_kept_facts)
FROM_CACHE = {"door": "packages", "kind": "project", "project": "tinypkg", "index": INDEX, "files": 1,
              "host": "198.18.37.2", "addresses": ["198.18.37.2"], "address": "198.18.37.2", "address_class": "special",
              "source": "cache", "fetched_at": "2026-12-04T23:00:00.000+00:00", "age_s": 12.5,
              "index_max_age_s": 600.0, "page_max_age_s": 600, "page_sha256": "a" * 64, "served_sha256": "b" * 64}


@pytest.mark.parametrize("changed, rule", [
    ({}, "packages.allow[0]"),
    ({"age_s": 599.999}, "packages.allow[0]"),
    ({"age_s": 600.0}, "packages.page_age"),                                # stale by both
    ({"age_s": 300.0, "index_max_age_s": 120.0}, "packages.page_age"),      # stale by the index's max-age
    ({"age_s": 1.0, "index_max_age_s": 0.0}, "packages.page_age"),          # the index stated none: never kept
    ({"age_s": -60.0}, "packages.page_age"),                                # "from the future"
    ({"page_max_age_s": 86400}, "packages.page_max_age_s"),                 # judged under another policy's cap
    ({"age_s": "12"}, "packages.page_age"), ({"age_s": True}, "packages.page_age"),
    ({"index_max_age_s": None}, "packages.page_age"), ({"age_s": float("nan")}, "packages.page_age"),
    ({"age_s": 90_000.0, "index_unreachable": "ConnectError"}, "packages.allow[0]"),  # the last page, however old
    ({"source": "index", "age_s": 90_000.0}, "packages.allow[0]"),
])
def test_a_page_from_the_cache_is_decided_on_its_stated_age_by_the_door_s_own_rule(changed, rule):
    """tkbox verify re-derives a cached page's decision from its stated age, the index's max-age and the policy's
    page_max_age_s, by rules/package_cache.fresh_enough, the rule the door asked before it served the page."""
    assert Policy.from_toml(POLICY).decide({**FROM_CACHE, **changed}).rule == rule


def test_the_door_s_freshness_and_the_decision_s_are_one_rule_to_the_millisecond():
    """The age the door judges is the age it states (age_of, to the millisecond, rounded down), and the decision
    judges that same number by the same function: no age the door served can be refused by verify, nor one it
    would not serve allowed."""
    policy = Policy.from_toml(POLICY)
    for fetched, now in ((1000.0, 1599.9994), (1000.0, 1599.9995), (1000.0, 1600.0), (1000.0, 995.0),
                         (1000.0, 994.9999), (1_700_000_000.123, 1_700_000_599.1229)):
        age = age_of(fetched, now)
        served = fresh_enough(age, 600.0, 600)
        assert served == fresh(fetched, now, 600.0)
        assert policy.decide({**FROM_CACHE, "age_s": age}).allowed == served, (fetched, now, age)


class _PolicyBlindToAge(Policy):
    """A box policy whose code decides a cached page as if it came from the index, never reading its age (the door
    before its freshness rule was decided again): what verify must catch."""

    def decide(self, facts):
        if facts.get("door") == "packages":
            return super().decide({k: v for k, v in facts.items() if k not in ("source", "age_s")})
        return super().decide(facts)


def test_verify_refuses_a_run_whose_page_from_the_cache_was_stale_though_its_record_says_allowed(signer, tmp_path):
    """A real signed run: a page served from the cache 900 s old under page_max_age_s = 600, allowed by a policy
    blind to its age, is caught by tkbox verify re-deriving the decision from the disclosed policy; the same run
    with the page 12.5 s old verifies."""
    from tkbox_nb.bundle.verify import verify_bundle
    from tkbox_nb.signing.recorder import RunRecorder
    facts = {k: v for k, v in FROM_CACHE.items() if k not in ("door", "kind")}

    def run(name: str, **changed):
        rec = RunRecorder(signer, _PolicyBlindToAge.from_toml(POLICY), {"backend": "bwrap", "isolation": "none",
                                                                         "image_digest": "none"})
        rec.open()
        page = rec.decide("packages", "project", {**facts, **changed})
        assert page.allowed and page.args["rule"] == "packages.allow[0]"
        rec.complete(page, "ok", {"bytes": 100})
        rec.close("test done")
        return verify_bundle(rec.write_bundle(tmp_path / f"{name}.tkb"))

    assert run("fresh").valid
    stale = run("stale", age_s=900.0)
    assert not stale.valid and stale.first_failure.name == "re-derivation", stale.summary()
    assert "packages.page_age" in stale.first_failure.detail
    other_cap = run("other-cap", page_max_age_s=86400, age_s=900.0)
    assert not other_cap.valid and "packages.page_max_age_s" in other_cap.first_failure.detail
