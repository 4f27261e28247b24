"""The secrets door's pure checks on the bytes it relays: which response codings the scrubber can read, the request
headers a bound host gets about codings, and placeholders found in a plain-HTTP body however it is split."""

from __future__ import annotations

import base64
import gzip
import json
from urllib.parse import quote, quote_plus

import pytest

from tkbox_nb.doors.intercept import identity_only, unscrubbable_coding
from tkbox_nb.doors.secrets import MIN_ENCODED_FORM, Scrubber, encoded_forms

VALUE = "sk-live-" + "7f3a9c" * 6


def test_a_gzipped_echo_carries_the_value_past_a_scrubber_of_raw_bytes():
    """Why the door refuses what it cannot read: scrubbing gzip's bytes finds nothing, and the box could inflate it."""
    echoed = gzip.compress(b"Authorization: Bearer " + VALUE.encode())
    scrubber = Scrubber([VALUE])
    passed = scrubber.feed(echoed) + scrubber.flush()
    assert VALUE.encode() in gzip.decompress(passed)


def test_the_box_s_accept_encoding_is_replaced_by_identity():
    sent = [(b"Host", b"api"), (b"Accept-Encoding", b"gzip, br"), (b"accept-encoding", b"zstd"), (b"X", b"y")]
    assert identity_only(sent) == [(b"Host", b"api"), (b"X", b"y"), (b"accept-encoding", b"identity")]
    assert identity_only([(b"Host", b"api")]) == [(b"Host", b"api"), (b"accept-encoding", b"identity")]


@pytest.mark.parametrize("headers", [[], [(b"content-encoding", b"identity")], [(b"Content-Encoding", b"")],
                                     [(b"transfer-encoding", b"chunked")], [(b"content-type", b"application/gzip")]])
def test_a_response_the_scrubber_can_read(headers):
    assert unscrubbable_coding(headers) == ""


@pytest.mark.parametrize("headers, named", [
    ([(b"content-encoding", b"gzip")], "Content-Encoding: gzip"),
    ([(b"Content-Encoding", b"GZIP")], "Content-Encoding: gzip"),
    ([(b"content-encoding", b"identity, br")], "Content-Encoding: identity, br"),
    ([(b"content-encoding", b"identity"), (b"content-encoding", b"deflate")], "Content-Encoding: identity, deflate"),
    ([(b"content-encoding", b"zstd")], "Content-Encoding: zstd"),
    ([(b"transfer-encoding", b"gzip, chunked")], "Transfer-Encoding: gzip, chunked"),
    ([(b"transfer-encoding", b"identity")], "Transfer-Encoding: identity"),
])
def test_a_response_in_any_other_coding_is_named(headers, named):
    assert unscrubbable_coding(headers) == named


def _bindings():
    from tkbox_nb.doors.secrets import Binding
    return [Binding("API_KEY", ["api.tkb.test"], "Authorization", "Bearer {value}", "env:X"),
            Binding("OTHER", ["other.example"], "X-Key", "{value}", "env:Y")]


def test_a_placeholder_in_a_plain_http_body_is_found_wherever_the_pieces_split_it():
    from tkbox_nb.doors.secrets import PlaceholderWatch
    api, other = _bindings()
    body = b"x" * 70 + api.placeholder.encode() + b"y" * 5 + other.placeholder.encode() + b"z" * 3
    for cut in range(1, len(body)):
        for second in (cut, min(len(body), cut + 7)):
            watch = PlaceholderWatch("api.tkb.test", [api, other])
            found = watch.feed(body[:cut]) + watch.feed(body[cut:second]) + watch.feed(body[second:])
            assert found == [("API_KEY", "body (plain http)"), ("OTHER", "body (plain http) to api.tkb.test")]
    one_by_one = PlaceholderWatch("api.tkb.test", [api, other])
    assert [f for i in range(len(body)) for f in one_by_one.feed(body[i:i + 1])] == \
        [("API_KEY", "body (plain http)"), ("OTHER", "body (plain http) to api.tkb.test")]
    again = PlaceholderWatch("api.tkb.test", [api])
    assert again.feed(api.placeholder.encode()) and not again.feed(api.placeholder.encode())  # each named once
    assert PlaceholderWatch("api.tkb.test", [api]).feed(api.placeholder.encode()[:-1] + b"!") == []


ECHOES = {
    "raw": lambda v: v.encode(),
    "json, ascii": lambda v: json.dumps({"token": v}).encode(),
    "json, utf-8, slash escaped": lambda v: json.dumps(v, ensure_ascii=False).replace("/", "\\/").encode(),
    "percent-encoded": lambda v: ("q=" + quote(v, safe="")).encode(),
    "percent-encoded, lower hex": lambda v: quote_plus(v, safe="").lower().encode(),
    "basic auth echoed": lambda v: b"Basic " + base64.b64encode(b"user:" + v.encode()),
    "base64url in a field": lambda v: b'{"b": "' + base64.urlsafe_b64encode(b"xy" + v.encode() + b"z") + b'"}',
    "hex": lambda v: v.encode().hex().encode(),
    "HEX": lambda v: v.encode().hex().upper().encode(),
}


@pytest.mark.parametrize("value", [VALUE, "p/ss+w0rd=ünïcode?&", "short-ish"])
@pytest.mark.parametrize("spelling", sorted(ECHOES))
def test_an_echoed_value_is_scrubbed_in_its_common_spellings_wherever_the_reads_split_it(value, spelling):
    """A bound host echoing the value back (a debug endpoint, an error page, a Basic header decoded and re-encoded)
    writes it in its own spelling; each is starred, length kept, however the response is cut."""
    echoed = b"before " + ECHOES[spelling](value) + b" after"
    for step in (1, 3, 7, len(echoed)):
        scrubber = Scrubber([value])
        out = b"".join(scrubber.feed(echoed[i:i + step]) for i in range(0, len(echoed), step)) + scrubber.flush()
        assert len(out) == len(echoed)
        assert out.startswith(b"before ") and out.endswith(b" after")
        for form in encoded_forms(value):
            assert form not in out, form
        assert value.encode() not in out and value.encode().hex().encode() not in out.lower()


def test_bytes_that_merely_resemble_a_spelling_pass_unchanged():
    """Derived spellings shorter than MIN_ENCODED_FORM are not scrubbed, so a short value does not star unrelated
    base64 or hex; its raw bytes still are."""
    assert all(len(f) >= MIN_ENCODED_FORM for f in encoded_forms("abc") if f != b"abc")
    scrubber = Scrubber(["abc"])
    text = b"YWJj 616263 abc"
    assert scrubber.feed(text) + scrubber.flush() == b"YWJj 616263 ***"
