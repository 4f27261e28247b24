"""The egress door's pure checks: the always-refused ranges written out here (and a test per row of the code's
table), embedded IPv4 forms, IP literal spellings, host name validation and the proxy request parser."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tkbox_nb.rules.addresses import ALWAYS_REFUSED, SPECIAL, classify, embedded_ipv4
from tkbox_nb.rules.hostnames import HostError, check_host
from tkbox_nb.rules.proxy_request import ProxyRequestError, ProxyRequestParser
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy
from tkbox_nb.stream.events import Close, Data


SAMPLES = {"2001::/23": "2001:1::1"}  # 2001::/32 inside it is Teredo, judged by its embedded IPv4 addresses


def first(net: str):
    if net in SAMPLES:
        return ipaddress.ip_address(SAMPLES[net])
    return ipaddress.ip_network(net)[0 if ipaddress.ip_network(net).num_addresses == 1 else 1]


@pytest.mark.parametrize("net,why", ALWAYS_REFUSED)
def test_always_refused_row_cannot_be_allowed(net, why):
    addr = first(net)
    cls, reason = classify(addr, (ipaddress.ip_network(net), ipaddress.ip_network("0.0.0.0/0"),
                                  ipaddress.ip_network("::/0")))
    assert cls == "always" and str(addr) in reason


# What the door promises never to dial, written out here and not read from the code's table (ALWAYS_REFUSED), so a row
# deleted or narrowed there fails a test here. Each range with its first and last address and one inside; the single
# metadata addresses with the word the refusal must name.
NEVER_DIALLED = {
    "169.254.169.254/32": "metadata",   # AWS, GCP, Azure IMDS, OpenStack
    "169.254.170.2/32": "metadata",     # AWS ECS task metadata
    "168.63.129.16/32": "metadata",     # Azure wire server (otherwise a public address)
    "100.100.100.200/32": "metadata",   # Alibaba Cloud
    "192.0.0.192/32": "metadata",       # Oracle Cloud (otherwise in 192.0.0.0/24, which allow_cidrs could lift)
    "fd00:ec2::254/128": "metadata",    # AWS IMDS over IPv6
    "0.0.0.0/8": "this network",
    "10.0.0.0/8": "private",
    "172.16.0.0/12": "private",
    "192.168.0.0/16": "private",
    "100.64.0.0/10": "CGNAT",
    "127.0.0.0/8": "loopback",
    "169.254.0.0/16": "link-local",
    "224.0.0.0/4": "multicast",
    "240.0.0.0/4": "reserved",          # and 255.255.255.255, broadcast
    "::/128": "unspecified",
    "::1/128": "loopback",
    "fc00::/7": "unique-local",
    "fe80::/10": "link-local",
    "fec0::/10": "site-local",
    "ff00::/8": "multicast",
    "64:ff9b:1::/48": "NAT64",
}
EVERYTHING = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))


@pytest.mark.parametrize("net", sorted(NEVER_DIALLED))
def test_every_always_refused_range_is_refused_whatever_the_policy(net):
    network = ipaddress.ip_network(net)
    inside = {network[0], network[-1], network[network.num_addresses // 2]}
    policy = Policy.from_toml('[egress]\nallow = ["*:*"]\nallow_cidrs = ["0.0.0.0/0", "::/0"]\n')
    for addr in sorted(inside):
        cls, why = classify(addr, EVERYTHING + (network,))
        assert cls == "always" and str(addr) in why and NEVER_DIALLED[net] in why, (addr, cls, why)
        host = str(addr)
        v = policy.decide({"door": "egress", "kind": "connect", "host": host, "port": 443, "address": host,
                           "addresses": [host]})
        assert (v.verdict, v.rule) == ("deny", "egress.always"), (addr, v)


@pytest.mark.parametrize("net,why", SPECIAL)
def test_special_row_refused_unless_allow_cidrs_names_it(net, why):
    addr = first(net)
    assert classify(addr)[0] == "special"
    assert classify(addr, (ipaddress.ip_network(net),))[0] == "ok"


@pytest.mark.parametrize("addr", ["::ffff:169.254.169.254", "::169.254.169.254", "64:ff9b::a9fe:a9fe",
                                  "2002:a9fe:a9fe::1", "2002:7f00:1::", "::ffff:10.1.2.3", "64:ff9b::7f00:1",
                                  "2001:0:a9fe:a9fe::1", "2001:0:4136:e378:8000:63bf:5601:fefe"])
def test_embedded_ipv4_forms_are_judged_by_the_address_inside(addr):
    assert classify(ipaddress.ip_address(addr), (ipaddress.ip_network("::/0"),))[0] == "always", addr


def test_teredo_client_is_unobfuscated():
    addr = ipaddress.ip_address("2001:0:4136:e378:8000:63bf:3fff:fdd2")
    assert ipaddress.ip_address("192.0.2.45") in embedded_ipv4(addr)


def test_public_addresses_pass():
    for a in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "1.1.1.1"):
        assert classify(ipaddress.ip_address(a)) == ("ok", "")


@pytest.mark.parametrize("spelling", ["127.0.0.1", "2130706433", "0177.0.0.1", "0x7f.1", "127.1", "0x7f000001",
                                      "0177.1", "[::1]", "[::ffff:127.0.0.1]", "127.0.1"])
def test_every_c_library_spelling_of_loopback_is_an_address(spelling):
    kind, addr = check_host(spelling)
    assert kind == "ip" and classify(addr)[0] == "always"


@pytest.mark.parametrize("bad", ["1.2.3.256", "1.2.3.4.5", "exa\x00mple.org", "exa mple.org", "ｅｘａｍｐｌｅ.org",
                                 "example.org%2f", "a..b", "-a.org", "x" * 300, "", "[zz::1]", "example.123",
                                 "xn--zz.org"])
def test_bad_host_names_are_refused_before_any_lookup(bad):
    with pytest.raises(HostError):
        check_host(bad)


def test_names_are_normalized_to_one_spelling():
    assert check_host("Example.ORG.") == ("name", "example.org")
    assert check_host("bücher.example") == ("name", "xn--bcher-kva.example")


@pytest.mark.parametrize("name", ["metadata.google.internal", "localhost", "a.localhost", "metadata",
                                  "instance-data.ec2.internal", "metadata.goog", "metadata.azure.com",
                                  "x.metadata.google.internal", "localhost.localdomain", "ip6-localhost"])
def test_metadata_and_local_names_are_refused_whatever_the_policy(name):
    policy = Policy.from_toml('[egress]\nallow = ["*:*"]\nallow_cidrs = ["0.0.0.0/0"]\n')
    v = policy.decide({"door": "egress", "kind": "connect", "host": name, "port": 80, "addresses": ["1.1.1.1"]})
    assert v.verdict == "deny" and v.rule == "egress.always"


def test_an_answer_mixing_allowed_and_refused_addresses_is_refused_whole():
    policy = Policy.from_toml('[egress]\nallow = ["*.example.org:443"]\n')
    facts = {"door": "egress", "kind": "connect", "host": "a.example.org", "port": 443}
    assert policy.decide(dict(facts, addresses=["93.184.216.34"])).allowed
    v = policy.decide(dict(facts, addresses=["93.184.216.34", "169.254.169.254"]))
    assert v.verdict == "deny" and "metadata" in v.reason


@pytest.mark.parametrize("text, error", [
    ('[egress]\nallow = ["example.com:\u00b2"]', "must be HOST:PORT"),      # str.isdigit took '²', int() did not
    ('[egress]\nallow = ["example.com:\u0663"]', "must be HOST:PORT"),      # an Arabic-Indic digit three
    ('[egress]\nallow = ["example.com:123456"]', "must be HOST:PORT"),
    ('[egress]\nconnect_timeout_s = nan', "must be a number of seconds"),
    ('[egress]\nconnect_timeout_s = inf', "must be a number of seconds"),
    ('[egress]\nconnect_timeout_s = 0', "must be a number of seconds"),
    ('[egress]\nconnect_timeout_s = -1.5', "must be a number of seconds"),
    ('[egress]\nconnect_timeout_s = 601', "must be a number of seconds"),
    ('[exec]\ntimeout_s = inf', "must be a number of seconds"),
])
def test_bad_egress_settings_are_refused_with_one_line(text, error):
    with pytest.raises(PolicyError) as e:
        Policy.from_toml(text, "p.toml")
    assert error in str(e.value) and "\n" not in str(e.value)


def test_good_egress_timeouts_pass():
    assert Policy.from_toml('[egress]\nconnect_timeout_s = 2.5\n').get("egress", "connect_timeout_s") == 2.5


def test_proxy_requests_parse_connect_and_absolute_form():
    r = ProxyRequestParser().feed(b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\nHost: x\r\n\r\nTLS")
    assert (r.host, r.port, r.tunnel, r.rest) == ("[2001:db8::1]", 443, True, b"TLS")
    p = ProxyRequestParser()
    assert p.feed(b"GET http://example.org:8080/a?q=1 HTTP/1.1\r\n") is None
    r = p.feed(b"Host: example.org\r\nProxy-Authorization: x\r\n\r\n")
    assert (r.host, r.port, r.target) == ("example.org", 8080, "/a?q=1")
    assert b"proxy-authorization" not in p.upstream_head(r).lower() and b"connection: close" in p.upstream_head(r)


@pytest.mark.parametrize("head,status", [
    (b"GET /local HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET https://example.org/ HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"CONNECT user@example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"CONNECT example.org:99999 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"GET http://example.org/ HTTP/1.1\r\nX: " + b"a" * 70000, 431),
])
def test_bad_proxy_requests_get_an_http_error(head, status):
    with pytest.raises(ProxyRequestError) as e:
        ProxyRequestParser().feed(head)
    assert e.value.status in (status, 400)


SMUGGLED = b"GET /admin HTTP/1.1\r\nHost: other-site.example\r\n\r\n"
AMBIGUOUS_FRAMING = [
    b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n",
    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    b"Content-Length: 4\r\nContent-Length: 5\r\n",
    b"Content-Length: 4, 5\r\n",
]


@pytest.mark.parametrize("framing", AMBIGUOUS_FRAMING)
def test_a_forwarded_request_framed_ambiguously_is_refused_400(framing):
    """CL.TE smuggling: with both Content-Length and Transfer-Encoding the door read chunks and sent both headers up,
    so an upstream framing by Content-Length read the chunk's content as a second request, to another Host. (h11
    itself refuses the other ambiguities, and sends equal repeated Content-Lengths up as one.)"""
    head = b"POST http://allowed.example/ HTTP/1.1\r\nHost: allowed.example\r\n" + framing + b"\r\n"
    with pytest.raises(ProxyRequestError) as e:
        ProxyRequestParser().feed(head + b"%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n")
    assert e.value.status == 400


def test_a_forwarded_request_framed_once_still_passes():
    for framing in (b"Content-Length: 4\r\n", b"Transfer-Encoding: chunked\r\n", b""):
        r = ProxyRequestParser().feed(b"POST http://a.example/ HTTP/1.1\r\nHost: a.example\r\n" + framing + b"\r\n")
        assert r is not None and r.host == "a.example"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_proxy_request_parser(data):
    try:
        ProxyRequestParser().feed(data)
    except ProxyRequestError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_host_check(text):
    try:
        kind, value = check_host(text)
    except HostError:
        return
    assert kind in ("ip", "name")


@pytest.mark.parametrize("entry,host", [("[2001:db8::1]:443", "2001:db8::1"), ("[2001:DB8:0::1]:443", "2001:db8::1"),
                                        ("0xc6.18.7.2:443", "198.18.7.2"), ("198.18.7.2.:*", "198.18.7.2")])
def test_an_allow_entry_that_is_an_ip_literal_allows_the_address_it_spells(entry, host):
    """As text, `[2001:db8::1]` was a glob character class and never matched the door's `2001:db8::1`."""
    policy = Policy.from_toml(f'[egress]\nallow = ["{entry}"]\nallow_cidrs = ["2001:db8::/32", "198.18.0.0/15"]\n')
    facts = {"door": "egress", "kind": "connect", "port": 443, "address": host, "addresses": [host]}
    assert policy.decide(dict(facts, host=host)).rule == "egress.allow[0]"
    other = str(ipaddress.ip_address(host) + 1)
    assert policy.decide(dict(facts, host=other, address=other, addresses=[other])).rule == "egress.allow"


