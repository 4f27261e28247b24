"""The audit as a reproducibility check of agent runs: a battery of real bwrap runs, each differing from one original in
exactly one thing, each found by `tkbox audit` with the right kind at the right seq; two runs with nothing to compare
are not called equivalent.

The knob that makes one thing differ without touching the rest is the value of an environment variable a command sets:
the bundle records its name only, so argv, env names and the rest stay equal while the command's exit status, output,
or what a later cell reads from /tmp change.

Two more pairs cross the network doors, for real: a fetch through the egress door to a web server in a network
namespace on 198.18.26.0/24, and a model call through the model door to the stand-in upstream (fake_models.py) there.
One pair differs in the egress destination (another allowed host, by the same knob), the other in the model's answer to
the same request (the upstream started to answer differently); an honest rerun goes out to the same test host again and
gets the model's answer from the original's recording, and is equivalent."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import forged_bundle, run_cli

from tkbox_nb import Box, open_run
from tkbox_nb.audit.compare import EXIT_INCOMPARABLE, audit
from tkbox_nb.backends.bwrap import BwrapBackend
from testnet import NamespaceNet
from testnet import available as net_available
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

POLICY = "[exec]\ncells = true\n"
SCRIPT = 'seq 1 200; printf "%s\\n" "$OUT"; printf "%s\\n" "$ERR" >&2; printf "%s" "$NOTE" > /tmp/note; exit "$CODE"'
CELL = "print(open('/tmp/note').read(), 6 * 7)"
BASE = {"OUT": "hello", "ERR": "warn", "NOTE": "six", "CODE": "0", "PATCH": "v1"}


def record(out: Path, ws: Path, env=BASE, script=SCRIPT, cell=CELL, policy=POLICY) -> Path:
    """A command, a cell, a command: what an agent run holds, through the Box API (as an agent drives it)."""
    with Box(policy=policy, backend="bwrap", workspace=ws, bundle_path=out) as box:
        box.run(["sh", "-c", script], env={k: env[k] for k in ("OUT", "ERR", "NOTE", "CODE")})
        box.execute(cell)
        box.run(["sh", "-c", 'cat > in.txt; printf "%s\\n" "$PATCH" > out.txt'], stdin=b"given on stdin\n",
                cwd="/workspace", env={"PATCH": env["PATCH"]}, timeout=60)
    return out


# each variant: (name, how it is recorded, the kind audit must name, which exec crossing (index) or None for the box)
VARIANTS = [
    ("argv", dict(script=SCRIPT.replace("exit ", "exit  ")), "command argv", 0),
    ("exit", dict(env={**BASE, "CODE": "3"}), "command exit status", 0),
    ("stdout", dict(env={**BASE, "OUT": "hellp"}), "command stdout", 0),
    ("stderr", dict(env={**BASE, "ERR": "worn"}), "command stderr", 0),
    ("cell-code", dict(cell=CELL.replace("6 * 7", "7 * 6")), "cell code", 1),
    ("cell-output", dict(env={**BASE, "NOTE": "sax"}), "cell outputs", 1),
    ("patch", dict(env={**BASE, "PATCH": "v2"}), "patch", None),
    ("policy", dict(policy=POLICY + "timeout_s = 601\n"), "starting policy", None),
]


@pytest.fixture(scope="module")
def runs(signer, tmp_path_factory):
    d = tmp_path_factory.mktemp("battery")
    ws = d / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("the starting workspace\n")
    out = {"original": record(d / "original.tkb", ws)}
    for name, kw, _, _ in VARIANTS:
        out[name] = record(d / f"{name}.tkb", ws, **kw)
    return out


def exec_seqs(path: Path) -> list[int]:
    return [c.seq for c in open_run(path).crossings() if c.door == "exec"]


def test_the_original_holds_commands_and_a_cell_with_what_they_did(runs):
    run = open_run(runs["original"])
    cmds = [c for c in run.crossings() if c.door == "exec" and c.args["kind"] == "command"]
    assert [c.args.get("env_names") for c in cmds] == [["CODE", "ERR", "NOTE", "OUT"], ["PATCH"]]
    assert "hello" not in json.dumps([c.args for c in cmds])  # names, never values
    assert cmds[1].args["cwd"] == "/workspace" and cmds[1].args["timeout_s"] == 60 and cmds[1].args["stdin"]
    assert run.box["workspace_digest"].startswith("tree2:sha256:") and verify_bundle(runs["original"]).valid
    assert [c.door for c in run.crossings() if c.door in ("exec", "patch")] == ["exec", "exec", "exec", "patch",
                                                                              "patch", "patch"]


@pytest.mark.parametrize("name,kind,index", [(n, k, i) for n, _, k, i in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_each_single_difference_is_found_with_its_kind_and_seq(runs, name, kind, index):
    report = audit(runs["original"], runs[name])
    assert [d.kind for d in report.differences] == [kind], [(d.what, d.a[:80], d.b[:80]) for d in report.differences]
    d = report.differences[0]
    if index is not None:
        assert (d.seq_a, d.seq_b) == (exec_seqs(runs["original"])[index], exec_seqs(runs[name])[index])
    elif kind == "patch":  # out.txt, the patch's second file by path (in.txt is the first)
        seqs = [c.seq for r in (runs["original"], runs[name]) for c in open_run(r).crossings()
                if c.door == "patch" and c.args.get("path") == "out.txt"]
        assert d.what == "patch #2" and [d.seq_a, d.seq_b] == seqs
    else:  # the box's own start record
        assert d.seq_a == d.seq_b == 1 and d.a != d.b
    assert report.coverage["exec commands"] == (2, 2) and report.coverage["exec cells"] == (1, 1)


def test_a_large_output_is_shown_by_digest_with_a_short_diff(runs, tmp_path):
    r = run_cli("audit", str(runs["original"]), str(runs["stdout"]), "--json")
    assert r.returncode == 1, r.stderr
    [d] = json.loads(r.stdout)["differences"]
    assert d["what"] == "command stdout #1" and d["a"].startswith("sha256:") and d["a"] != d["b"]
    assert "-hello" in d["diff"] and "+hellp" in d["diff"] and len(d["diff"].splitlines()) < 12
    r = run_cli("audit", str(runs["original"]), str(runs["exit"]))
    assert r.returncode == 1 and r.stdout.startswith("DIFFERENT: 1 difference")
    assert "command exit status #1 (seq 3 in A, 3 in B)" in r.stdout and "exit 0" in r.stdout and "exit 3" in r.stdout


def test_an_equivalent_says_what_it_covers(runs):
    r = run_cli("audit", str(runs["original"]), str(runs["original"]))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT"), r.stdout
    assert "exec cells 1/1, exec commands 2/2" in r.stdout and "patch files 2/2" in r.stdout


def test_two_runs_with_nothing_to_compare_are_not_equivalent(signer, tmp_path):
    empty = []
    for i in range(2):
        with Box(backend="bwrap", bundle_path=tmp_path / f"empty{i}.tkb") as box:
            pass
        empty.append(box.bundle_path)
    r = run_cli("audit", str(empty[0]), str(empty[1]))
    assert r.returncode == EXIT_INCOMPARABLE == 3, r.stdout + r.stderr
    assert r.stdout.startswith("INCOMPARABLE") and "exec commands 0/0" in r.stdout
    r = run_cli("audit", str(empty[0]), str(empty[1]), "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["status"] == "incomparable"


def test_bad_input_is_one_line(runs, tmp_path):
    (tmp_path / "junk.tkb").write_bytes(b"not a zip")
    r = run_cli("audit", str(runs["original"]), str(tmp_path / "junk.tkb"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _made_to_look_like(src: Path, old: bytes, new: bytes, out: Path) -> Path:
    """A copy of `src` whose disclosed content has `old` replaced by `new` (the content's digests left as they were,
    the bundle's manifest recomputed): a forger's edit that makes a different run read like another one."""
    import base64

    from tkbox_nb.bundle.archive import read_bundle_file
    files = read_bundle_file(src)
    for name in [n for n in files if n.startswith("box/content-")]:
        lines = files[name].split(b"\n")
        for i, line in enumerate(lines):
            if line.strip():
                item = json.loads(line)
                item["b64"] = base64.b64encode(base64.b64decode(item["b64"]).replace(old, new)).decode()
                lines[i] = json.dumps(item).encode()
        files[name] = b"\n".join(lines)
    return forged_bundle(files, out)


def test_a_bundle_that_does_not_verify_is_not_audited(runs, tmp_path):
    """The stdout variant edited to print what the original printed: the audit verifies both bundles first, and
    says which one does not verify, in one line. Even unverified (--no-verify), the edited bytes are never read as
    the run's: a run serves content only when it hashes to the digest the record names."""
    forged = _made_to_look_like(runs["stdout"], b"hellp", b"hello", tmp_path / "forged.tkb")
    assert not verify_bundle(forged).valid
    r = run_cli("audit", str(runs["original"]), str(forged), "--no-verify")
    assert r.returncode == 1 and r.stdout.startswith("DIFFERENT") and "command stdout" in r.stdout, r.stdout
    for pair in ((runs["original"], forged), (forged, runs["original"])):
        r = run_cli("audit", *map(str, pair), "--html", str(tmp_path / "r.html"))
        assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "r.html").exists(), r.stdout
        assert r.stderr.startswith(f"tkbox audit: {forged} does not verify (INVALID") and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_report_that_cannot_be_written_is_one_line_and_nothing_is_left(runs, tmp_path):
    (tmp_path / "a-file").write_text("")
    for cmd in (["audit", str(runs["original"]), str(runs["original"]), "--html"],
                ["replay", str(runs["original"]), "-o"]):
        r = run_cli(*cmd, str(tmp_path / "a-file" / "out"))
        assert r.returncode == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
        assert r.stderr.strip() == f"tkbox {cmd[0]}: cannot write {tmp_path / 'a-file' / 'out'}: Not a directory"
    # a batch's report path is checked before any rerun starts
    r = run_cli("rerun", "--many", str(runs["original"]), "--out-dir", str(tmp_path / "reruns"), "--html",
                str(tmp_path / "a-file" / "r.html"))
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "reruns").exists(), r.stdout
    assert r.stderr.strip() == f"tkbox rerun: cannot write {tmp_path / 'a-file' / 'r.html'}: {tmp_path / 'a-file'} " \
        "is not a directory"
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "r.html").mkdir()  # a directory where the report would go: its write fails, as a full disk's
    r = run_cli("audit", str(runs["original"]), str(runs["original"]), "--html", str(tmp_path / "ro" / "r.html"))
    assert r.returncode == 2 and r.stderr.startswith(f"tkbox audit: cannot write {tmp_path / 'ro' / 'r.html'}: ")
    assert sorted(p.name for p in (tmp_path / "ro").iterdir()) == ["r.html"]  # no temporary file left behind
    for cmd in (["audit", str(runs["original"]), str(runs["original"]), "--html"],
                ["replay", str(runs["original"]), "-o"]):  # a path with no file name: one line, found by a review
        for path in (".", str(tmp_path) + "/.."):
            r = run_cli(*cmd, path)
            assert r.returncode == 2 and r.stderr.strip() == f"tkbox {cmd[0]}: cannot write {path}: not a file name"


