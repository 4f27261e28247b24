"""The secrets door: a real HTTPS echo server with a test CA in a network namespace, real clients in a real box."""

from __future__ import annotations

import datetime
import ipaddress
import re
import zipfile

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from testnet import NamespaceNet, available
from tkbox_nb.bundle.verify import verify_bundle
from tests.conftest import run_cli

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(not available()[0], reason=available()[1])]

VALUE = "sk-live-" + "7f3a9c" * 6


def _test_ca(tmp, address: str | None = None):
    """A CA and a certificate for api.tkb.test, web.tkb.test and the test host's `address` if given, made here: the
    upstream the door must verify."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tkbox test upstream CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("api.tkb.test"), x509.DNSName("web.tkb.test")] + (
                [x509.IPAddress(ipaddress.ip_address(address))] if address else [])), critical=False)
            .sign(ca_key, hashes.SHA256()))
    chain = tmp / "server.pem"
    chain.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()) + leaf.public_bytes(serialization.Encoding.PEM))
    ca_file = tmp / "upstream-ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return chain, ca_file


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    n = NamespaceNet(index=11, tls_chain=str(tmp / "server.pem"))
    chain, ca_file = _test_ca(tmp, n.web)
    with n:
        n.upstream_ca = ca_file
        yield n


def secrets_policy(net, misuse: str = "flag") -> Policy:
    return Policy.from_toml(f"""
[egress]
allow = ["api.tkb.test:8443", "web.tkb.test:8443", "web.tkb.test:8080"]
allow_cidrs = ["198.18.0.0/15"]
nameservers = ["{net.web}"]
upstream_ca_file = "{net.upstream_ca}"

