"""The model door: the official openai and anthropic clients in a real box, a fake upstream of each in a network
namespace (a test fixture), a real signer; record, budgets, refusals, and replay with no upstream at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from testnet import NamespaceNet, available
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(not available()[0], reason=available()[1])]

OPENAI_KEY = "sk-openai-" + "5e1f" * 10
ANTHROPIC_KEY = "sk-ant-" + "9c2d" * 10
PORT = 9090
VENV_BIN = Path(sys.executable).parent

CLIENTS = r'''
import json, openai, anthropic
out = {}
o = openai.OpenAI()
r = o.chat.completions.create(model="gpt-4o-mini", max_tokens=50, messages=[{"role": "user", "content": "hi there"}])
out["chat"] = [r.id, r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens]
s = o.chat.completions.create(model="gpt-4o-mini", max_tokens=50, stream=True, stream_options={"include_usage": True},
                              messages=[{"role": "user", "content": "stream me"}])
parts, usage = [], None
for chunk in s:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage.completion_tokens
out["chat_stream"] = ["".join(parts), usage]
r = o.responses.create(model="gpt-4o-mini", max_output_tokens=40, input="a response")
out["responses"] = [r.id, r.output_text, r.usage.input_tokens]
deltas, done = [], None
for event in o.responses.create(model="gpt-4o-mini", max_output_tokens=40, input="a streamed response", stream=True):
    if event.type == "response.output_text.delta":
        deltas.append(event.delta)
    elif event.type == "response.completed":
        done = event.response.usage.output_tokens
out["responses_stream"] = ["".join(deltas), done]
e = o.embeddings.create(model="text-embedding-3-small", input="embed me")
out["embeddings"] = [round(x, 3) for x in e.data[0].embedding]
a = anthropic.Anthropic()
m = a.messages.create(model="claude-3-5-haiku-latest", max_tokens=60, messages=[{"role": "user", "content": "hello"}])
out["messages"] = [m.id, m.content[0].text, m.usage.input_tokens, m.stop_reason]
with a.messages.stream(model="claude-3-5-haiku-latest", max_tokens=60,
                       messages=[{"role": "user", "content": "stream hello"}]) as st:
    text = "".join(st.text_stream)
    final = st.get_final_message()
out["messages_stream"] = [text, final.usage.output_tokens, final.stop_reason]
print(json.dumps(out, sort_keys=True))
'''


def models_policy(net, mode: str = "record", extra: str = "", anthropic_key: str = 'key = "env:TKB_TEST_ANTHROPIC_KEY"'
                  ) -> Policy:
    return Policy.from_toml(f"""
[models]
mode = "{mode}"
allow = ["openai:gpt-4o-mini", "openai:text-embedding-3-*", "anthropic:claude-*"]
{extra}

[models.openai]
base_url = "http://{net.web}:{PORT}"
key = "env:TKB_TEST_OPENAI_KEY"

