"""A box flooding the egress door with refused CONNECTs: its run stays bounded (issue 34).

Each door signs its first `[box] max_refusals` refusals one by one and past them only their count, at most once a
second (signing/refusal_caps.py), so the run's records, the signer's store and the signer's memory do not grow with the
flood; and a run that would near the size a bundle may hold is ended fail-closed, its bundle written.
"""

from __future__ import annotations

import io
import json
import subprocess
import time
import zipfile

import pytest
from conftest import VENV_BIN, run_cli

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

# N connections over T threads, each a CONNECT to a name no policy here allows (never looked up): prints the answers
FLOOD = """
import json, os, socket, sys, threading, time
n, threads = int(sys.argv[1]), int(sys.argv[2])
proxy = os.environ.get("HTTPS_PROXY", "http://127.0.0.1:3128").rsplit("/", 1)[-1].rsplit(":", 1)
answers, lock = {}, threading.Lock()
def one(i):
    with socket.create_connection((proxy[0], int(proxy[1])), timeout=60) as s:
        host = f"flood{i}.refused.test:443"
        s.sendall(f"CONNECT {host} HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n".encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    code = data.split(b" ", 2)[1].decode() if data.count(b" ") >= 2 else "none"
    with lock:
        answers[code] = answers.get(code, 0) + 1
def worker(k):
    for i in range(k, n, threads):
        try:
            one(i)
        except OSError as e:
            with lock:
                answers[type(e).__name__] = answers.get(type(e).__name__, 0) + 1
t0 = time.monotonic()
ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps(answers), round(time.monotonic() - t0, 2))
"""


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def store_bytes(signer) -> int:
    return sum(p.stat().st_size for p in signer.dir.rglob("*") if p.is_file())


def unpacked(path) -> int:
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as z:
        return sum(i.file_size for i in z.infolist())


def flood(box, n: int, threads: int = 16) -> tuple[dict, float]:
    r = box.run(["python3", "-c", FLOOD, str(n), str(threads)], timeout=600)
    answers, took = r.stdout.decode().rsplit(" ", 1)
    return json.loads(answers), float(took)