[secrets.API_KEY]
hosts = ["api.tkb.test"]
header = "Authorization"
format = "Bearer {{value}}"
source = "env:TKB_TEST_API_KEY"
misuse = "{misuse}"
""")


@pytest.fixture
def box(signer, net, tmp_path, monkeypatch):
    monkeypatch.setenv("TKB_TEST_API_KEY", VALUE)
    policy = secrets_policy(net)
    ws = tmp_path / "ws"
    ws.mkdir()
    b = Box(backend="bwrap", policy=policy, workspace=ws, bundle_path=tmp_path / "s.tkb").start()
    b.bundle_file = tmp_path / "s.tkb"
    yield b
    b.stop()


CLIENTS = {
    "urllib": ("import os, urllib.request\n"
               "req = urllib.request.Request('https://api.tkb.test:8443/echo', data=b'hi', "
               "headers={'Authorization': 'Bearer ' + os.environ['API_KEY']})\n"
               "print(urllib.request.urlopen(req, timeout=20).read().decode())"),
    "requests": ("import os, requests\n"
                 "print(requests.post('https://api.tkb.test:8443/echo', data=b'hi', timeout=20, "
                 "headers={'Authorization': os.environ['API_KEY']}).text)"),
    "httpx": ("import os, httpx\n"
              "print(httpx.post('https://api.tkb.test:8443/echo', content=b'hi', timeout=20, "
              "headers={'Authorization': 'Bearer ' + os.environ['API_KEY']}).text)"),
}


def _stdout(r):
    assert r.exit_code == 0, r.stderr.decode()[-1500:]
    return r.stdout.decode()


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_the_bound_host_receives_the_value_in_the_bound_header_only(box, client):
    out = _stdout(box.run(["python3", "-c", CLIENTS[client]]))
    # the echo server saw the real value (its echo comes back scrubbed: asterisks where the value was)
    assert "Authorization: Bearer " + "*" * len(VALUE) in out, out
    assert VALUE not in out


def test_curl_through_the_door(box):
    r = box.run(["sh", "-c", 'curl -sS -X POST --data hi -H "Authorization: Bearer $API_KEY" '
                             "https://api.tkb.test:8443/echo"])
    assert "Authorization: Bearer " + "*" * len(VALUE) in _stdout(r)


def test_the_box_cannot_learn_the_value(box):
    placeholder = _stdout(box.run(["sh", "-c", "printf %s \"$API_KEY\""]))
    assert placeholder.startswith("tkbox-ph-") and VALUE not in placeholder
    probe = _stdout(box.run(["sh", "-c", "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; env; "
                                         "grep -rs . /etc /tmp /workspace 2>/dev/null | head -c 2000000"]))
    assert VALUE not in probe
    # an echo on the bound host reflecting the header: scrubbed before the box sees it
    reflected = _stdout(box.run(["python3", "-c", "import os, urllib.request\n"
                                 "req = urllib.request.Request('https://api.tkb.test:8443/echo-headers', "
                                 "headers={'Authorization': 'Bearer ' + os.environ['API_KEY']})\n"
                                 "print(urllib.request.urlopen(req, timeout=20).read().decode())"]))
    assert VALUE not in reflected and "*" * len(VALUE) in reflected


def test_the_placeholder_elsewhere_is_never_swapped_and_is_flagged(box):
    # another header and the body of a request to the bound host; the bound header to an unbound host
    out = _stdout(box.run(["python3", "-c", "import os, urllib.request\nph = os.environ['API_KEY']\n"
                           "req = urllib.request.Request('https://api.tkb.test:8443/echo?k=' + ph, data=ph.encode(), "
                           "headers={'X-Other': ph})\n"
                           "print(urllib.request.urlopen(req, timeout=20).read().decode())"]))
    assert VALUE not in out and out.count("tkbox-ph-") >= 3  # the placeholder went out as itself
    plain = _stdout(box.run(["python3", "-c", "import os, urllib.request\n"
                             "req = urllib.request.Request('http://web.tkb.test:8080/echo-headers', "
                             "headers={'Authorization': 'Bearer ' + os.environ['API_KEY']})\n"
                             "print(urllib.request.urlopen(req, timeout=20).read().decode())"]))
    assert VALUE not in plain and "tkbox-ph-" in plain
    box.stop()
    run = open_run(box.bundle_file)
    misuses = [c for c in run.crossings() if c.door == "secrets" and c.args["kind"] == "misuse"]
    wheres = {c.args["where"] for c in misuses}
    assert {"path or query", "header X-Other", "body"} <= wheres, wheres
    assert any("plain http" in w for w in wheres)
    assert all("TKB-FLAG-SECRET-MISUSE" in c.rule_ids for c in misuses)


def test_records_name_bindings_and_swaps_never_the_value(box, tmp_path):
    _stdout(box.run(["python3", "-c", CLIENTS["urllib"]]))
    box.run(["sh", "-c", "echo $API_KEY > /workspace/leak.txt"])
    box.stop()
    assert verify_bundle(box.bundle_file).valid
    run = open_run(box.bundle_file)
    kinds = [(c.args["kind"], c.decision) for c in run.crossings() if c.door == "secrets"]
    assert ("bind", "allow") in kinds and ("swap", "allow") in kinds
    with zipfile.ZipFile(box.bundle_file) as z:
        for name in z.namelist():
            assert VALUE.encode() not in z.read(name), name


def test_another_binding_s_placeholder_to_a_bound_host_is_flagged_never_swapped(signer, net, tmp_path, monkeypatch):
    """Over the intercepted TLS to api.tkb.test (bound to API_KEY), the placeholder of OTHER (bound to web.tkb.test
    only) in the very header OTHER binds: neither value goes up, and OTHER's misuse is signed naming the host."""
    monkeypatch.setenv("TKB_TEST_API_KEY", VALUE)
    monkeypatch.setenv("TKB_TEST_OTHER", "other-" + "5e" * 20)
    policy = Policy.from_toml(secrets_policy(net).source + """
[secrets.OTHER]
hosts = ["web.tkb.test"]
header = "Authorization"
format = "Bearer {value}"
source = "env:TKB_TEST_OTHER"
""")
    with Box(backend="bwrap", policy=policy, bundle_path=tmp_path / "o.tkb") as b:
        out = _stdout(b.run(["python3", "-c", "import os, urllib.request\n"
                             "req = urllib.request.Request('https://api.tkb.test:8443/echo-headers', "
                             "headers={'Authorization': 'Bearer ' + os.environ['OTHER']})\n"
                             "print(urllib.request.urlopen(req, timeout=20).read().decode())"]))
    assert VALUE not in out and "5e" * 20 not in out and "tkbox-ph-" in out, out
    run = open_run(tmp_path / "o.tkb")
    misuses = [c.args for c in run.crossings() if c.door == "secrets" and c.args["kind"] == "misuse"]
    assert [(m["name"], m["where"]) for m in misuses] == [("OTHER", "header Authorization to api.tkb.test")], misuses
    assert not [c for c in run.crossings() if c.door == "secrets" and c.args["kind"] == "swap"]


def test_misuse_can_be_refused_by_the_binding(signer, net, tmp_path, monkeypatch):
    monkeypatch.setenv("TKB_TEST_API_KEY", VALUE)
    policy = secrets_policy(net, misuse="refuse")
    with Box(backend="bwrap", policy=policy, bundle_path=tmp_path / "m.tkb") as b:
        out = b.run(["python3", "-c", "import os, urllib.request\n"
                     "req = urllib.request.Request('https://api.tkb.test:8443/echo', data=os.environ['API_KEY']"
                     ".encode())\ntry:\n    urllib.request.urlopen(req, timeout=20)\n"
                     "except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())"]).stdout.decode()
    assert out.startswith("403") and "secrets.misuse" in out, out