@pytest.mark.parametrize("port", ["9" * 5000, "0" * 4301 + "443", "٤٤٣", "000443", "+443", " 443", "44_3", "0",
                                  "65536"])
def test_a_port_is_one_to_five_ascii_digits_checked_before_it_is_read(port):
    """int() raised ValueError past 4300 digits, uncaught: the door's thread died, the box's stream stayed open and
    nothing was signed. (It also read other scripts' digits.)"""
    for head in (f"CONNECT example.org:{port} HTTP/1.1\r\nHost: x\r\n\r\n",
                 f"GET http://example.org:{port}/ HTTP/1.1\r\nHost: x\r\n\r\n"):
        with pytest.raises(ProxyRequestError) as e:
            ProxyRequestParser().feed(head.encode("utf-8"))
        assert e.value.status == 400 and "\n" not in str(e.value)
    assert ProxyRequestParser().feed(b"CONNECT example.org:00443 HTTP/1.1\r\nHost: x\r\n\r\n").port == 443


@pytest.mark.parametrize("where", ["decide", "relay"])
def test_a_fault_of_the_egress_door_answers_502_closes_the_stream_and_is_signed(where, monkeypatch):
    """Whatever the door did not foresee ends that connection answered, closed and signed, never a dead thread."""
    from tests.bound_relay import FakeBox, FakeStream
    from tkbox_nb.guest import protocol as p
    from tkbox_nb.doors import egress
    box = FakeBox(Policy.from_toml('[egress]\nallow = ["93.184.216.34:*"]\n'), [])

    def boom(*args, **kwargs):
        raise ValueError("something the door did not foresee")
    if where == "decide":
        monkeypatch.setattr(egress, "stated_facts", boom)
    else:
        monkeypatch.setattr(egress.socket, "create_connection", boom)
    stream = FakeStream()
    stream.events.put(Data(p.CH_BYTES, b"CONNECT 93.184.216.34:443 HTTP/1.1\r\nHost: x\r\n\r\n"))
    egress.EgressDoor(box)._serve(stream)
    sent = [box.conn.out.get(timeout=1) for _ in range(2)]
    assert sent[0].startswith(b"HTTP/1.1 502 ") and b"(ValueError)" in sent[0] and sent[1] is None
    assert b"foresee" not in sent[0]
    log = box.recorder.log
    if where == "decide":
        assert [(e[0], e[4]) for e in log] == [("decide", "deny")]
        assert log[0][3]["host_error"] == "the egress door failed on this connection (ValueError)"
    else:
        assert [e[0] for e in log] == ["decide", "complete"] and log[0][4] == "allow"
        assert log[1][2:4] == ("error", {"error": "connect to 93.184.216.34:443: the egress door failed on this "
                                                  "connection (ValueError)"})


