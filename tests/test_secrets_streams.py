"""The secrets door's pure checks on the bytes it relays: which response codings the scrubber can read, the request
headers a bound host gets about codings, and placeholders found in a plain-HTTP body however it is split."""

from __future__ import annotations

import base64
import gzip
import json
from urllib.parse import quote, quote_plus

import pytest

from tkbox_nb.doors.intercept import identity_only, unscrubbable_coding
from tkbox_nb.rules.secrets import MIN_ENCODED_FORM, Scrubber, encoded_forms
from tkbox_nb.stream.events import Data

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
    from tkbox_nb.rules.secrets import Binding
    return [Binding("API_KEY", ["api.tkb.test"], "Authorization", "Bearer {value}", "env:X"),
            Binding("OTHER", ["other.example"], "X-Key", "{value}", "env:Y")]


def test_a_placeholder_in_a_plain_http_body_is_found_wherever_the_pieces_split_it():
    from tkbox_nb.rules.secrets import PlaceholderWatch
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
    "percent-encoded, python's default safe /": lambda v: ("q=" + quote(v)).encode(),
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


def test_a_value_percent_encoded_with_python_s_default_safe_slash_is_scrubbed():
    """urllib.parse.quote(v) keeps `/` by default: a value with a `/` echoed so was not among the spellings."""
    value = "p/ss+w0rd/with/slashes=1"
    echoed = quote(value).encode()
    scrubber = Scrubber([value])
    assert scrubber.feed(b"q=" + echoed + b"&") + scrubber.flush() == b"q=" + b"*" * len(echoed) + b"&"


def test_bytes_that_merely_resemble_a_spelling_pass_unchanged():
    """Derived spellings shorter than MIN_ENCODED_FORM are not scrubbed, so a short value does not star unrelated
    base64 or hex; its raw bytes still are."""
    assert all(len(f) >= MIN_ENCODED_FORM for f in encoded_forms("abc") if f != b"abc")
    scrubber = Scrubber(["abc"])
    text = b"YWJj 616263 abc"
    assert scrubber.feed(text) + scrubber.flush() == b"YWJj 616263 ***"


BAD_VALUES = {"a trailing space": "sk-live-SECRET-pasted ", "a leading tab": "\tsk-live-SECRET",
              "an escape": "sk-live-SECRET\x1bx", "a NUL": "sk-live\x00SECRET", "a line break": "sk-live\nSECRET",
              "DEL": "sk-live-SECRET\x7f", "a C1 control": "sk-live-SECRET\x85x", "a lone surrogate": "sk-\udcffSECRET",
              "a tab inside": "sk-live\tSECRET", "too short to scrub in base64": "sk-SEC",
              "too long": "sk-live-SECRET" + "x" * (16 * 1024)}


@pytest.mark.parametrize("what", sorted(BAD_VALUES))
def test_a_value_that_is_no_legal_header_value_is_refused_where_it_enters_naming_its_source(what, monkeypatch,
                                                                                            tmp_path):
    """h11 named such a value in its error ("Illegal header value b'...'"), which reached the box and the signed
    record (or let it go upstream as it was). Now every way a value enters refuses it first: read_value (env:,
    file:), a model key, the binding (the value and the header its format makes) and %box_secret; each error names
    the source, never the value."""
    from tkbox_nb.doors.model import _read_key
    from tkbox_nb.rules.secrets import Binding, check_binding, read_value
    from tkbox_nb.core.errors import PolicyError, TkboxError
    from tkbox_nb.box.notebook_box import HostMagics
    value = BAD_VALUES[what]
    readers = {"prompt": lambda: check_binding(Binding("K", ["h"], "Authorization", "{value}", "prompt", value=value)),
               "%box_secret": lambda: HostMagics(None, lambda prompt: value).run("box_secret", "K --host h")}
    if "\x00" not in value:  # no environment holds a NUL
        monkeypatch.setenv("TKB_TEST_VALUE", value)
        readers.update({"env": lambda: read_value("K", "env:TKB_TEST_VALUE"),
                        "model key": lambda: _read_key("openai", "env:TKB_TEST_VALUE"),
                        "%box_secret --env": lambda: HostMagics(None, None).run("box_secret",
                                                                               "K --host h --env TKB_TEST_VALUE")})
    if value.strip() == value:  # a file's value is read without the space around it
        (tmp_path / "v").write_bytes(value.encode("utf-8", "surrogateescape") + b"\n")
        readers["file"] = lambda: read_value("K", f"file:{tmp_path}/v")
    errors = {}
    for source, read in readers.items():
        with pytest.raises((PolicyError, TkboxError)) as e:
            read()
        errors[source] = str(e.value)
    assert errors["prompt"].startswith("secrets.K: the value from prompt ")
    assert errors["%box_secret"].startswith("%box_secret: secrets.K: the value from prompt ")
    if "env" in errors:
        assert errors["env"].startswith("secrets.K: the value from env:TKB_TEST_VALUE ")
        assert errors["model key"].startswith("models.openai.key: the value from env:TKB_TEST_VALUE ")
        assert "from env:TKB_TEST_VALUE" in errors["%box_secret --env"]
    if "file" in errors:
        assert f"{tmp_path}/v" in errors["file"]
    for text in errors.values():
        assert "SECRET" not in text and "\n" not in text