@pytest.mark.parametrize("kind", ["ip", "name"])
def test_a_secret_bound_to_an_ip_literal_or_a_name_reaches_only_its_header(kind, signer, net, tmp_path, monkeypatch):
    """A binding to 198.18.11.2 (the leaf must carry an IP address SAN, or every client refuses it) and to a name the
    test's own DNS server resolves: urllib and curl send the placeholder in the bound header and in another; the
    upstream gets the value in the bound header only, the box gets the echo scrubbed, the bundle holds no byte of the
    value, each swap's signed host is the address or name dialled, and `tkbox verify` passes."""
    host = net.web if kind == "ip" else "api.tkb.test"
    monkeypatch.setenv("TKB_TEST_API_KEY", VALUE)
    policy = Policy.from_toml(f"""
[egress]
allow = ["{host}:8443"]
allow_cidrs = ["198.18.0.0/15"]
nameservers = ["{net.web}"]
upstream_ca_file = "{net.upstream_ca}"

[secrets.API_KEY]
hosts = ["{host}"]
header = "Authorization"
format = "Bearer {{value}}"
source = "env:TKB_TEST_API_KEY"
""")
    bundle = tmp_path / "bound.tkb"
    url = f"https://{host}:8443/echo"
    with Box(backend="bwrap", policy=policy, bundle_path=bundle) as b:
        outs = [_stdout(b.run(["python3", "-c", "import os, urllib.request\nph = os.environ['API_KEY']\n"
                               f"req = urllib.request.Request({url!r}, data=b'hi', "
                               "headers={'Authorization': 'Bearer ' + ph, 'X-Other': ph})\n"
                               "print(urllib.request.urlopen(req, timeout=20).read().decode())"])),
                _stdout(b.run(["sh", "-c", 'curl -sS -X POST --data hi -H "Authorization: Bearer $API_KEY" '
                                           f'-H "X-Other: $API_KEY" {url}']))]
    stars = "*" * len(VALUE)
    for out in outs:
        assert f"Authorization: Bearer {stars}\n" in out and out.count(stars) == 1, out  # the value, scrubbed
        assert re.search(r"(?im)^x-other: tkbox-ph-[0-9a-f]{32}$", out), out  # the other header: the placeholder
        assert VALUE not in out
    with zipfile.ZipFile(bundle) as z:
        for name in z.namelist():
            assert VALUE.encode() not in z.read(name), name
    verified = run_cli("verify", str(bundle))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    crossings = open_run(bundle).crossings()
    swaps = [c for c in crossings if c.door == "secrets" and c.args["kind"] == "swap"]
    assert [(c.args["host"], c.decision) for c in swaps] == [(host, "allow")] * 2
    misuses = [c.args["where"] for c in crossings if c.door == "secrets" and c.args["kind"] == "misuse"]
    assert sorted(misuses) == ["header X-Other"] * 2, misuses


GZIP_PROBE = """import gzip, os, urllib.error, urllib.request
req = urllib.request.Request('https://api.tkb.test:8443{path}', headers={{
    'Authorization': 'Bearer ' + os.environ['API_KEY'], 'Accept-Encoding': 'gzip, deflate, br'}})
try:
    r = urllib.request.urlopen(req, timeout=20)
    status, headers, body = r.status, str(r.headers), r.read()
except urllib.error.HTTPError as e:
    status, headers, body = e.code, str(e.headers), e.read()
except Exception as e:
    status, headers, body = 0, '', repr(e).encode()
print('status', status)
print(headers)
print(repr(body))
print(body.decode('latin-1'))
if body[:2] == b'\\x1f\\x8b':
    print(gzip.decompress(body).decode('latin-1'))
"""


def test_a_bound_host_answering_gzip_is_refused_and_the_box_never_sees_the_value(box):
    """The box asks for gzip; the door asks the bound host for identity. A host that gzips its echo of the bound header
    whatever it is asked (as a content coding or a transfer coding) would carry the value past a scrubber of raw
    bytes: the box gets a 502 naming the coding, never a byte of the response; the bundle holds no byte of the value;
    the connection's signed end says why. A host that honours Accept-Encoding answers in identity, scrubbed."""
    gzipped = _stdout(box.run(["python3", "-c", GZIP_PROBE.format(path="/gzip-echo")]))
    transfer = _stdout(box.run(["python3", "-c", GZIP_PROBE.format(path="/gzip-te-echo")]))
    negotiated = _stdout(box.run(["python3", "-c", GZIP_PROBE.format(path="/negotiated-echo")]))
    assert "status 502" in gzipped and "Content-Encoding: gzip cannot be scrubbed" in gzipped, gzipped
    assert "status 502" in transfer and "Transfer-Encoding" in transfer, transfer
    assert "status 200" in negotiated and re.search(r"(?im)^accept-encoding: identity$", negotiated), negotiated
    assert "Bearer " + "*" * len(VALUE) in negotiated and "content-encoding" not in negotiated.lower(), negotiated
    for out in (gzipped, transfer, negotiated):
        assert VALUE not in out
    box.stop()
    with zipfile.ZipFile(box.bundle_file) as z:
        for name in z.namelist():
            assert VALUE.encode() not in z.read(name), name
    assert verify_bundle(box.bundle_file).valid
    ends = [c.result for c in open_run(box.bundle_file).crossings()
            if c.door == "egress" and c.args["host"] == "api.tkb.test" and c.result]
    errors = sorted(r.get("error", "") for r in ends)
    assert len(ends) == 3 and errors[0] == "", errors  # the negotiated one ended well
    assert errors[1].startswith("refused by the secrets door: Content-Encoding: gzip"), errors
    assert errors[2].startswith("refused by the secrets door:") and "Transfer-Encoding" in errors[2], errors


