"""The secrets door's scrubber against the spellings common servers write a value back in (fuzz/echoes.py): Go's
encoding/json, .NET's System.Text.Json, HTML templates and character references, percent and form encoding, a latin-1
WSGI server, and these mixed; as a pure function, and end to end through the door's relay to an HTTPS echo."""

from __future__ import annotations

import base64
import re

import pytest

from fuzz.echoes import ECHOES, PAIRS, mixed
from tkbox_nb.rules.secrets import MIN_VALUE_BYTES, Scrubber, value_problem

VALUE = 'sk-live+&<>"\u00e9\u4e2d\U0001f600/0123456789'   # + & < > " and non-ASCII (a character beyond the BMP too)


def _through(scrubber: Scrubber, data: bytes, step: int) -> bytes:
    return b"".join(scrubber.feed(data[i:i + step]) for i in range(0, len(data), step)) + scrubber.flush()


@pytest.mark.parametrize("style", sorted(ECHOES))
def test_an_echo_in_each_common_server_s_spelling_is_starred_wherever_the_reads_split_it(style):
    """Only Python's json.dumps spellings were listed: Go's `\\u0026`, .NET's `\\u002B`, HTML's `&amp;` or `&#43;`,
    and UTF-8 read as latin-1 carried the value into the box. Now every byte of the echo is starred, length kept."""
    echoed = ECHOES[style](VALUE)
    data = b'{"you sent": "' + echoed + b'", "ok": true}'
    for step in (1, 2, 5, 13, len(data)):
        out = _through(Scrubber([VALUE]), data, step)
        assert out == b'{"you sent": "' + b"*" * len(echoed) + b'", "ok": true}', (style, step, out)


@pytest.mark.parametrize("pair", PAIRS)
def test_one_echo_mixing_spellings_character_by_character_is_starred(pair):
    """JSON in an HTML page writes `\\u003c` and `&quot;` side by side: each two escapings mixed are read as one."""
    for seed in range(40):
        picks = bytes((seed * 7 + i * 13) % 251 for i in range(32))
        echoed = mixed(VALUE, picks, pair)
        out = _through(Scrubber([VALUE]), b"<p>" + echoed + b"</p>", 1 + seed % 9)
        assert out == b"<p>" + b"*" * len(echoed) + b"</p>", (picks, echoed)


@pytest.mark.parametrize("lead", ["\\", "%", "&", "&#", "\\u00"])
def test_an_escape_character_the_box_puts_before_the_value_does_not_hide_it(lead):
    """The box writes the bound header around its placeholder: a `\\` or `%` just before the value makes a decoder
    read the value's first characters as an escape. Each escape family reads the stream from its own position, so
    the raw echo and each server's spelling (which escapes the box's escape character too) are still found."""
    value = "41&amp;u0026-x0123456789"
    for style in ("raw", "go-json", "html-template", "percent", "dotnet-json"):
        echoed = ECHOES[style](lead + value)
        out = Scrubber([value]).scrub(b"[" + echoed + b"]")
        assert value.encode() not in out
        spelled = ECHOES[style](value)
        assert spelled not in out, (style, out)


def test_a_value_of_the_least_length_is_found_in_base64_at_every_offset():
    """A value of 6 bytes or fewer had a base64 core under 8 characters at some offset the box chooses (`user:` in
    a Basic header), which was not scrubbed; such values are now refused where they enter, and the shortest allowed
    is found at every offset."""
    assert value_problem("abcdef") and not value_problem("abcdefg") and MIN_VALUE_BYTES == 7
    for value in ("abcdefg", "\u00e9\u00e9\u00e9x"):
        for lead in range(6):
            for encode in (base64.b64encode, base64.urlsafe_b64encode):
                text = encode(b"u" * lead + value.encode())
                out = Scrubber([value]).scrub(b"Basic " + text)
                core = [c for c in re.findall(rb"[A-Za-z0-9+/_-]+", text)]
                assert b"*" * 8 in out and out != b"Basic " + text, (value, lead, core)


def test_the_scrubber_keeps_unrelated_text_whole_and_holds_back_little_of_a_stream():
    """Text dense with escapes but holding no value passes byte for byte, and a stream is held back only by what
    could still begin a match: at most the longest spelling's worth of escapes (6 bytes each here) and one escape."""
    from tkbox_nb.rules.scrubber import MAX_TOKEN
    text = ('{"html": "<p>&amp; caf\u00e9 %41 \\u0041</p>", "form": "a+b%20c"}' * 200).encode()
    scrubber = Scrubber([VALUE])
    fed = got = 0
    out = []
    for i in range(0, len(text), 100):
        out.append(scrubber.feed(text[i:i + 100]))
        fed, got = fed + len(text[i:i + 100]), got + len(out[-1])
        assert fed - got <= 6 * scrubber.longest + MAX_TOKEN + 100, (fed, got)
    assert b"".join(out) + scrubber.flush() == text and len(text) > 20 * (6 * scrubber.longest + MAX_TOKEN)


@pytest.mark.parametrize("style", ["go-json", "dotnet-json", "html-template", "html-numeric", "latin1-wsgi",
                                   "latin1-wsgi-json"])
def test_an_echo_in_a_common_server_s_spelling_through_the_door_is_starred(style, tmp_path):
    """End to end: the value goes in the bound header of an HTTPS request through the door's relay; the bound host
    (Go-, .NET-, HTML-templated or a latin-1 WSGI app) writes it back; the box reads only stars."""
    from tests.bound_relay import HOST, Binding, Upstream, relay

    def echo(head: bytes) -> bytes:
        sent = re.search(rb"(?im)^authorization: Bearer (.*?)\r$", head).group(1)
        if style.startswith("latin1"):  # the WSGI server reads the header as latin-1; the app writes that str back
            text = sent.decode("latin-1")
            spelled = ECHOES["python-json"](text) if style.endswith("json") else text.encode("utf-8")
        else:
            spelled = ECHOES[style](sent.decode("utf-8"))
        body = b'{"authorization": "Bearer ' + spelled + b'"}'
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body

    upstream = Upstream(tmp_path, echo)
    bound = Binding("API_KEY", [HOST], "Authorization", "Bearer {value}", "env:X", value=VALUE)
    out = relay(upstream, lambda b: (f"GET /echo HTTP/1.1\r\nHost: {HOST}:{upstream.port}\r\n"
                                     f"Authorization: {b.placeholder}\r\n\r\n").encode(), bindings=[bound])
    assert VALUE.encode() in upstream.seen[-1]  # swapped: the bound host got the value itself
    head, _, body = out.read.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), out.read
    expected = ECHOES[style](VALUE)
    assert body == b'{"authorization": "Bearer ' + b"*" * len(expected) + b'"}', body