@pytest.mark.parametrize("format_", ["Bearer\t{value}", "{value} ", "{value}\r\nX-Evil: 1"])
def test_a_format_making_an_illegal_header_is_refused_when_bound(format_, monkeypatch):
    from tkbox_nb.doors.model import _read_key
    from tkbox_nb.rules.secrets import Binding, check_binding
    from tkbox_nb.core.errors import PolicyError, TkboxError
    from tkbox_nb.box.notebook_box import HostMagics
    with pytest.raises(PolicyError, match="Authorization header it makes"):
        check_binding(Binding("K", ["h"], "Authorization", format_, "env:K", value="sk-live-SECRET"))
    with pytest.raises(TkboxError, match="^%box_secret: --header must be one header name$"):
        HostMagics(None, lambda prompt: "v").run("box_secret", "K --host h --header 'X-A: b'")
    monkeypatch.setenv("TKB_TEST_KEY", "sk-clé-SECRET")
    with pytest.raises(PolicyError, match="^models.openai.key: the value from env:TKB_TEST_KEY is not ASCII$"):
        _read_key("openai", "env:TKB_TEST_KEY")


def test_an_error_on_a_path_holding_a_value_is_starred_in_any_spelling_python_writes_it():
    """error_text: what the egress and model doors say to the box and sign when an exception ends a connection that
    held values. h11's own error for a value it refuses is the case in point (the value repr'd, escapes and all)."""
    import h11

    from tkbox_nb.rules.secrets import error_text
    value = "sk-live-SECRET-pasted "
    with pytest.raises(h11.LocalProtocolError) as e:
        h11.Connection(h11.CLIENT).send(h11.Request(method="GET", target="/", headers=[
            ("Host", "a"), ("Authorization", value.encode("utf-8"))]))
    assert "SECRET" in str(e.value)  # what the door used to pass on
    said = error_text(e.value, [value])
    assert said == "LocalProtocolError: Illegal header value b'" + "*" * len(value) + "'"
    for value in ("sk-clé-SECRET\x01", "sk-live-SECRET\x85", "sk-live-SECRET"):
        said = error_text(ValueError(f"x {value!r} {value} {value.encode()} {value.encode()!r}"), ["other", value])
        assert said.startswith("ValueError: x ") and "SECRET" not in said


