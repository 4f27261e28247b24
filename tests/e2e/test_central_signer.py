"""Boxes on two simulated hosts signing into one central Tracekit signer (HTTPS, token identity, Postgres store).

The test starts a real Postgres (Debian's, as the postgres user, on a Unix socket in a temporary directory, no TCP),
a real `tracekit signer serve` with its store in it, serving HTTPS with a certificate from a test CA on 198.18.61.1,
and two network namespaces ("hosts"), each reaching the signer through its own veth pair. In each, a separate
process runs a bubblewrap box whose policy's [signer] section names the central signer; the bundles verify with
the central signer's trust, with `tkbox verify` and `tracekit verify`. The signer killed mid-run makes both boxes
fail closed; once it is back, each host's recovery closes its run with the reason and writes a bundle that verifies.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.signing.signer import BOX_PACK
from tkbox_nb.bundle.verify import verify_bundle

VENV_BIN = Path(sys.executable).parent

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None) if Path("/usr/lib/postgresql").is_dir() \
    else None
REPO = Path(__file__).resolve().parents[2]


def _why_not() -> str:
    if os.geteuid() != 0:
        return "network namespaces and a Postgres run as its own user need root"
    if PG_BIN is None or not (PG_BIN / "postgres").exists():
        return "Postgres is not installed (apt-get install postgresql)"
    if not shutil.which("ip"):
        return "needs iproute2"
    ok, why = BwrapBackend().available()
    if not ok:
        return why
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "ok")


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}"[:800])
    return r


# -- Postgres --------------------------------------------------------------------------------------------------------
def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to a server's process group (Postgres and the signer shut down cleanly on it), SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


class Postgres:
    """A throwaway cluster run by the postgres user, reachable only on a Unix socket in `root`/sock."""

    def __init__(self, root: Path):
        self.root, self.data, self.sock = root, root / "pgdata", root / "sock"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Postgres":
        self.root.mkdir()
        os.chmod(self.root, 0o711)
        for d in (self.data, self.sock):
            d.mkdir()
            shutil.chown(d, "postgres", "postgres")
        _run("runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres",
             "--auth=trust", "-E", "UTF8", "--no-sync", cwd="/")
        log = open(self.root / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            ["runuser", "-u", "postgres", "--", str(PG_BIN / "postgres"), "-D", str(self.data), "-k", str(self.sock),
             "-c", "listen_addresses=", "-c", "fsync=off"], stdout=log, stderr=log, cwd="/", start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while not (self.sock / ".s.PGSQL.5432").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {(self.root / 'postgres.log').read_text()[-500:]}")
            time.sleep(0.1)
        for _ in range(100):
            if subprocess.run([str(PG_BIN / "pg_isready"), "-h", str(self.sock)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        return self

    def dsn(self, user: str, db: str = "tracekit") -> str:
        return f"host={self.sock} dbname={db} user={user}"

    def sql(self, statements: str, db: str = "tracekit") -> None:
        import psycopg
        with psycopg.connect(self.dsn("postgres", db), autocommit=True) as conn:
            conn.execute(statements)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_group(self.proc)


# -- TLS -------------------------------------------------------------------------------------------------------------
def make_ca(out: Path, name: str, server_ip: str | None = None) -> None:
    """`out`/ca.pem; with `server_ip`, also server.pem and server.key for that address (cryptography, P-256)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    if server_ip is None:
        return
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tkbox central signer (test)")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_ip))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (out / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    os.chmod(out / "server.key", 0o600)