def test_an_honest_rerun_of_the_original_is_equivalent_and_a_changed_workspace_is_said(runs, tmp_path):
    ws = runs["original"].parent / "ws"
    env = {k: BASE[k] for k in BASE}
    args = [a for k in BASE for a in ("--env", k)]
    r = run_cli("rerun", str(runs["original"]), "-o", str(tmp_path / "again.tkb"), "--workspace", str(ws), *args,
                env=env)
    assert r.returncode == 0 and "tkbox rerun:" not in r.stderr, r.stderr
    again = open_run(tmp_path / "again.tkb")
    assert again.box.get("rerun_of") == open_run(runs["original"]).run_id and "replay_of" not in again.box
    r = run_cli("audit", str(runs["original"]), str(tmp_path / "again.tkb"))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT"), r.stdout
    # the same rerun from another workspace: said at once, and audited as such (and nothing else differs)
    other = tmp_path / "other-ws"
    shutil.copytree(ws, other)
    (other / "data.txt").write_text("another starting workspace\n")
    r = run_cli("rerun", str(runs["original"]), "-o", str(tmp_path / "moved.tkb"), "--workspace", str(other), *args,
                env=env)
    assert r.returncode == 0 and "the original started from workspace tree2:sha256:" in r.stderr, r.stderr
    assert [d.kind for d in audit(runs["original"], tmp_path / "moved.tkb").differences] == ["workspace"]


