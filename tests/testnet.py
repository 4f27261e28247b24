"""Test and benchmark hosts in a network namespace on 198.18.0.0/15: a web server, dnsmasq, and a DNS server whose
answer flips.

Everything runs inside a namespace made here and removed on exit (processes, the veth pair, the namespace). The
host reaches it through a veth on 198.18.N.1; the namespace's services listen on 198.18.N.2 (web on 8080, dnsmasq on
53) and 198.18.N.3 (the flipping DNS server on 53). Nothing is sent anywhere else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

WEB_SERVER = textwrap.dedent('''
    import http.server, os, sys, time
    DELAY = os.path.join(os.path.dirname(sys.argv[2]), "delay-ms")  # NamespaceNet.set_delay_ms writes it
    def wait():
        # a modelled network distance: one wait per request before answering, standing for one round trip to a
        # distant index (this machine has no netem to delay the link itself)
        try:
            with open(DELAY) as f:
                time.sleep(int(f.read()) / 1000)
        except (OSError, ValueError):
            pass
    class H(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            wait()
            if self.path.startswith("/redirect"):
                self.send_response(302)
                self.send_header("Location", sys.argv[3])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path.startswith(("/gzip-echo", "/negotiated-echo", "/gzip-te-echo")):
                # the request's headers echoed gzipped: always, as the client asks (Accept-Encoding), or as a transfer
                # coding (HTTP/1.1 "Transfer-Encoding: gzip, chunked")
                import gzip
                body = "".join(f"{k}: {v}\\n" for k, v in self.headers.items()).encode()
                gzipped = (self.path.startswith(("/gzip-echo", "/gzip-te-echo"))
                           or "gzip" in self.headers.get("Accept-Encoding", ""))
                if self.path.startswith("/gzip-te-echo"):
                    data = gzip.compress(body)
                    self.close_connection = True
                    head = b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: gzip, chunked\\r\\nConnection: close\\r\\n\\r\\n"
                    self.wfile.write(head + b"%x\\r\\n" % len(data) + data + b"\\r\\n0\\r\\n\\r\\n")
                    return
                body = gzip.compress(body) if gzipped else body
                self.send_response(200)
                if gzipped:
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path.startswith("/echo-headers"):
                body = "".join(f"{k}: {v}\\n" for k, v in self.headers.items()).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            return super().do_GET()
        def end_headers(self):
            # a Cache-Control for the index pages under /simple/ when the test put one in simple/.cache-control (as
            # PyPI states max-age=600 for its pages)
            if self.path.startswith("/simple/"):
                try:
                    with open(self.directory + "/simple/.cache-control") as f:
                        self.send_header("Cache-Control", f.read().strip())
                except OSError:
                    pass
            super().end_headers()
        def log_message(self, *a):
            pass
        def do_POST(self):
            wait()
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            text = f"{self.command} {self.path}\\n" + "".join(f"{k}: {v}\\n" for k, v in self.headers.items())
            data = (text + "\\n").encode() + body
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    http.server.ThreadingHTTPServer.daemon_threads = True
    make = lambda port: http.server.ThreadingHTTPServer((sys.argv[1], port), lambda *a: H(*a, directory=sys.argv[2]))
    if len(sys.argv) > 4:  # HTTPS on 8443 with the given certificate chain
        import ssl, threading
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(sys.argv[4])
        class TLSServer(http.server.ThreadingHTTPServer):
            def get_request(self):  # the handshake happens in the connection's own thread, never in accept
                sock, addr = self.socket.accept()
                return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr
            def finish_request(self, request, client_address):
                try:
                    request.do_handshake()
                except (OSError, ssl.SSLError):
                    return
                super().finish_request(request, client_address)
        tls = TLSServer((sys.argv[1], 8443), lambda *a: H(*a, directory=sys.argv[2]))
        threading.Thread(target=tls.serve_forever, daemon=True).start()
    make(8080).serve_forever()
''')

FLIP_DNS = textwrap.dedent('''
    import socket, sys, dns.message, dns.rrset
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 53))
    answers, n = sys.argv[2].split(","), 0
    while True:
        data, peer = s.recvfrom(4096)
        q = dns.message.from_wire(data)
        r = dns.message.make_response(q)
        question = q.question[0]
        if len(sys.argv) > 3:  # every name asked, for tests that a name is never looked up
            with open(sys.argv[3], "a") as log:
                log.write(question.name.to_text() + "\\n")
        if question.rdtype == 1:
            r.answer.append(dns.rrset.from_text(question.name, 0, "IN", "A", answers[n % len(answers)]))
            n += 1
        s.sendto(r.to_wire(), peer)
''')


LOCK_WAIT_S = 900  # how long a test waits for another run's use of the same test network to end


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class NamespaceNet:
    def __init__(self, index: int = 7, tls_chain: str | None = None):
        self.tls_chain = tls_chain  # a PEM file (key and certificate) for HTTPS on port 8443
        self.index = index
        self.name = f"tkb{index}p{os.getpid() % 100000}"
        self.host_if, self.ns_if = f"{self.name}h", f"{self.name}n"
        self.prefix = f"198.18.{index}"
        self.gateway, self.web, self.flip_dns = f"{self.prefix}.1", f"{self.prefix}.2", f"{self.prefix}.3"
        self.root = Path(tempfile.mkdtemp(prefix="tkbnet-", dir="/tmp"))
        self.procs: list[subprocess.Popen] = []

    def ns(self, *argv: str, **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def __enter__(self) -> "NamespaceNet":
        self._take_prefix()
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _run("ip", "link", "set", self.ns_if, "netns", self.name)
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            for cmd in (("ip", "addr", "add", f"{self.web}/24", "dev", self.ns_if),
                        ("ip", "addr", "add", f"{self.flip_dns}/24", "dev", self.ns_if),
                        ("ip", "link", "set", self.ns_if, "up"), ("ip", "link", "set", "lo", "up")):
                _run("ip", "netns", "exec", self.name, *cmd)
            (self.root / "www").mkdir()
            (self.root / "www" / "hello.txt").write_text("hello from the test network\n")
            (self.root / "web.py").write_text(WEB_SERVER)
            (self.root / "flip.py").write_text(FLIP_DNS)
            self.ns(sys.executable, str(self.root / "web.py"), self.web, str(self.root / "www"),
                    "http://other.tkb.test:8080/hello.txt", *([self.tls_chain] if self.tls_chain else []))
            p = self.prefix
            self.ns("dnsmasq", "--no-daemon", "--no-resolv", "--no-hosts", "--bind-interfaces",
                    f"--listen-address={self.web}", "--port=53", "--user=root",
                    f"--pid-file={self.root / 'dnsmasq.pid'}",
                    f"--address=/web.tkb.test/{p}.2", f"--address=/other.tkb.test/{p}.2",
                    f"--address=/api.tkb.test/{p}.2",
                    "--address=/loop.tkb.test/127.0.0.1", "--address=/private.tkb.test/10.0.0.1",
                    "--address=/meta.tkb.test/169.254.169.254",
                    f"--host-record=mixed.tkb.test,{p}.2,fd00::1", f"--host-record=mapped.tkb.test,{p}.2,::ffff:7f00:1")
            self.ns(sys.executable, str(self.root / "flip.py"), self.flip_dns, f"{p}.2,127.0.0.1",
                    str(self.root / "flip-queries.log"))
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _take_prefix(self) -> None:
        """Hold 198.18.N/24 for this process until __exit__: two test runs on one machine (a CI run beside a
        developer's) that set up the same index at once would put two host routes on one prefix, and each would reach
        the other's servers. The second waits for the first (an flock, released by the kernel if its holder dies)."""
        import fcntl
        self._lock = open(f"/tmp/tkbox-testnet-{self.index}.lock", "a")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock.close()
                    raise RuntimeError(f"198.18.{self.index}.0/24 stayed in use by another test run for "
                                       f"{LOCK_WAIT_S} s")
                time.sleep(0.2)

    def _wait_ready(self) -> None:
        import socket
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.web, 8080), timeout=1).close()
                if self.tls_chain:
                    socket.create_connection((self.web, 8443), timeout=1).close()
                import dns.resolver
                r = dns.resolver.Resolver(configure=False)
                r.nameservers, r.lifetime = [self.web], 1
                r.resolve("web.tkb.test", "A")
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError("the test network's servers did not come up")

    def add_file(self, rel: str, data: bytes) -> None:
        path = self.root / "www" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def set_delay_ms(self, ms: int) -> None:
        """From now on the web server waits `ms` milliseconds before answering each GET or POST (0: at once): a model
        of an index that far away, one round trip per request, not a delayed network (no netem here). TCP handshakes,
        DNS and bandwidth are not delayed."""
        (self.root / "delay-ms").write_text(str(int(ms)))

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()  # the flock goes with it
            self._lock = None


def available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("dnsmasq"):
        return False, "needs iproute2 and dnsmasq-base (make test installs them)"
    return True, ""