# -- the simulated hosts' network ------------------------------------------------------------------------------------
class Hosts:
    """Network namespaces host1..hostN. Host N's namespace has 198.18.6N.2 on a veth whose root end is 198.18.6N.1.
    The signer listens on 198.18.61.1 (host1's link, in the root namespace); every host has one route: to it."""

    def __init__(self, count: int):
        tag = os.getpid() % 100000
        self.names = [f"tkc{i}p{tag}" for i in range(1, count + 1)]
        self.signer_ip = "198.18.61.1"

    def __enter__(self) -> "Hosts":
        try:
            for i, ns in enumerate(self.names, 1):
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", f"{ns}h", "type", "veth", "peer", "name", f"{ns}n")
                _run("ip", "link", "set", f"{ns}n", "netns", ns)
                _run("ip", "addr", "add", f"198.18.6{i}.1/24", "dev", f"{ns}h")
                _run("ip", "link", "set", f"{ns}h", "up")
                for cmd in (("ip", "addr", "add", f"198.18.6{i}.2/24", "dev", f"{ns}n"),
                            ("ip", "link", "set", f"{ns}n", "up"), ("ip", "link", "set", "lo", "up"),
                            *([("ip", "route", "add", f"{self.signer_ip}/32", "via", f"198.18.6{i}.1")]
                              if i > 1 else [])):
                    _run("ip", "netns", "exec", ns, *cmd)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            subprocess.run(["ip", "link", "del", f"{ns}h"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- the central signer ----------------------------------------------------------------------------------------------
HOST_GRANTS = ["register_run", "decide", "complete", "close_run", "model_event", "status", "read",
               "checkpoint_nudge", "content_read"]


class CentralTracekit:
    """`tracekit signer serve` with the box pack, HTTPS on `listen`, token identity, its store in Postgres and its
    content vault on (the salts a bundle needs come from it)."""

    def __init__(self, root: Path, pg: Postgres, listen: str, hosts: list[str]):
        self.root, self.pg, self.listen, self.hosts = root, pg, listen, hosts
        self.config = root / "signer.yaml"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def setup(self) -> "CentralTracekit":
        from tracekit.storage import pg_schema
        self.root.mkdir(mode=0o700)
        make_ca(self.root / "tls", "tkbox test CA", self.listen.rpartition(":")[0])
        self.pg.sql("CREATE DATABASE tracekit", db="postgres")
        self.pg.sql("CREATE ROLE tk_signer LOGIN; CREATE ROLE tk_reader LOGIN")
        for role, mode in (("postgres", "migrate"), ("tk_signer", "signer"), ("tk_reader", "reader")):
            (self.root / f"{mode}.dsn").write_text(self.pg.dsn(role) + "\n")
            os.chmod(self.root / f"{mode}.dsn", 0o600)
        (self.root / "box-pack.yaml").write_text(BOX_PACK)
        grants = {**{h: HOST_GRANTS for h in self.hosts}, "nosalt": [g for g in HOST_GRANTS if g != "content_read"]}
        authorize = ", ".join(f'"token:{h}": [{", ".join(g)}]' for h, g in grants.items())
        base = textwrap.dedent(f"""\
            data_dir: ./data
            policy: ./box-pack.yaml
            durability: ack-on-fsync
            limits: {{events_per_s: 100000, burst: 100000}}
            fail_modes: {{default: closed}}
            grace_s: 0.5
            idle_s: 86400
            origin: tkbox.central/test
            posture: {{network: enforced, tool_calls: enforced}}
            content: {{retain: true}}
            http: {{listen: "{self.listen}", cert: tls/server.pem, key: tls/server.key, authenticators: [token],
                    tokens: tokens.json}}
            authorize: {{{authorize}}}
            """)
        (self.root / "migrate.yaml").write_text(base + "storage: {postgres: {dsn_file: migrate.dsn}}\n")
        self.base = base.replace(self.listen, "{listen}") + "storage: {postgres: {dsn_file: signer.dsn}}\n"
        self.config.write_text(self.base.replace("{listen}", self.listen))
        self.tracekit("signer", "migrate", "--config", str(self.root / "migrate.yaml"))
        self.pg.sql(pg_schema.GRANTS.format(schema="public", role="tk_signer")
                    + pg_schema.READ_GRANTS.format(schema="public", role="tk_reader"))
        for h in [*self.hosts, "nosalt"]:
            token = self.tracekit("signer", "token", "add", h, "--ttl", "1d", "--config", str(self.config))
            (self.root / f"{h}.token").write_text(token.stdout.strip() + "\n")
            os.chmod(self.root / f"{h}.token", 0o600)
        return self

    def tracekit(self, *args: str) -> subprocess.CompletedProcess:
        return _run(sys.executable, "-m", "tracekit", *args, cwd=self.root)

    def start(self) -> "CentralTracekit":
        self.config.write_text(self.base.replace("{listen}", self.listen))  # a restart: the port it had
        log = open(self.root / "signer.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tracekit", "signer", "serve", "--config",
                                      str(self.config)], cwd=self.root, stdout=log, stderr=log,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"serving on ([0-9.]+):([0-9]+)", (self.root / "signer.log").read_text(errors="replace"))
            if m and m.group(1) == self.listen.rpartition(":")[0]:
                self.url = f"https://{m.group(1)}:{m.group(2)}"
                self.listen = f"{m.group(1)}:{m.group(2)}"  # a restart keeps the port the hosts' policies name
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the central signer did not start: {(self.root / 'signer.log').read_text()[-800:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with open(self.root / "signer.log", "ab") as log:  # a restart's "serving on" line is the only one read
            log.write(b"\n-- killed by the test --\n")
        (self.root / "signer.log").rename(self.root / f"signer.{time.monotonic_ns()}.log")

    def write_trust(self) -> Path:
        out = self.root / "trust.json"
        self.tracekit("signer", "trust", "--config", str(self.config), "-o", str(out))
        return out

    def host_policy(self, host: str, trust: Path) -> str:
        return textwrap.dedent(f"""\
            [box]
            backend = "bwrap"

            [exec]
            commands = ["*"]

            [signer]
            url = "{self.url}"
            token_file = "{self.root / (host + '.token')}"
            ca = "{self.root / 'tls' / 'ca.pem'}"
            trust = "{trust}"
            store_dsn_file = "{self.root / 'reader.dsn'}"
            """)


# -- what each host runs ---------------------------------------------------------------------------------------------
HOST_SCRIPT = textwrap.dedent('''
    """One simulated host: a box signing into the central signer, then (phase "outage") a wait for the test to
    stop the signer, and what the box does then."""
    import json, sys, time
    from pathlib import Path
    from tkbox_nb import Box, BoxEnded, DoorRefused, Policy

    policy, home, out, phase = Policy.load(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    report = {"host": sys.argv[5]}
    box = Box(policy=policy, home=home, bundle_path=out / "box.tkb").start()
    report["run_id"] = box.run_id
    report["signer"] = repr(box.signer)
    r = box.run(["sh", "-c", "echo from $0; hostname -I 2>/dev/null | wc -w", sys.argv[5]])
    report["command"] = [r.exit_code, r.stdout.decode()]
    cell = box.execute(f"x = 6 * 7\\nprint('cell on', {sys.argv[5]!r}, x)")
    report["cell"] = "".join(o.get("text", "") for o in cell.outputs)
    if phase == "outage":
        (out / "ready").write_text("1")
        deadline = time.monotonic() + 120
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        try:
            box.run(["sh", "-c", "echo after the signer went > /workspace/after.txt"])
            report["after"] = "ran"
        except (DoorRefused, BoxEnded) as e:
            report["after"] = f"{type(e).__name__}: {e}"
        report["refused_after_s"] = round(time.monotonic() - t0, 2)
        report["ended"] = box.ended
        try:
            box.execute("print('still here?')")
            report["cell_after"] = "ran"
        except (DoorRefused, BoxEnded) as e:
            report["cell_after"] = f"{type(e).__name__}: {e}"
    try:
        report["bundle"] = str(box.stop())
    except BoxEnded as e:
        report["stop"] = str(e)
    (out / "report.json").write_text(json.dumps(report))
''')


@pytest.fixture(scope="module")
def central():
    root = Path(__import__("tempfile").mkdtemp(prefix="tkc-", dir="/tmp"))
    os.chmod(root, 0o711)  # the postgres user reaches its directories inside
    try:
        with Postgres(root / "pg") as pg, Hosts(2) as hosts:
            signer = CentralTracekit(root / "signer", pg, f"{hosts.signer_ip}:0", ["host1", "host2"])
            try:
                signer.setup().start()
                yield signer, hosts, signer.write_trust(), root
            finally:
                if signer.proc is not None and signer.proc.poll() is None:
                    stop_group(signer.proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start_hosts(signer, hosts, trust, root: Path, phase: str) -> list[tuple[subprocess.Popen, Path, Path, Path]]:
    """One process per host, each in its namespace: (process, its output dir, its TKBOX_HOME, its policy)."""
    script = root / "host.py"
    script.write_text(HOST_SCRIPT)
    started = []
    for i, ns in enumerate(hosts.names, 1):
        host = f"host{i}"
        out, home = root / phase / host, root / phase / f"{host}-home"
        out.mkdir(parents=True)
        policy = root / phase / f"{host}.toml"
        policy.write_text(signer.host_policy(host, trust))
        env = {**os.environ, "PYTHONPATH": str(REPO), "TKBOX_HOME": str(home)}
        log = open(out / "host.log", "wb")
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(script), str(policy), str(home),
                              str(out), phase, host], env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        started.append((p, out, home, policy))
    return started


def wait_all(started, timeout: float = 240) -> list[dict]:
    reports = []
    for p, out, _, _ in started:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        assert p.returncode == 0, (out / "host.log").read_text()[-3000:]
        reports.append(json.loads((out / "report.json").read_text()))
    return reports


def tracekit_verify(bundle: Path, trust: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(bundle), "--trust", str(trust)],
                          capture_output=True, text=True, timeout=120)


def test_boxes_on_two_hosts_sign_into_the_central_signer_and_their_bundles_verify(central, signer):
    machine_trust = signer.trust_path
    signer, hosts, trust, root = central
    reports = wait_all(start_hosts(signer, hosts, trust, root, "normal"))
    assert len({r["run_id"] for r in reports}) == 2
    for i, r in enumerate(reports, 1):
        assert r["signer"] == f"CentralSigner({signer.url})"
        assert r["command"][0] == 0 and r["command"][1].startswith(f"from host{i}")
        assert f"cell on host{i} 42" in r["cell"]
        bundle = Path(r["bundle"])
        report = verify_bundle(bundle, trust)
        assert report.valid, report.summary()
        assert "VERIFIED" in report.integrity
        assert "(tkbox.central/test)" in report.assurance  # the central log's origin, not this host's
        tk = tracekit_verify(bundle, trust)
        assert tk.returncode == 0, tk.stdout + tk.stderr
        # a machine signer's trust is no trust for the central log: another key, another origin
        assert not verify_bundle(bundle, machine_trust).valid
        assert tracekit_verify(bundle, machine_trust).returncode != 0


def test_the_central_signer_lost_mid_run_ends_both_boxes_fail_closed_and_recovery_says_why(central):
    signer, hosts, trust, root = central
    started = start_hosts(signer, hosts, trust, root, "outage")
    deadline = time.monotonic() + 180
    while not all((out / "ready").exists() for _, out, _, _ in started):
        for p, out, _, _ in started:
            assert p.poll() is None, (out / "host.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the hosts' boxes did not come up"
        time.sleep(0.1)
    signer.kill()
    try:
        for _, out, _, _ in started:
            (out / "go").write_text("1")
        reports = wait_all(started)
    finally:
        signer.start()  # the same address and port: the hosts' policies name it
    for r in reports:
        # the door refused: nothing ran after the loss, and the box ended with the reason
        assert r["after"].startswith("DoorRefused") and "TKB-SIGNER-UNAVAILABLE" in r["after"], r
        assert r["ended"].startswith("signer lost:") and "Connection refused" in r["ended"], r
        assert r["cell_after"].startswith("BoxEnded"), r
        assert "no bundle yet" in r["stop"] and "bundle" not in r, r
        assert r["refused_after_s"] < 30, r
    # each host closes its own run once the signer answers again; the reason is the run's signed last word
    for (_, out, home, policy), r in zip(started, reports):
        ns = hosts.names[int(r["host"][-1]) - 1]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TKBOX_HOME": str(home)}
        rec = subprocess.run(["ip", "netns", "exec", ns, str(VENV_BIN / "tkbox"), "signer", "recover", "--policy",
                              str(policy)], env=env, capture_output=True, text=True, timeout=120)
        assert rec.returncode == 0 and "1 orphaned run(s) bundled" in rec.stdout, rec.stdout + rec.stderr
        bundle = out / "box.tkb"
        assert f"recovered {bundle}" in rec.stdout
        report = verify_bundle(bundle, trust)
        assert report.valid, report.summary()
        assert tracekit_verify(bundle, trust).returncode == 0
        from tkbox_nb.bundle.read_back import open_run
        run = open_run(bundle)
        assert run.run_id == r["run_id"]
        assert run.box["end_reason"].startswith("recovered: the run ended early (signer unavailable")
        assert "Connection refused" in run.box["end_reason"]
        stop = [c for c in run.crossings() if c.tool == "box.stop"]  # signed, its disclosed args opened by verify
        assert len(stop) == 1 and stop[0].decision == "allow"
        assert stop[0].args["reason"].startswith("recovered: the run ended early (signer unavailable")
        df = run.to_dataframe()
        assert not any("after the signer went" in str(s) for s in df["summary"]), "a refused command was recorded"
        assert any("from host" in str(s) or "echo" in str(s) for s in df["summary"])
        # `tkbox export` writes the closed run's bundle again, from the central store, and it verifies the same
        again = out / "again.tkb"
        x = subprocess.run(["ip", "netns", "exec", ns, str(VENV_BIN / "tkbox"), "export", r["run_id"], "-o",
                            str(again), "--policy", str(policy)], env=env, capture_output=True, text=True,
                           timeout=120)
        assert x.returncode == 0, x.stdout + x.stderr
        assert verify_bundle(again, trust).valid


def test_only_the_pinned_ca_and_a_valid_token_reach_the_central_signer(central, tmp_path):
    """A signer certificate that does not chain to the pinned CA, or a token the signer does not know, and the box
    never starts: nothing is decided, nothing runs."""
    from tkbox_nb import Box
    from tkbox_nb.signing.central import CentralSigner
    from tkbox_nb.core.errors import SignerError
    from tkbox_nb.policy import Policy

    signer, hosts, trust, root = central
    good = Policy.from_toml(signer.host_policy("host1", trust), "central.toml")
    pinned = CentralSigner.from_policy(good, tmp_path / "h0")
    assert pinned.answering()  # the test CA is in no system store: only the pinned context reaches the signer
    assert len(pinned._tls().get_ca_certs()) == 1 and pinned._tls().check_hostname  # that CA and nothing else

    make_ca(tmp_path / "other", "another CA")  # a CA the signer's certificate does not chain to
    system = Path(__import__("ssl").get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    bad_token = tmp_path / "bad.token"
    bad_token.write_text("tk_" + "0" * 40 + "\n")
    cases = {
        "another CA": (signer.host_policy("host1", trust).replace(str(signer.root / "tls" / "ca.pem"),
                                                                  str(tmp_path / "other" / "ca.pem")), "verif"),
        "the system store": (signer.host_policy("host1", trust).replace(str(signer.root / "tls" / "ca.pem"),
                                                                        str(system)), "verif"),
        "an unknown token": (signer.host_policy("host1", trust).replace(str(signer.root / "host1.token"),
                                                                        str(bad_token)), "unauthenticated"),
    }
    for name, (text, why) in cases.items():
        if name == "the system store" and not system.is_file():
            continue
        policy = Policy.from_toml(text, f"{name}.toml")
        home = tmp_path / name.replace(" ", "-")
        assert not CentralSigner.from_policy(policy, home).answering(), name
        with pytest.raises(SignerError) as e:
            Box(policy=policy, backend="bwrap", home=home).start()
        assert why in str(e.value).lower(), (name, str(e.value))
        assert not list((home / "central").glob("*/runs/*")), f"{name}: a run was opened"


def test_a_host_token_without_the_content_read_grant_gets_no_bundle_and_says_why(central, tmp_path):
    """Salts come only from the signer's content vault: a host whose token may not read it cannot write bundles,
    and says so in one line, instead of writing one with content nobody could open."""
    from tkbox_nb.signing.central import CentralSigner
    from tkbox_nb.core.errors import SignerError
    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder

    signer, hosts, trust, root = central
    policy = Policy.from_toml(signer.host_policy("host1", trust), "central.toml")
    for host, expect_ok in (("host1", True), ("nosalt", False)):
        policy = Policy.from_toml(signer.host_policy(host, trust), f"{host}.toml")
        rec = RunRecorder(CentralSigner.from_policy(policy, tmp_path / host), policy,
                          {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
        c = rec.decide("exec", "command", {"argv": ["true"]})
        assert c.allowed  # deciding needs no vault: the box runs
        rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"", "stderr": b""})
        rec.close("test done")
        out = tmp_path / f"{host}.tkb"
        if expect_ok:
            rec.write_bundle(out)
            assert verify_bundle(out, trust).valid
        else:
            with pytest.raises(SignerError, match="gave no salts.*forbidden"):
                rec.write_bundle(out)
            assert not out.exists()