PLAIN_BODY = """import http.client, os, time, urllib.parse
proxy = urllib.parse.urlsplit(os.environ.get('http_proxy') or os.environ['HTTP_PROXY'])
ph = os.environ['API_KEY'].encode()
body = b'a' * 100 + ph + b'b' * 100
cut = 100 + len(ph) // 2
c = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=20)
c.putrequest('POST', 'http://web.tkb.test:8080/echo', skip_host=True, skip_accept_encoding=True)
c.putheader('Host', 'web.tkb.test:8080')
c.putheader('Content-Length', str(len(body)))
c.endheaders()
for part in (body[:cut], body[cut:]):  # the placeholder split over two sends, after the head
    time.sleep(0.5)
    c.send(part)
r = c.getresponse()
print(r.status, r.read().decode())
"""


def test_a_placeholder_in_a_plain_http_body_is_flagged_and_each_record_says_whether_it_came_over_tls(box):
    """The body of a plain-HTTP request (sent after its head, the placeholder split between two sends) is checked as
    the headers are: the placeholder goes out as itself, flagged; a misuse over plain HTTP is signed `tls: false`, and
    a swap and a body misuse over the intercepted TLS `tls: true`."""
    out = _stdout(box.run(["python3", "-c", PLAIN_BODY]))
    assert out.startswith("200 POST /echo") and re.search(r"a{100}tkbox-ph-[0-9a-f]{32}b{100}", out), out
    tls = _stdout(box.run(["python3", "-c", "import os, urllib.request\n"
                           "req = urllib.request.Request('https://api.tkb.test:8443/echo', data=os.environ['API_KEY']"
                           ".encode(), headers={'Authorization': 'Bearer ' + os.environ['API_KEY']})\n"
                           "print(urllib.request.urlopen(req, timeout=20).read().decode())"]))
    assert VALUE not in out + tls
    box.stop()
    assert verify_bundle(box.bundle_file).valid
    secrets = [c for c in open_run(box.bundle_file).crossings() if c.door == "secrets" and c.args["kind"] != "bind"]
    stated = sorted((c.args["kind"], c.args.get("where", ""), c.args["tls"], c.decision) for c in secrets)
    assert stated == [("misuse", "body", True, "flag"), ("misuse", "body (plain http) to web.tkb.test", False, "flag"),
                      ("swap", "", True, "allow")], stated


def test_a_placeholder_in_a_plain_http_body_can_be_refused_and_ends_the_connection(signer, net, tmp_path,
                                                                                    monkeypatch):
    """Refused by the binding: the send that completes the placeholder never goes upstream; the box gets the door's
    403 naming the rule instead of the echo; the refusal is signed and is the connection's signed end."""
    monkeypatch.setenv("TKB_TEST_API_KEY", VALUE)
    bundle = tmp_path / "plain.tkb"
    with Box(backend="bwrap", policy=secrets_policy(net, misuse="refuse"), bundle_path=bundle) as b:
        out = _stdout(b.run(["python3", "-c", PLAIN_BODY]))
    assert out.startswith("403 tkbox secrets door: refused") and "secrets.misuse" in out, out
    assert "POST /echo" not in out  # the upstream never answered: it never had the whole body
    crossings = open_run(bundle).crossings()
    misuses = [c for c in crossings if c.door == "secrets" and c.args["kind"] == "misuse"]
    assert [(c.args["where"], c.args["tls"], c.decision) for c in misuses] == \
        [("body (plain http) to web.tkb.test", False, "deny")]
    ends = [c.result for c in crossings if c.door == "egress" and c.args["host"] == "web.tkb.test"]
    assert len(ends) == 1 and ends[0]["error"].startswith("refused by the secrets door: secrets.misuse"), ends