def test_a_rerun_needs_the_values_of_the_environment_the_commands_set(runs, tmp_path):
    r = run_cli("rerun", str(runs["original"]), "-o", str(tmp_path / "x.tkb"))
    assert r.returncode == 2 and "CODE, ERR, NOTE, OUT, PATCH" in r.stderr and "--env NAME" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.tkb").exists()
    r = run_cli("rerun", str(runs["original"]), "-o", str(tmp_path / "x.tkb"), "--env", "TKB_SURELY_UNSET_26")
    assert r.returncode == 2 and "TKB_SURELY_UNSET_26" in r.stderr and "Traceback" not in r.stderr


def test_tkbox_run_bundles_rerun_equivalent_and_differ_where_the_commands_do(signer, tmp_path):
    """The issue's own steps: two one-command runs of `tkbox run`, audited, and one rerun."""
    for name, n in (("a", 10), ("b", 11)):
        r = run_cli("run", "--backend", "bwrap", "-o", str(tmp_path / f"{name}.tkb"), "--", "python3", "-c",
                    f"print(sum(range({n})))")
        assert r.returncode == 0 and r.stdout == str(sum(range(n))) + "\n", r.stderr
    r = run_cli("audit", str(tmp_path / "a.tkb"), str(tmp_path / "b.tkb"), "--json")
    assert r.returncode == 1
    assert [d["kind"] for d in json.loads(r.stdout)["differences"]] == ["command argv", "command stdout"]
    r = run_cli("rerun", str(tmp_path / "a.tkb"), "-o", str(tmp_path / "again.tkb"), "--backend", "bwrap")
    assert r.returncode == 0, r.stderr
    r = run_cli("audit", str(tmp_path / "a.tkb"), str(tmp_path / "again.tkb"))
    assert r.returncode == 0 and "exec commands 1/1" in r.stdout, r.stdout