def test_a_refusal_flood_signs_its_first_refusals_then_counts_and_the_signer_does_not_grow(private_signer,
                                                                                           tmp_path):
    signer, cap, n = private_signer, 50, 3000
    out = tmp_path / "flood.tkb"
    with Box(backend="bwrap", policy=Policy.from_toml(f"[box]\nmax_refusals = {cap}\n"), home=signer.home,
             bundle_path=out) as b:
        flood(b, 2 * cap)  # the signer's memory as a box makes its first refusals, then the flood past the cap
        pid, store0 = signer.pid(), store_bytes(signer)
        rss0 = rss_kib(pid)
        answers, took = flood(b, n)
        time.sleep(1.2)  # the last count is signed by the timer, not only at the stop
        rss1, store1 = rss_kib(pid), store_bytes(signer)
    assert answers == {"403": n}, answers
    print(f"\nflood: {n} refused CONNECTs in {took:.1f}s ({n / took:.0f}/s); signer RSS {rss0} -> {rss1} KiB; "
          f"store {store0} -> {store1} bytes; bundle {out.stat().st_size} bytes")
    run = open_run(out)
    egress = [c for c in run.crossings() if c.door == "egress"]
    one_by_one = [c for c in egress if c.args.get("kind") == "connect"]
    counts = [c for c in egress if c.args.get("kind") == "refused_count"]
    assert len(one_by_one) == cap and all(c.decision == "deny" for c in one_by_one)
    assert sum(c.args["count"] for c in counts) == 2 * cap + n - cap
    assert 1 <= len(counts) <= took + 4  # at most one count a second, and one at the stop
    assert all(c.decision == "deny" and c.args["rules"] == {"egress.allow": c.args["count"]}
               and c.args["kinds"] == {"connect": c.args["count"]} for c in counts)
    assert len(run.crossings()) <= cap + took + 8  # the box's start and stop, the flood's commands, the counts
    assert rss1 - rss0 < 16 << 10, (rss0, rss1)  # the signer's memory does not grow with the flood
    assert store1 - store0 < 1 << 20, (store0, store1)  # nor its store: n records would be about 3 MB
    df = run.to_dataframe()
    assert set(df[df["kind"] == "refused_count"]["status"]) == {"counted"}
    assert verify_bundle(out, trust=signer.trust_path).valid
    r = run_cli("verify", str(out), "--trust", str(signer.trust_path))
    assert r.returncode == 0 and r.stdout.startswith("VALID"), r.stdout + r.stderr
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(out), "--trust", str(signer.trust_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "Integrity: VERIFIED." in r.stdout, r.stdout


def test_a_run_reaching_its_size_limit_is_ended_fail_closed_with_its_bundle_written(private_signer, tmp_path):
    """With refusals signed one by one past any flood here, the run's size ends the box before the bundle limit:
    the estimate that ends it is never below what the bundle holds."""
    signer = private_signer
    out = tmp_path / "full.tkb"
    box = Box(backend="bwrap", policy=Policy.from_toml("[box]\nmax_refusals = 100000\nmax_run_mib = 1\n"),
              home=signer.home, bundle_path=out)
    with box as b:
        try:
            flood(b, 3000, threads=8)
        except Exception as e:  # the box is ended under the command: it may not answer
            print("flood ended:", type(e).__name__, str(e)[:200])
        assert b.recorder.full and "max_run_mib" in b.ended
        estimate = b.recorder.run_bytes
    assert out.exists()
    run = open_run(out)
    assert "max_run_mib" in run.box["end_reason"]
    assert [c for c in run.crossings() if c.door == "box"][-1].args["reason"] == run.box["end_reason"]
    assert unpacked(out) <= estimate, (unpacked(out), estimate)  # the estimate bounds the bundle from above
    print(f"\nfull: {len(run.crossings())} records, estimated {estimate} bytes, unpacked {unpacked(out)} bytes")
    assert verify_bundle(out, trust=signer.trust_path).valid


FETCH_MANY = """
import sys, urllib.request
codes = []
for _ in range(int(sys.argv[2])):
    try:
        codes.append(urllib.request.urlopen(sys.argv[1], timeout=20).status)
    except urllib.error.HTTPError as e:
        codes.append(e.code)
print(codes)
"""


def test_allowed_connections_past_max_connections_are_refused_counted_and_recounted_by_verify(private_signer,
                                                                                             tmp_path):
    from testnet import NamespaceNet, available
    if not available()[0]:
        pytest.skip(available()[1])
    signer, out = private_signer, tmp_path / "conns.tkb"
    with NamespaceNet(index=34) as net:  # 198.18.34.0/24: no other test module uses it
        pol = Policy.from_toml(f'[box]\nmax_refusals = 3\n[egress]\nallow = ["{net.web}:8080"]\n'
                               f'allow_cidrs = ["198.18.0.0/15"]\nmax_connections = 4\n')
        with Box(backend="bwrap", policy=pol, home=signer.home, bundle_path=out) as b:
            r = b.run(["python3", "-c", FETCH_MANY, f"http://{net.web}:8080/hello.txt", "10"])
    assert r.stdout.decode().strip() == str([200] * 4 + [403] * 6), r.stdout + r.stderr
    egress = [c for c in open_run(out).crossings() if c.door == "egress"]
    connects = [c for c in egress if c.args["kind"] == "connect"]
    assert [(c.decision, c.args["run_connections"]) for c in connects] == \
        [("allow", n) for n in range(4)] + [("deny", 4)] * 3
    assert {c.args["rule"] for c in connects[4:]} == {"egress.max_connections"}
    counts = [c.args for c in egress if c.args["kind"] == "refused_count"]  # the first at once, the rest later
    assert sum(a["count"] for a in counts) == 3 and all(a["rules"] == {"egress.max_connections": a["count"]}
                                                        for a in counts)
    assert verify_bundle(out, trust=signer.trust_path).valid