[models.anthropic]
base_url = "http://{net.web}:{PORT}"
{anthropic_key}
""")


class Upstream:
    """The fake upstream process in the namespace; `stop()` kills it (replay must not need it). `says`: the word its
    answers start with (another one answers the same request differently)."""

    def __init__(self, net, says: str = "echo"):
        self.log = net.root / "requests.log"
        self.log.unlink(missing_ok=True)  # what this upstream saw, not an earlier one
        self.proc = net.ns(sys.executable, str(Path(__file__).with_name("fake_models.py")), net.web, str(PORT),
                           str(self.log), says)
        import socket
        import time
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection((net.web, PORT), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def net():
    with NamespaceNet(index=13) as n:
        yield n


@pytest.fixture(autouse=True)
def keys(monkeypatch):
    monkeypatch.setenv("TKB_TEST_OPENAI_KEY", OPENAI_KEY)
    monkeypatch.setenv("TKB_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)


def _run_py(box, code: str):
    return box.run(["python3", "-c", code])


def _ok(r) -> str:
    assert r.exit_code == 0, r.stderr.decode()[-3000:]
    return r.stdout.decode()


@pytest.fixture(scope="module")
def recorded(signer, net, tmp_path_factory):
    """One recorded run of every client call; the upstream is gone once it is done."""
    tmp = tmp_path_factory.mktemp("models")
    up = Upstream(net)
    os.environ["TKB_TEST_OPENAI_KEY"], os.environ["TKB_TEST_ANTHROPIC_KEY"] = OPENAI_KEY, ANTHROPIC_KEY
    try:
        with Box(backend="bwrap", policy=models_policy(net), bundle_path=tmp / "rec.tkb") as box:
            out = _ok(_run_py(box, CLIENTS))
            env = _ok(box.run(["sh", "-c", "env"]))
    finally:
        up.stop()
        os.environ.pop("TKB_TEST_OPENAI_KEY", None)
        os.environ.pop("TKB_TEST_ANTHROPIC_KEY", None)
    return {"out": out, "env": env, "bundle": tmp / "rec.tkb", "seen": up.requests(), "tmp": tmp}


def test_official_clients_complete_calls_streaming_and_not(recorded):
    out = json.loads(recorded["out"])
    assert out["chat"] == ["chatcmpl-1", "echo: hi there", 11, 7]
    assert out["chat_stream"] == ["echo: stream me ", 7]
    assert out["responses"] == ["resp_1", "echo: a response", 9]
    assert out["responses_stream"] == ["echo: a streamed response ", 4]
    assert out["embeddings"] == [0.25, 0.5, 0.75]
    assert out["messages"] == ["msg_1", "echo: hello", 12, "end_turn"]
    assert out["messages_stream"] == ["echo: stream hello ", 6, "end_turn"]
    paths = [r["path"] for r in recorded["seen"]]
    assert paths == ["/v1/chat/completions"] * 2 + ["/v1/responses"] * 2 + ["/v1/embeddings"] + ["/v1/messages"] * 2


def test_the_key_is_added_on_the_host_and_never_in_the_box_or_the_bundle(recorded):
    seen = recorded["seen"]
    openai_calls = [r for r in seen if r["path"] != "/v1/messages"]
    assert all(r["authorization"] == f"Bearer {OPENAI_KEY}" and r["x_api_key"] is None for r in openai_calls)
    anthropic_calls = [r for r in seen if r["path"] == "/v1/messages"]
    assert all(r["x_api_key"] == ANTHROPIC_KEY and r["authorization"] is None for r in anthropic_calls)
    assert all(set(r["headers"]) <= {"host", "content-type", "content-length", "accept", "accept-encoding",
                                     "anthropic-version", "user-agent", "connection", "authorization",
                                     "x-api-key"} for r in seen), seen
    assert OPENAI_KEY not in recorded["env"] and ANTHROPIC_KEY not in recorded["env"]
    assert "OPENAI_BASE_URL=http://127.0.0.1:3129/openai/v1" in recorded["env"]
    with zipfile.ZipFile(recorded["bundle"]) as z:
        for name in z.namelist():
            data = z.read(name)
            assert OPENAI_KEY.encode() not in data and ANTHROPIC_KEY.encode() not in data, name


def test_each_call_is_signed_with_usage_digests_and_disclosed_bodies(recorded, signer):
    report = verify_bundle(recorded["bundle"])
    assert report.valid, report.summary()
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(recorded["bundle"]), "--trust",
                        str(signer.trust_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "Integrity: VERIFIED." in r.stdout, r.stdout
    run = open_run(recorded["bundle"])
    calls = [c for c in run.crossings() if c.door == "model"]
    assert [c.decision for c in calls] == ["allow"] * 7
    assert [c.args["endpoint"] for c in calls] == ["/v1/chat/completions"] * 2 + ["/v1/responses"] * 2 + [
        "/v1/embeddings"] + ["/v1/messages"] * 2
    first = calls[0]
    assert first.args["provider"] == "openai" and first.args["model"] == "gpt-4o-mini"
    assert first.args["rule"] == "models.allow[0]" and first.args["max_output"] == 50
    assert b'"hi there"' in run.content(first.args["request"])
    assert first.result["usage"] == {"input_tokens": 11, "output_tokens": 7}
    assert b"echo: hi there" in run.content(first.result["response"])
    assert calls[1].result["streamed"] and calls[1].result["usage"]["output_tokens"] == 7
    assert run.summary_of(calls[1]) == "openai:gpt-4o-mini /v1/chat/completions stream (record) 11+7 tokens"
    assert calls[3].result["streamed"] and calls[3].result["usage"] == {"input_tokens": 9, "output_tokens": 4}
    assert calls[6].result["usage"] == {"input_tokens": 12, "output_tokens": 6}
    assert calls[6].result["stop_reason"] == "end_turn"
    assert calls[6].args["run_calls"] == 6  # the totals before each call are signed with it
    assert calls[6].args["run_input_tokens"] == 11 + 11 + 9 + 9 + 3 + 12
    exchanges = [e for e in run.records if e.get("type") == "model.exchange"]
    assert len(exchanges) == 14
    assert {e["data"]["phase"] for e in exchanges} == {"request", "response"}
    assert any(e["data"].get("usage") == {"input_tokens": 12, "output_tokens": 6} for e in exchanges)


def test_a_replayed_run_serves_byte_identical_responses_with_no_upstream(recorded, signer, net):
    tmp = recorded["tmp"]
    import socket
    with pytest.raises(OSError):  # the upstream is gone
        socket.create_connection((net.web, PORT), timeout=2).close()
    with Box(backend="bwrap", policy=models_policy(net, mode="replay"), bundle_path=tmp / "replay.tkb",
             model_replay=recorded["bundle"]) as box:
        out = _ok(_run_py(box, CLIENTS))
        refused = _run_py(box, "import openai\nopenai.OpenAI().chat.completions.create(model='gpt-4o-mini', "
                               "max_tokens=5, messages=[{'role': 'user', 'content': 'never asked before'}])")
    assert out == recorded["out"]
    assert refused.exit_code != 0
    err = refused.stderr.decode()
    assert "PermissionDeniedError" in err and "was not recorded" in err and "models.replay" in err, err[-2000:]
    assert verify_bundle(tmp / "replay.tkb").valid
    a, b = open_run(recorded["bundle"]), open_run(tmp / "replay.tkb")
    ra = [c.result["response"] for c in a.crossings() if c.door == "model"]
    rb = [c.result["response"] for c in b.crossings() if c.door == "model" and c.decision == "allow"]
    assert ra == rb and len(ra) == 7  # the same bytes, by digest, disclosed again
    assert not [e for e in b.records if e.get("type") == "model.exchange"]  # nothing went upstream


def test_budgets_stop_the_call_that_exceeds_them_and_unlisted_models_are_refused(signer, net, tmp_path):
    up = Upstream(net)
    code = r'''
import openai, anthropic
o, a = openai.OpenAI(), anthropic.Anthropic()
msgs = [{"role": "user", "content": "x"}]
def attempt(name, f):
    try:
        f()
        print(name, "ok")
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        print(name, type(e).__name__, e.status_code, e.message)
attempt("big", lambda: o.chat.completions.create(model="gpt-4o-mini", max_tokens=500, messages=msgs))
attempt("nolimit", lambda: o.chat.completions.create(model="gpt-4o-mini", messages=msgs))
attempt("model", lambda: o.chat.completions.create(model="gpt-4o", max_tokens=5, messages=msgs))
attempt("claude-model", lambda: a.messages.create(model="gpt-4o-mini", max_tokens=5, messages=msgs))
attempt("one", lambda: o.chat.completions.create(model="gpt-4o-mini", max_tokens=5, messages=msgs))
attempt("two", lambda: a.messages.create(model="claude-3-5-haiku-latest", max_tokens=5, messages=msgs))
attempt("three", lambda: o.chat.completions.create(model="gpt-4o-mini", max_tokens=5, messages=msgs))
'''
    try:
        # the Anthropic key from a [secrets.NAME] binding this time: the box sees its placeholder, the upstream the
        # value
        policy = models_policy(net, mode="live", extra="max_calls = 2\nmax_output_tokens_per_call = 100\n"
                               '[secrets.ANT]\nhosts = ["api.anthropic.com"]\nheader = "x-api-key"\n'
                               'source = "env:TKB_TEST_ANTHROPIC_KEY"\n', anthropic_key='secret = "ANT"')
        with Box(backend="bwrap", policy=policy, bundle_path=tmp_path / "b.tkb") as box:
            lines = _ok(_run_py(box, code)).splitlines()
    finally:
        up.stop()
    got = {line.split(" ", 1)[0]: line for line in lines}
    assert "PermissionDeniedError 403" in got["big"] and "models.max_output_tokens_per_call" in got["big"]
    assert "at most 100 output tokens" in got["big"] and "asks for 500" in got["big"]
    assert "models.max_output_tokens_per_call" in got["nolimit"] and "no limit" in got["nolimit"]
    assert "openai:gpt-4o is not in [models] allow" in got["model"]
    assert "anthropic:gpt-4o-mini is not in [models] allow" in got["claude-model"]
    assert got["one"] == "one ok" and got["two"] == "two ok"
    assert "models.max_calls" in got["three"] and "made its 2 model call(s)" in got["three"]
    assert len(up.requests()) == 2  # refused calls never reached the upstream
    assert up.requests()[1]["x_api_key"] == ANTHROPIC_KEY
    run = open_run(tmp_path / "b.tkb")
    rules = [(c.decision, c.args["rule"]) for c in run.crossings() if c.door == "model"]
    assert rules == [("deny", "models.max_output_tokens_per_call")] * 2 + [("deny", "models.allow")] * 2 + [
        ("allow", "models.allow[0]"), ("allow", "models.allow[2]"), ("deny", "models.max_calls")]
    assert all("TKB-POLICY-DENY" in c.rule_ids for c in run.crossings() if c.door == "model" and
               c.decision == "deny")
    live = [c for c in run.crossings() if c.door == "model" and c.decision == "allow"]
    assert all("response" not in c.result and c.result["response_digest"].startswith("sha256:") for c in live)
    assert verify_bundle(tmp_path / "b.tkb").valid


NOTEBOOK_CELLS = [
    "import openai, anthropic",
    "r = openai.OpenAI().chat.completions.create(model='gpt-4o-mini', max_tokens=20, "
    "messages=[{'role': 'user', 'content': 'from a notebook'}])\nprint(r.choices[0].message.content)",
    "with anthropic.Anthropic().messages.stream(model='claude-3-5-haiku-latest', max_tokens=20, "
    "messages=[{'role': 'user', 'content': 'streamed in a notebook'}]) as s:\n    print(''.join(s.text_stream))",
]


def test_rerun_serves_model_calls_from_the_original_and_audits_equivalent(signer, net, tmp_path):
    from conftest import run_cli

    from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
    up = Upstream(net)
    os.environ["TKB_TEST_OPENAI_KEY"], os.environ["TKB_TEST_ANTHROPIC_KEY"] = OPENAI_KEY, ANTHROPIC_KEY
    try:
        nb = NotebookBox(bundle_dir=tmp_path / "bundles")
        HostMagics(nb, lambda prompt: "").run("box_policy", "", models_policy(net).source)
        outs = [nb.ensure_box().execute(code).outputs for code in NOTEBOOK_CELLS]
        original = nb.stop("done")
    finally:
        up.stop()
    assert outs[1][0]["text"] == "echo: from a notebook\n" and outs[2][0]["text"] == "echo: streamed in a notebook \n"
    r = run_cli("rerun", str(original), "-o", str(tmp_path / "rerun.tkb"), "--backend", "bwrap")
    assert r.returncode == 0, r.stderr
    run = open_run(tmp_path / "rerun.tkb")
    calls = [c for c in run.crossings() if c.door == "model"]
    assert [(c.decision, c.args["mode"]) for c in calls] == [("allow", "replay")] * 2
    r = run_cli("audit", str(original), str(tmp_path / "rerun.tkb"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(up.requests()) == 2  # the rerun never reached an upstream


HOSTILE = r"""
import json, socket
def raw(data):
    s = socket.create_connection(("127.0.0.1", 3129))
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out.decode()
        out += chunk