# the network pairs: a fetch through the egress door, then a model call through the model door
NET_INDEX = 26  # 198.18.26.0/24, a test network no other test module uses (they may run at the same time)
WEB_URL, OTHER_URL = "http://web.tkb.test:8080/hello.txt", "http://other.tkb.test:8080/hello.txt"
FETCH = """
import os, urllib.request
r = urllib.request.urlopen(os.environ["URL"], timeout=20)
print(r.status, r.read().decode())
"""
# not the answer's text: what the command prints stays the same when the model answers differently, so that the model
# call is the pair's one difference (the stand-in's usage does not depend on its answer)
ASK = """
import json, os, urllib.request
body = json.dumps({"model": "gpt-4o-mini", "max_tokens": 20,
                   "messages": [{"role": "user", "content": "same question"}]})
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body.encode(),
                             {"Content-Type": "application/json"})
doc = json.load(urllib.request.urlopen(req, timeout=30))
print(doc["choices"][0]["finish_reason"], doc["usage"]["completion_tokens"])
"""


def net_policy(net, port: int) -> str:
    return (f'[egress]\nallow = ["web.tkb.test:8080", "other.tkb.test:8080"]\nallow_cidrs = ["{net.prefix}.0/24"]\n'
            f'nameservers = ["{net.web}"]\n\n[models]\nmode = "record"\nallow = ["openai:gpt-4o-mini"]\n\n'
            f'[models.openai]\nbase_url = "http://{net.web}:{port}"\nkey = "env:TKB_TEST_OPENAI_KEY"\n')


def net_record(out: Path, policy: str, url: str = WEB_URL) -> Path:
    """A fetch and a model call, each a command, through the Box API; the URL is the value of a variable the command
    sets, so another destination leaves its argv and env names as they were."""
    with Box(policy=policy, backend="bwrap", bundle_path=out) as box:
        for argv, env in ((["python3", "-c", FETCH], {"URL": url}), (["python3", "-c", ASK], None)):
            r = box.run(argv, env=env, timeout=60)
            assert r.exit_code == 0, r.stderr.decode()[-2000:]
    return out


@pytest.fixture(scope="module")
def net_runs(signer, tmp_path_factory):
    """The original and its two network variants, recorded once; the test network stays up for the rerun (its egress
    goes out again), the stand-in upstream does not (the rerun's model call must come from the recording)."""
    if not net_available()[0]:
        pytest.skip(net_available()[1])
    from e2e.test_models import OPENAI_KEY, PORT, Upstream
    d = tmp_path_factory.mktemp("battery-net")
    os.environ["TKB_TEST_OPENAI_KEY"] = OPENAI_KEY
    try:
        with NamespaceNet(index=NET_INDEX) as net:
            policy = net_policy(net, PORT)
            up = Upstream(net)
            try:
                runs = {"original": net_record(d / "original.tkb", policy),
                        "egress": net_record(d / "egress.tkb", policy, url=OTHER_URL)}
                seen = up.requests()
            finally:
                up.stop()
            up = Upstream(net, says="ekho")  # the same request, answered differently
            try:
                runs["model"] = net_record(d / "model.tkb", policy)
                seen += up.requests()
            finally:
                up.stop()
            yield {"net": net, "runs": runs, "seen": seen, "key": OPENAI_KEY}
    finally:
        os.environ.pop("TKB_TEST_OPENAI_KEY", None)