def test_a_value_the_door_could_not_send_never_reaches_the_box_or_the_signed_end(tmp_path):
    """A binding made past the checks (as the reviewer's was): the relay's error is signed with the value starred."""
    from tests.bound_relay import Upstream, binding, relay
    upstream = Upstream(tmp_path, lambda head: b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    b = binding()
    b.value = "sk-live-SECRET-with-trailing-space "
    out = relay(upstream, (f"GET / HTTP/1.1\r\nHost: api.tkb.test:{upstream.port}\r\n"
                           f"Authorization: {b.placeholder}\r\n\r\n").encode(), bindings=[b])
    out.thread.join(5)
    assert "SECRET" not in out.read.decode("latin-1") and "SECRET" not in repr(out.box.recorder.log)
    assert out.signed_end["error"].startswith("LocalProtocolError: Illegal header value b'Bearer ****")


def test_a_model_key_the_door_could_not_send_never_reaches_the_box_or_the_record(monkeypatch):
    """The model door's answer to the box and its signed result, when httpx refuses the key it was given."""
    from tests.bound_relay import FakeBox, FakeStream
    from tkbox_nb.guest import protocol as p
    from tkbox_nb.doors.model import ModelDoor
    from tkbox_nb.policy import Policy
    import socket
    listener = socket.socket()  # connected to, never answering: the request fails in httpx before it goes
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    monkeypatch.setenv("TKB_TEST_KEY", "sk-ant-legal")
    policy = Policy.from_toml('[models]\nallow = ["anthropic:*"]\n[models.anthropic]\n'
                              f'base_url = "http://127.0.0.1:{listener.getsockname()[1]}"\nkey = "env:TKB_TEST_KEY"\n')
    box = FakeBox(policy, [])
    door = ModelDoor(box)
    door._keys[("anthropic", "env:TKB_TEST_KEY")] = "sk-ant-SECRETKEY-with-a-trailing-space "  # past the checks
    body = b'{"model":"claude-x","max_tokens":5,"messages":[]}'
    stream = FakeStream()
    stream.events.put(Data(p.CH_BYTES, b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body))
    door._serve(stream)
    read = b"".join(iter(lambda: box.conn.out.get(timeout=1) or b"", b""))
    assert b"anthropic upstream: LocalProtocolError: Illegal header value b'****" in read
    assert b"SECRETKEY" not in read and "SECRETKEY" not in repr(box.recorder.log)
    listener.close()


@pytest.mark.parametrize("head, why", [
    (b"CONNECT api.tkb.test:443 HTTP/1.1\r\nHost: api.tkb.test\r\n\r\n", "CONNECT inside the TLS"),
    (b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", "Upgrade: websocket"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\nHTTP2-Settings: AAA\r\n\r\n", "Upgrade: h2c"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, UPGRADE\r\n\r\n", "a switch of protocols"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHTTP2-Settings: AAA\r\n\r\n", "a switch of protocols"),
])
def test_a_request_to_switch_protocols_inside_the_tls_to_a_bound_host_is_refused_501(head, why):
    """h11 pauses on CONNECT and on an Upgrade, and the relay spun on PAUSED at 100% CPU for good; nor could the
    scrubber read what follows a switch."""
    import h11

    from tkbox_nb.doors.intercept import Refused, read_request
    chunks = iter([head])
    with pytest.raises(Refused, match=why) as e:
        read_request(lambda: next(chunks, b""), h11.Connection(h11.SERVER))
    assert e.value.status == 501


@pytest.mark.parametrize("framing", [
    b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
])
def test_a_request_to_a_bound_host_framed_ambiguously_is_refused_400(framing):
    """CL.TE smuggling inside the TLS to a bound host: the second request hidden in the body would reach the bound
    host with no swap or scrub decided for it. (h11 itself refuses conflicting lengths and other codings.)"""
    import h11

    from tkbox_nb.doors.intercept import Refused, read_request
    smuggled = b"GET /admin HTTP/1.1\r\nHost: a\r\n\r\n"
    chunks = iter([b"POST / HTTP/1.1\r\nHost: a\r\n" + framing + b"\r\n" + b"%x\r\n" % len(smuggled) + smuggled
                   + b"\r\n0\r\n\r\n"])
    with pytest.raises(Refused, match="Content-Length|Transfer-Encoding") as e:
        read_request(lambda: next(chunks, b""), h11.Connection(h11.SERVER))
    assert e.value.status == 400


def test_hop_by_hop_headers_do_not_go_to_the_bound_host():
    from tkbox_nb.doors.intercept import end_to_end
    sent = [(b"Host", b"a"), (b"Connection", b"keep-alive, X-Hop"), (b"Keep-Alive", b"5"), (b"X-Hop", b"1"),
            (b"TE", b"trailers"), (b"Proxy-Authorization", b"x"), (b"Content-Length", b"3"), (b"X-End", b"2")]
    assert end_to_end(sent) == [(b"Host", b"a"), (b"Content-Length", b"3"), (b"X-End", b"2")]


def test_a_paused_or_switched_upstream_ends_the_relay_instead_of_spinning():
    """_relay_response on what h11 gives after a CONNECT's 2xx (PAUSED, again and again) and on a 101: it returns,
    or refuses the 101 as unscrubbable, in bounded time."""
    import threading

    import h11

    from tkbox_nb.doors.intercept import Unscrubbable, _relay_response

    class Upstream:
        def __init__(self, data):
            self.data = [data]

        def recv(self, n):
            return self.data.pop() if self.data else b""

    class ToBox:
        sent = b""

        def send(self, data):
            self.sent += data

    outcomes = {}
    for name, method, answer in (("connect", "CONNECT", b"HTTP/1.1 200 OK\r\n\r\nafter the switch"),
                                 ("upgrade", "GET", b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                                    b"Connection: Upgrade\r\n\r\n\x81\x05hello")):
        head = [("Host", "a")] + ([("Connection", "Upgrade"), ("Upgrade", "websocket")] if method == "GET" else [])
        to_up, from_box = h11.Connection(h11.CLIENT), h11.Connection(h11.SERVER)
        to_up.send(h11.Request(method=method, target="a:443" if method == "CONNECT" else "/", headers=head))
        to_up.send(h11.EndOfMessage())
        from_box.receive_data(h11.Connection(h11.CLIENT).send(h11.Request(method="GET", target="/", headers=head[:1])))
        from_box.next_event()
        from_box.next_event()
        box = ToBox()

        def run(name=name, to_up=to_up, from_box=from_box, box=box, answer=answer):
            try:
                outcomes[name] = _relay_response(Upstream(answer), to_up, box, from_box, Scrubber(["v"]),
                                                 {"bytes_down": 0})
            except Unscrubbable as e:
                outcomes[name] = str(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), f"{name}: the relay spins"
        assert b"after the switch" not in box.sent and b"hello" not in box.sent
    assert outcomes == {"connect": False, "upgrade": "a switch of protocols (101) cannot be scrubbed of secret values"}


def test_an_upgrade_through_the_door_gets_501_and_a_101_from_upstream_a_502(tmp_path):
    from tests.bound_relay import Upstream, relay
    switching = Upstream(tmp_path, lambda head: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                                b"Connection: Upgrade\r\n\r\n")
    out = relay(switching, (f"GET /ws HTTP/1.1\r\nHost: api.tkb.test:{switching.port}\r\nConnection: Upgrade\r\n"
                            "Upgrade: websocket\r\n\r\n").encode())
    out.thread.join(5)
    assert not out.thread.is_alive() and out.read.startswith(b"HTTP/1.1 501 ") and not any(switching.seen)
    assert out.signed_end["error"] == "refused by the secrets door: a switch of protocols (Upgrade: websocket)"
    out = relay(switching, f"GET / HTTP/1.1\r\nHost: api.tkb.test:{switching.port}\r\n\r\n".encode())
    out.thread.join(5)
    assert not out.thread.is_alive() and out.read.startswith(b"HTTP/1.1 502 ")
    assert out.signed_end["error"].startswith("refused by the secrets door: ")  # h11 too refuses an unasked 101


def _echo(head: bytes) -> bytes:
    """A bound host that reflects the Authorization it got: in its status line for /reason, else in a JSON body,
    honouring Range (or, for /partial, answering a piece whatever was asked)."""
    import re
    auth = re.search(rb"(?im)^authorization: (.*?)\r$", head).group(1)
    path = head.split(b" ")[1]
    if path == b"/reason":
        return b"HTTP/1.1 401 Invalid credentials " + auth + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    body = b'{"authorization": "' + auth + b'"}'
    m = re.search(rb"(?im)^range: bytes=(\d+)-(\d+)\r$", head)
    if m or path in (b"/partial", b"/content-range"):
        a, z = (int(m.group(1)), int(m.group(2))) if m else (20, 25)
        status = b"200 OK" if path == b"/content-range" else b"206 Partial Content"
        return (b"HTTP/1.1 %s\r\ncontent-range: bytes %d-%d/%d\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, a, z, len(body), len(body[a:z + 1]))) + body[a:z + 1]
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body


def test_the_reason_phrase_of_a_bound_host_never_carries_the_value(tmp_path):
    """The status line's reason went to the box as the bound host wrote it, unscrubbed: the box gets HTTP's own."""
    from tests.bound_relay import VALUE, Upstream, relay
    from tkbox_nb.doors.intercept import standard_reason
    upstream = Upstream(tmp_path, _echo)
    out = relay(upstream, lambda b: (f"GET /reason HTTP/1.1\r\nHost: api.tkb.test:{upstream.port}\r\n"
                                     f"Authorization: {b.placeholder}\r\n\r\n").encode())
    assert VALUE.encode() in upstream.seen[-1]  # swapped, and echoed in the reason
    assert out.read.startswith(b"HTTP/1.1 401 Unauthorized\r\n") and b"REALSECRET" not in out.read
    assert (standard_reason(200), standard_reason(418), standard_reason(599)) == (b"OK", b"I'm a Teapot", b"")


def test_a_value_cannot_be_read_in_pieces_with_range(tmp_path):
    """Six bytes at a time, each piece too short to be a spelling the scrubber finds, the box put the value back
    together. Range and If-Range no longer go to a bound host, and a partial answer (206, or any Content-Range) is
    refused as unscrubbable."""
    from tests.bound_relay import VALUE, Upstream, relay
    upstream = Upstream(tmp_path, _echo)
    for a in (0, 27, 54):
        out = relay(upstream, lambda b: (f"GET / HTTP/1.1\r\nHost: api.tkb.test:{upstream.port}\r\nAuthorization: "
                                         f"{b.placeholder}\r\nRange: bytes={a}-{a + 5}\r\nIf-Range: x\r\n\r\n"
                                         ).encode())
        assert b"range" not in upstream.seen[-1].lower()
        assert out.read.startswith(b"HTTP/1.1 200 OK\r\n") and b'Bearer ' + b"*" * len(VALUE) in out.read
    for path in ("/partial", "/content-range"):
        out = relay(upstream, lambda b: (f"GET {path} HTTP/1.1\r\nHost: api.tkb.test:{upstream.port}\r\n"
                                         f"Authorization: {b.placeholder}\r\n\r\n").encode())
        out.thread.join(5)
        assert out.read.startswith(b"HTTP/1.1 502 ") and b"partial response" in out.read
        assert b"REALSECRET" not in out.read
        assert out.signed_end["error"] == "refused by the secrets door: a partial response (206, Content-Range) " \
                                          "cannot be scrubbed of secret values"


def test_connections_to_bound_hosts_are_served_a_bounded_number_at_once(tmp_path, monkeypatch):
    """Each request to a bound host is read whole (up to 16 MiB) before it is swapped and checked, and a box could
    open as many such connections as it has streams: the host held gigabytes. At most MAX_BOUND_AT_ONCE are served at
    once; one more waits BOUND_WAIT_S and is then answered 503, and its signed end says why."""
    import threading

    from tests.bound_relay import FakeBox, FakeStream, Upstream, binding, relay
    from tkbox_nb.doors import egress
    from tkbox_nb.rules.proxy_request import ProxyRequest
    from tkbox_nb.signing.recorder import Crossing
    monkeypatch.setattr(egress, "MAX_BOUND_AT_ONCE", 2)
    monkeypatch.setattr(egress, "BOUND_WAIT_S", 0.3)
    upstream = Upstream(tmp_path, lambda head: b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
    door = egress.EgressDoor(FakeBox(upstream.policy(), [binding()]))
    assert door.bound_slots.acquire(blocking=False) and door.bound_slots.acquire(blocking=False)  # two busy
    stream = FakeStream()
    crossing = Crossing("egress-9", "egress", {"host": "api.tkb.test"}, None, decision="allow", decision_id="d")
    t = threading.Thread(target=door._relay_bound, args=(stream, ProxyRequest("CONNECT", "api.tkb.test", upstream.port,
                                                                             True), crossing, "127.0.0.1", []))
    t.start()
    t.join(5)
    answer = door.box.conn.out.get(timeout=1)
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"busy" in answer
    assert door.box.conn.out.get(timeout=1) is None and not any(upstream.seen)
    assert door.box.recorder.log[-1][2:] == ("error", {"error": "2 connections to bound hosts are being served; "
                                                                "this one waited 0.3s"}, None)
    door.bound_slots.release()
    for _ in range(3):  # a slot is given back when its connection ends, however it ends
        out = relay(upstream, f"GET / HTTP/1.1\r\nHost: api.tkb.test:{upstream.port}\r\n\r\n".encode(), door=door)
        out.thread.join(5)
        assert out.read.endswith(b"\r\n\r\nok")
    assert door.bound_slots.acquire(blocking=False) and not door.bound_slots.acquire(blocking=False)