print(json.dumps([
    raw(b"GET /openai/v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n"),
    raw(b"POST /anthropic/v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 8\r\n\r\nnot json"),
    raw(b"POST /openai/v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"),
    raw(b"\x00\x01garbage\r\n\r\n"),
]))
import openai
r = openai.OpenAI().chat.completions.create(model="gpt-4o-mini", max_tokens=5,
                                            messages=[{"role": "user", "content": "tell me your key"}])
print(r.choices[0].message.content)
"""


def test_hostile_requests_get_provider_errors_and_an_echoed_key_is_scrubbed(signer, net, tmp_path):
    up = Upstream(net)
    try:
        with Box(backend="bwrap", policy=models_policy(net), bundle_path=tmp_path / "h.tkb") as box:
            out = _ok(_run_py(box, HOSTILE)).splitlines()
            assert box.run(["true"]).exit_code == 0  # the box and its door are still up
    finally:
        up.stop()
    answers = json.loads(out[0])
    assert answers[0].startswith("HTTP/1.1 405") and "only POST passes the model door" in answers[0]
    assert answers[1].startswith("HTTP/1.1 400") and '"type": "error"' in answers[1] and "not JSON" in answers[1]
    assert answers[2].startswith("HTTP/1.1 404") and "not an endpoint this door carries" in answers[2]
    assert answers[3].startswith("HTTP/1.1 400") and "not an HTTP/1.1 request" in answers[3]
    assert out[1] == "I got Bearer " + "*" * len(OPENAI_KEY) + " None"
    assert len(up.requests()) == 1
    run = open_run(tmp_path / "h.tkb")
    calls = [c for c in run.crossings() if c.door == "model"]
    assert [(c.decision, c.args["rule"]) for c in calls] == [("deny", "models.request")] * 3 + [
        ("allow", "models.allow[0]")]
    assert OPENAI_KEY.encode() not in run.content(calls[-1].result["response"])
    assert verify_bundle(tmp_path / "h.tkb").valid


def test_a_box_without_the_model_endpoint_cannot_open_a_model_stream(signer, tmp_path):
    """A hostile agent opens a model stream in a box whose policy has no [models]: the box is ended, the reason
    recorded, the host stays up."""
    from e2e.test_bwrap_box import HOSTILE_AGENT

    from tkbox_nb.box.box import BoxEnded
    program = HOSTILE_AGENT + "os.write(fd, p.encode_json(p.OPEN, 4, {'kind': 'model'}))\ntime.sleep(30)\n"
    b = Box(backend="bwrap", bundle_path=tmp_path / "x.tkb", agent_argv=["python3", "-c", program]).start()
    with pytest.raises(BoxEnded, match="protocol violation"):
        b.execute("1 + 1")
    b.stop()
    run = open_run(tmp_path / "x.tkb")
    assert "protocol violation" in run.box["end_reason"] and "'model'" in run.box["end_reason"]
    assert verify_bundle(tmp_path / "x.tkb").valid


def test_replay_refuses_a_bundle_that_does_not_verify(recorded, tmp_path):
    from conftest import tamper_content

    from tkbox_nb.core.errors import TkboxError
    bad = tamper_content(recorded["bundle"], tmp_path / "bad.tkb")
    with pytest.raises(TkboxError, match="does not verify.*not served"):
        Box(backend="bwrap", model_replay=bad)


def test_a_missing_key_stops_the_box_at_its_start_with_one_line(signer, net, tmp_path, monkeypatch):
    from tkbox_nb.core.errors import PolicyError
    monkeypatch.delenv("TKB_TEST_OPENAI_KEY")
    with pytest.raises(PolicyError) as e:
        Box(backend="bwrap", policy=models_policy(net), bundle_path=tmp_path / "k.tkb").start()
    assert str(e.value) == "models.openai.key: the host environment has no TKB_TEST_OPENAI_KEY"


CONCURRENT = r"""
import threading, openai
o = openai.OpenAI()
out = {}
def one(i):
    s = o.chat.completions.create(model="gpt-4o-mini", max_tokens=10 + i, stream=True,
                                  stream_options={"include_usage": True},
                                  messages=[{"role": "user", "content": f"thread {i}"}])
    out[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sorted(out.values()))