def door_rows(path: Path, door: str):
    return [c for c in open_run(path).crossings() if c.door == door]


def test_the_network_runs_crossed_the_real_doors_to_the_test_hosts(net_runs):
    """The pairs below mean something only if each run really went out: the egress door dialled the test web
    server's address and carried its bytes, the model door reached the stand-in with the host's key and recorded
    its answer, which the variant's upstream gave differently."""
    net, runs = net_runs["net"], net_runs["runs"]
    for name, host, says in (("original", "web.tkb.test", b"echo"), ("egress", "other.tkb.test", b"echo"),
                             ("model", "web.tkb.test", b"ekho")):
        run = open_run(runs[name])
        [e] = door_rows(runs[name], "egress")
        assert (e.decision, e.args["host"], e.args["address"]) == ("allow", host, net.web)
        assert e.result["bytes_down"] > 0
        [m] = door_rows(runs[name], "model")
        assert m.decision == "allow" and m.args["mode"] == "record"
        assert says + b": same question" in run.content(m.result["response"])
        outs = [c.result["stdout"] for c in run.crossings() if c.door == "exec"]
        assert [run.content(o) for o in outs] == [b"200 hello from the test network\n\n", b"stop 7\n"]
        assert verify_bundle(runs[name]).valid
    assert [r["authorization"] for r in net_runs["seen"]] == [f"Bearer {net_runs['key']}"] * 3


@pytest.mark.parametrize("name,kind", [("egress", "egress"), ("model", "model calls")],
                         ids=["egress-destination", "model-response"])
def test_an_egress_destination_and_a_model_answer_are_found_with_their_kind_and_seq(net_runs, name, kind):
    """Another allowed host, or another answer to the same request: one difference, of its door's kind, at the seq
    of that door's crossing in each run, and nothing else (the commands' argv, env names and output are the same)."""
    runs = net_runs["runs"]
    report = audit(runs["original"], runs[name])
    assert [d.kind for d in report.differences] == [kind], [(d.what, d.a, d.b) for d in report.differences]
    [d] = report.differences
    door = {"egress": "egress", "model calls": "model"}[kind]
    assert (d.seq_a, d.seq_b) == tuple(door_rows(r, door)[0].seq for r in (runs["original"], runs[name]))
    assert d.what == f"{kind} #1"
    if kind == "egress":
        assert "web.tkb.test:8080 allow" in d.a and "other.tkb.test:8080 allow" in d.b, (d.a, d.b)
    else:  # the request's digest is the same, the response's is not
        (request_a, response_a), (request_b, response_b) = (x.split(" response ") for x in (d.a, d.b))
        assert request_a == request_b and response_a != response_b, (d.a, d.b)
    assert {k: report.coverage[k] for k in ("exec commands", "egress", "model calls")} == {
        "exec commands": (2, 2), "egress": (1, 1), "model calls": (1, 1)}


def test_an_honest_rerun_of_the_network_original_goes_out_again_and_is_equivalent(net_runs, tmp_path):
    """`tkbox rerun`: the fetch goes to the network again (the same test host, still up), the model call is served
    from the original's recording (the stand-in upstream is gone): the audit finds the two runs equivalent."""
    net, runs = net_runs["net"], net_runs["runs"]
    r = run_cli("rerun", str(runs["original"]), "-o", str(tmp_path / "again.tkb"), "--env", "URL",
                env={"URL": WEB_URL})
    assert r.returncode == 0, r.stderr
    again = tmp_path / "again.tkb"
    [e] = door_rows(again, "egress")
    assert (e.decision, e.args["host"], e.args["address"]) == ("allow", "web.tkb.test", net.web)
    assert e.result["bytes_down"] > 0  # went out again, not served from anywhere
    assert [(m.decision, m.args["mode"]) for m in door_rows(again, "model")] == [("allow", "replay")]
    r = run_cli("audit", str(runs["original"]), str(again))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT"), r.stdout
    assert "exec commands 2/2, egress 1/1" in r.stdout and "model calls 1/1" in r.stdout, r.stdout