def test_a_long_answer_is_judged_whole_before_it_is_cut():
    """An answer of more than MAX_ADDRESSES addresses was cut before it was judged, so a refused address past the cut
    went unseen and the rest were allowed. Every address is judged; the refused ones are stated first, so the policy
    (and a verifier re-deriving it) refuses the whole answer; the count cut is stated."""
    from tkbox_nb.doors.egress import MAX_ADDRESSES, stated_facts
    policy = Policy.from_toml('[egress]\nallow = ["cdn.example.org:443"]\n')
    req = ProxyRequestParser().feed(b"CONNECT cdn.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
    public = [f"1.1.{i // 200}.{i % 200 + 1}" for i in range(40)]
    for hidden in ("192.168.1.1", "198.51.100.7", "::ffff:10.0.0.1", "169.254.169.254"):
        facts, address = stated_facts(req, policy, lambda name, port: public + [hidden] + public[:5])
        assert len(facts["addresses"]) == MAX_ADDRESSES and facts["addresses_dropped"] == 41 - MAX_ADDRESSES
        assert facts["addresses"][0] == address == hidden and facts["address_class"] != "ok"
        v = policy.decide(dict(facts, door="egress", kind="connect"))
        assert v.verdict == "deny" and v.rule in ("egress.always", "egress.special"), v
    facts, address = stated_facts(req, policy, lambda name, port: public)
    assert facts["addresses_dropped"] == 8 and address == "1.1.0.1" and facts["address_class"] == "ok"
    assert policy.decide(dict(facts, door="egress", kind="connect")).allowed
    facts, _ = stated_facts(req, policy, lambda name, port: public[:3])
    assert "addresses_dropped" not in facts and len(facts["addresses"]) == 3


def client_hello(server_name: str | None) -> bytes:
    """A real ClientHello, as Python's ssl writes it, naming `server_name` (None: no SNI)."""
    import ssl
    context = ssl.create_default_context()
    if server_name is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def _records(hello: bytes, size: int) -> bytes:
    """The same ClientHello in handshake records of `size` bytes."""
    body = hello[5:]
    return b"".join(b"\x16\x03\x01" + len(body[i:i + size]).to_bytes(2, "big") + body[i:i + size]
                    for i in range(0, len(body), size))


def test_the_server_name_of_a_client_hello_is_read_however_it_comes():
    from tkbox_nb.rules.client_hello import NOT_TLS, ClientHelloReader
    for name in ("allowed.example", None):
        hello = client_hello(name)
        for data in (hello, _records(hello, 16), _records(hello, 1000)):
            assert ClientHelloReader().feed(data) == name
            reader = ClientHelloReader()
            got = [reader.feed(data[i:i + 7]) for i in range(0, len(data), 7)]
            assert got[-1] == name and set(got[:-1]) <= {False} and reader.buffered == data
    assert ClientHelloReader().feed(b"GET / HTTP/1.1\r\n") is NOT_TLS
    assert ClientHelloReader().feed(b"SSH-2.0-OpenSSH_9.2\r\n") is NOT_TLS
    assert ClientHelloReader().feed(b"\x16") is False


@pytest.mark.parametrize("data, why", [
    (b"\x16\x03\x01\x00\x00", "a TLS record of 0 bytes"),
    (b"\x16\x03\x01\x50\x00", "a TLS record of 20480 bytes"),
    (b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", "not a ClientHello"),
    (b"\x16\x03\x01\x00\x04\x01\xff\x00\x00", "a ClientHello of 16711680 bytes"),
    (b"\x16\x03\x01\x00\x04\x01\x00\x00\x01\x15\x03\x01\x00\x01\x00", "not the handshake's"),
    (b"\x16\x03\x01\x00\x06\x01\x00\x00\x02\x03\x03", "cut short"),
    ((b"\x16\x03\x01\x00\x04\x01\x00\x10\x00" + b"\x16\x03\x01\x00\x01x" * 40), "more than 32 records"),
])
def test_a_client_hello_the_door_cannot_read_is_refused(data, why):
    from tkbox_nb.rules.client_hello import ClientHelloReader, HelloError
    with pytest.raises(HelloError, match=why):
        ClientHelloReader().feed(data)


def test_a_tunnel_goes_up_only_once_its_client_hello_names_the_connect_host():
    """A front end serving many sites routes by the TLS server name, not by the address the door dialled: a CONNECT
    to an allowed host carrying a ClientHello for another reached that other site. Nothing goes up before the name is
    read; another name is refused; no name (an address), or no TLS at all, passes (docs/policy.md)."""
    from tkbox_nb.rules.client_hello import HelloError, TunnelGate
    hello = client_hello("not-allowed.example")
    gate = TunnelGate("allowed.example")
    with pytest.raises(HelloError, match="'not-allowed.example' is not the CONNECT host allowed.example"):
        gate.feed(hello[:100]) + gate.feed(hello[100:])
    for host, name in (("allowed.example", "Allowed.Example."), ("93.184.216.34", None)):
        hello, gate = client_hello(name), TunnelGate(host)
        assert gate.feed(hello[:100]) == b"" and gate.feed(hello[100:]) == hello and gate.feed(b"more") == b"more"
    with pytest.raises(HelloError, match="is not the CONNECT host 93.184.216.34"):
        TunnelGate("93.184.216.34").feed(client_hello("allowed.example"))
    assert TunnelGate("allowed.example").feed(b"GET / HTTP/1.1\r\n") == b"GET / HTTP/1.1\r\n"


def test_a_forwarded_request_goes_up_alone_however_the_box_pipelines_another():
    """Plain HTTP went up raw after the head, so a request pipelined after the first (to another Host at the same
    address) reached the server; each connection is now its one decided request, its body framed again."""
    parser = ProxyRequestParser()
    second = b"GET /steal HTTP/1.1\r\nHost: other.example\r\n\r\n"
    req = parser.feed(b"POST http://example.org/a HTTP/1.1\r\nHost: example.org\r\nContent-Length: 5\r\n\r\nab")
    head = parser.upstream_head(req)
    assert head.startswith(b"POST /a HTTP/1.1\r\nhost: example.org\r\n")
    assert parser.body(b"") == b"ab" and parser.body(b"c") == b"c" and not parser.ended
    assert parser.body(b"de" + second) == b"de" and parser.ended and parser.body(second) == b""
    assert parser.dropped == 2 * len(second)
    parser = ProxyRequestParser()
    req = parser.feed(b"GET http://example.org/ HTTP/1.1\r\nHost: example.org\r\n\r\n" + second)
    parser.upstream_head(req)
    assert parser.body(b"") == b"" and parser.ended and parser.dropped == len(second)
    parser = ProxyRequestParser()
    req = parser.feed(b"POST http://example.org/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\na")
    parser.upstream_head(req)
    assert parser.body(b"bc\r\n0\r\n\r\n" + second) == b"3\r\nabc\r\n0\r\n\r\n" and parser.ended
    parser = ProxyRequestParser()
    req = parser.feed(b"POST http://example.org/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    parser.upstream_head(req)
    with pytest.raises(ProxyRequestError, match="a request body the door cannot read"):
        parser.body(b"zz\r\n")


def _through_the_door(monkeypatch, sent: bytes) -> tuple[bytes, list, list]:
    """`sent` from the box through EgressDoor._serve to a listener standing in for the allowed host's public
    address: (what the listener got, the box's stream, the records)."""
    import socket
    import threading

    from tests.bound_relay import FakeBox, FakeStream
    from tkbox_nb.guest import protocol as p
    from tkbox_nb.doors import egress
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    got = []

    def accept():
        c, _ = listener.accept()
        c.settimeout(2)
        data = b""
        try:
            while len(data) < 65536:
                more = c.recv(65536)
                if not more:
                    break
                data += more
                if b"\r\n\r\n" in data:
                    c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    break
        except OSError:
            pass
        got.append(data)
        c.close()
    threading.Thread(target=accept, daemon=True).start()
    real = socket.create_connection
    monkeypatch.setattr(egress, "resolve", lambda name, port, ns, t: ["93.184.216.34"])
    monkeypatch.setattr(egress.socket, "create_connection",
                        lambda address, timeout=None: real(listener.getsockname(), timeout=timeout))
    box = FakeBox(Policy.from_toml('[egress]\nallow = ["allowed.example:*"]\n'), [])
    stream = FakeStream()
    stream.events.put(Data(p.CH_BYTES, sent))
    stream.events.put(Close({}))
    egress.EgressDoor(box)._serve(stream)
    out = []
    while (item := box.conn.out.get(timeout=2)) is not None:
        out.append(item)
    listener.close()
    return b"".join(got), out, box.recorder.log


def test_a_tunnel_naming_another_host_in_its_client_hello_is_refused_and_signed(monkeypatch):
    hello = client_hello("not-allowed.example")
    got, out, log = _through_the_door(monkeypatch, b"CONNECT allowed.example:443 HTTP/1.1\r\n"
                                                   b"Host: allowed.example:443\r\n\r\n" + hello)
    assert got == b"" and out == [b"HTTP/1.1 200 Connection established\r\n\r\n"]
    assert log[-1][3]["error"] == "refused by the egress door: the TLS server name 'not-allowed.example' is not " \
                                  "the CONNECT host allowed.example"


def test_a_request_pipelined_after_a_forwarded_one_never_reaches_the_server(monkeypatch):
    got, out, log = _through_the_door(monkeypatch, b"GET http://allowed.example/ HTTP/1.1\r\nHost: allowed.example"
                                                   b"\r\n\r\nGET /steal HTTP/1.1\r\nHost: other.example\r\n\r\n")
    assert got == b"GET / HTTP/1.1\r\nhost: allowed.example\r\nconnection: close\r\n\r\n"
    assert b"".join(out).endswith(b"\r\n\r\nok") and log[-1][3]["dropped_after_request"] == 44


def test_a_smuggling_request_through_the_door_never_reaches_the_server(monkeypatch):
    """CL.TE through EgressDoor._serve: the box is answered 400 and the allowed host gets nothing of it."""
    got, out, log = _through_the_door(monkeypatch, b"POST http://allowed.example/ HTTP/1.1\r\nHost: allowed.example"
                                                   b"\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                                                   b"%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n")
    assert got == b"" and b"".join(out).startswith(b"HTTP/1.1 400")
    assert not [e for e in log if e[0] == "decide"]  # refused as it was read, before any decision or lookup


def test_an_open_tunnel_is_closed_and_its_end_signed_when_the_box_stops():
    """An allowed host that accepts and then holds the connection kept the relay (a thread, a socket) for good,
    past the box's end, and the connection's end was never signed."""
    import time

    from tests.bound_relay import held_tunnel
    tunnel = held_tunnel()
    door, box, relay = tunnel.door, tunnel.box, tunnel.relay
    time.sleep(0.3)
    assert relay.is_alive()
    door.stop("box stopped")
    relay.join(timeout=5)
    assert not relay.is_alive()
    (end,) = [e for e in box.recorder.log if e[0] == "complete"]
    assert end[3]["closed_by_door"] == "box stopped"


def test_an_idle_tunnel_is_closed_and_its_end_signed():
    from tests.bound_relay import held_tunnel
    tunnel = held_tunnel(lambda d: setattr(d, "idle_timeout_s", 0.4))
    door, box, relay = tunnel.door, tunnel.box, tunnel.relay
    relay.join(timeout=15)  # the relay gives the box's side 5 s to finish its upload after the download ended
    assert not relay.is_alive()
    (end,) = [e for e in box.recorder.log if e[0] == "complete"]
    assert end[3]["closed_by_door"] == "idle for 0.4s"
    reaper = door._reaper
    if reaper is not None:  # with nothing left open the idle watch ends: an ended box leaves no thread behind
        reaper.join(timeout=2)
        assert not reaper.is_alive()