try:
    o.chat.completions.create(model="gpt-4o-mini", max_tokens=5, messages=[{"role": "user", "content": "fail please"}])
except openai.BadRequestError as e:
    print("upstream", e.status_code, e.message)
"""


def test_concurrent_calls_keep_exact_signed_totals_and_upstream_errors_pass_through(signer, net, tmp_path):
    up = Upstream(net)
    try:
        with Box(backend="bwrap", policy=models_policy(net, extra="max_output_tokens = 10000"),
                 bundle_path=tmp_path / "c.tkb") as box:
            lines = _ok(_run_py(box, CONCURRENT)).splitlines()
    finally:
        up.stop()
    assert lines[0] == str(sorted(f"echo: thread {i} " for i in range(8)))
    assert lines[1].startswith("upstream 400") and "upstream says no" in lines[1]
    run = open_run(tmp_path / "c.tkb")
    calls = [c for c in run.crossings() if c.door == "model"]
    assert len(calls) == 9 and all(c.decision == "allow" for c in calls)
    assert calls[-1].result["status_code"] == 400 and calls[-1].result["status"] == "error"
    assert b"upstream says no" in run.content(calls[-1].result["response"])
    # all 8 were allowed before; a streamed call's result may be signed just after its client saw [DONE], so the
    # 9th call may be decided before some of them reported: their output stays counted as reserved until then
    last = calls[-1].args
    done = last["run_input_tokens"] // 11
    assert last["run_calls"] == 8 and last["run_input_tokens"] == done * 11 and done <= 8
    assert done * 7 <= last["run_output_tokens"] <= done * 7 + (8 - done) * 17
    assert done == 8 or last["run_output_tokens"] > done * 7  # calls still in flight count what they asked for
    report = verify_bundle(tmp_path / "c.tkb")  # the totals each concurrent call stated recount exactly
    assert report.valid, report.summary()


FETCHING = r'''
import json, sys, anthropic
a = anthropic.Anthropic(max_retries=0)
img = sys.argv[1]
out = []
try:
    m = a.messages.create(model="claude-3-5-haiku-latest", max_tokens=60,
        tools=[{"type": "web_fetch_20250910", "name": "web_fetch", "allowed_domains": ["docs.tkb.test"]}],
        extra_body={"mcp_servers": [{"type": "url", "url": "https://mcp.tkb.test/sse", "name": "m"}]},
        messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": img}},
                                               {"type": "text", "text": "fetch for me"}]}])
    out.append(["ok", m.content[0].text])
except anthropic.PermissionDeniedError as e:
    out.append(["refused", e.status_code, str(e)])
print(json.dumps(out))
'''


def _fetching_policy(net, extra: str) -> Policy:
    return Policy.from_toml(f"""
[egress]
allow = ["docs.tkb.test:443", "*.docs.tkb.test:443", "mcp.tkb.test:443", "img.tkb.test:443"]

[models]
mode = "record"
allow = ["anthropic:claude-*"]
{extra}

[models.anthropic]
base_url = "http://{net.web}:{PORT}"
key = "env:TKB_TEST_ANTHROPIC_KEY"
""")


def test_a_call_naming_a_web_fetch_tool_an_mcp_server_and_an_image_url_is_decided_against_egress(signer, net,
                                                                                                  tmp_path):
    """The provider would fetch each of these past the egress door: by default the call is refused, signed, with
    the provider's error shape and nothing sent upstream; with `server_tools = "egress"` a call whose every host is on
    the egress allow list goes up, and one naming another host is refused."""
    up = Upstream(net)
    try:
        with Box(backend="bwrap", policy=_fetching_policy(net, ""), bundle_path=tmp_path / "r.tkb") as box:
            refused = json.loads(_ok(box.run(["python3", "-c", FETCHING, "https://img.tkb.test/a.png"])))
        assert up.requests() == []
        with Box(backend="bwrap", policy=_fetching_policy(net, 'server_tools = "egress"'),
                 bundle_path=tmp_path / "e.tkb") as box:
            passed = json.loads(_ok(box.run(["python3", "-c", FETCHING, "https://img.tkb.test/a.png"])))
            other = json.loads(_ok(box.run(["python3", "-c", FETCHING, "https://elsewhere.example/a.png"])))
    finally:
        up.stop()
    assert refused[0][:2] == ["refused", 403] and "models.server_tools" in refused[0][2]
    assert passed[0][0] == "ok"  # the upstream answered it
    assert other[0][:2] == ["refused", 403] and "elsewhere.example:443 is not in [egress] allow" in other[0][2]
    for bundle, rules in (("r.tkb", ["models.server_tools"]), ("e.tkb", ["models.allow[0]", "models.server_tools"])):
        calls = [c for c in open_run(tmp_path / bundle).crossings() if c.door == "model"]
        assert [c.args["rule"] for c in calls] == rules
        assert [sorted(f["kind"] for f in c.args["fetches"]) for c in calls] == [["mcp", "tool", "url"]] * len(calls)
        assert verify_bundle(tmp_path / bundle).valid


def test_a_door_that_leaves_a_fetch_out_of_the_decision_fails_verification(signer, net, tmp_path, monkeypatch):
    """The decision is re-derived from the signed facts; `tkbox verify` also reads the disclosed request body and
    lists what it names, so a door stating fewer fetches than the body names (here: none, and the call passed) is
    caught."""
    monkeypatch.setattr("tkbox_nb.rules.model_request.provider_fetches", lambda doc: [])
    up = Upstream(net)
    try:
        with Box(backend="bwrap", policy=_fetching_policy(net, ""), bundle_path=tmp_path / "l.tkb") as box:
            passed = json.loads(_ok(box.run(["python3", "-c", FETCHING, "https://img.tkb.test/a.png"])))
    finally:
        up.stop()
    assert passed[0][0] == "ok"
    report = verify_bundle(tmp_path / "l.tkb")
    assert not report.valid
    assert any("model fetches" in c.name and "its request body names 3" in c.detail for c in report.checks), \
        [(c.name, c.detail) for c in report.checks if not c.ok]
