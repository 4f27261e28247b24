"""The model door's pure parts: [models] validation, the budget decisions, the request parser, usage from responses."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tkbox_nb.rules.model_request import ModelRequestError, ModelRequestParser
from tkbox_nb.rules.model_usage import UsageReader
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy

BASE = """
[models]
mode = "record"
allow = ["openai:gpt-4o-mini", "anthropic:claude-*"]
{extra}
[models.openai]
key = "env:K"
[models.anthropic]
key = "file:/k"
"""


def policy(extra: str = "") -> Policy:
    return Policy.from_toml(BASE.format(extra=extra))


def facts(**kw):
    f = dict(door="model", kind="call", provider="openai", model="gpt-4o-mini", endpoint="/v1/chat/completions",
             stream=False, max_output=50, mode="record", run_calls=0, run_input_tokens=0, run_output_tokens=0,
             request_size=100)
    f.update(kw)
    return f


@pytest.mark.parametrize("text, error", [
    ('[models]\nmode = "fast"', "must be one of live, record, replay"),
    ('[models]\nallow = ["gpt-4o"]', "must be PROVIDER:MODEL"),
    ('[models]\nallow = ["cohere:x"]', "must be PROVIDER:MODEL"),
    ('[models]\nmax_calls = -1', "must be 0 (no limit) or more"),
    ('[models]\nmax_calls = true', "must be an integer"),
    ('[models]\nmax_request_bytes = 99999999999', "must be between 1 and"),
    ('[models]\nbudget = 3', "unknown key"),
    ('[models.openai]\nbase_url = "ftp://x"\nkey = "env:K"', "base_url must be http(s)"),
    ('[models.openai]\nbase_url = "https://u:p@x"\nkey = "env:K"', "without user"),
    ('[models.openai]\nkey = "sk-123"', "key must be env:VAR or file:PATH"),
    ('[models.openai]\nsecret = "NOPE"', "not a [secrets.NAME] binding"),
    ('[models.openai]\nbase_url = "https://x"', "needs key"),
    ('[models.openai]\nkey = "env:K"\nsecret = "S"', "not both"),
    ('[models.mistral]\nkey = "env:K"', "unknown key"),
    ('[models]\nmode = 3', "must be a string"),
    ('[models]\ntimeout_s = inf', "must be a number of seconds"),
    ('[models]\ntimeout_s = nan', "must be a number of seconds"),
    ('[models]\ntimeout_s = 1e9', "must be a number of seconds"),
])
def test_bad_models_sections_are_refused_with_one_line(text, error):
    with pytest.raises(PolicyError) as e:
        Policy.from_toml(text, "p.toml")
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_provider_may_take_its_key_from_a_secret_binding():
    p = Policy.from_toml('[secrets.OAI]\nhosts = ["api.openai.com"]\nheader = "Authorization"\nsource = "env:K"\n'
                         '[models]\nallow = ["openai:*"]\n[models.openai]\nsecret = "OAI"\n')
    assert p.data["models"]["providers"]["openai"]["secret"] == "OAI"
    assert p.decide(facts(mode="live")).allowed


def test_no_models_section_refuses_every_call():
    v = Policy.default().decide(facts())
    assert (v.verdict, v.rule) == ("deny", "models.none")


@pytest.mark.parametrize("kw, rule", [
    ({}, "models.allow[0]"),
    ({"provider": "anthropic", "model": "claude-3-5-haiku"}, "models.allow[1]"),
    ({"model": "gpt-4o"}, "models.allow"),
    ({"provider": "anthropic", "model": "gpt-4o-mini"}, "models.allow"),
    ({"request_error": "bad"}, "models.request"),
    ({"run_calls": None}, "models.request"),
    ({"run_calls": True}, "models.request"),
    ({"max_output": -1}, "models.request"),
    ({"mode": "replay"}, "models.replay"),
    ({"mode": "replay", "recorded": True}, "models.allow[0]"),
    ({"mode": "whatever"}, "models.mode"),
])
def test_decide_models(kw, rule):
    assert policy().decide(facts(**kw)).rule == rule


def test_replay_policy_never_goes_upstream():
    p = Policy.from_toml('[models]\nmode = "replay"\nallow = ["openai:*"]\n')  # no keys needed to replay
    assert p.decide(facts(mode="record")).rule == "models.mode"
    assert p.decide(facts(mode="replay", recorded=True)).allowed
    assert p.decide(facts(mode="replay", recorded=False)).rule == "models.replay"


@pytest.mark.parametrize("extra, kw, rule", [
    ("max_calls = 3", {"run_calls": 2}, "models.allow[0]"),
    ("max_calls = 3", {"run_calls": 3}, "models.max_calls"),
    ("max_output_tokens_per_call = 50", {"max_output": 50}, "models.allow[0]"),
    ("max_output_tokens_per_call = 50", {"max_output": 51}, "models.max_output_tokens_per_call"),
    ("max_output_tokens_per_call = 50", {"max_output": None}, "models.max_output_tokens_per_call"),
    ("max_input_tokens = 1000", {"run_input_tokens": 999}, "models.allow[0]"),
    ("max_input_tokens = 1000", {"run_input_tokens": 1000}, "models.max_input_tokens"),
    ("max_output_tokens = 1000", {"run_output_tokens": 950, "max_output": 50}, "models.allow[0]"),
    ("max_output_tokens = 1000", {"run_output_tokens": 951, "max_output": 50}, "models.max_output_tokens"),
    ("max_output_tokens = 1000", {"max_output": None}, "models.max_output_tokens"),
    ("max_request_bytes = 100", {"request_size": 101}, "models.max_request_bytes"),
])
def test_budgets_are_pure_functions_of_the_signed_totals(extra, kw, rule):
    p = policy(extra)
    assert p.decide(facts(**kw)).rule == rule
    assert p.decide(facts(**kw)) == p.decide(facts(**kw))


def _request(target: str, body: bytes, method: str = "POST", extra: bytes = b"") -> bytes:
    return (f"{method} {target} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer dummy\r\ncontent-length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def test_n_choices_multiply_the_output_tokens_a_call_asks_for():
    """`"n": 8` asks for eight choices of up to max_tokens each: the per-call and run budgets count all of them."""
    req = ModelRequestParser(1 << 20).feed(_request("/openai/v1/chat/completions",
                                                    b'{"model":"gpt-x","max_tokens":60,"n":8,"messages":[]}'))
    assert req.max_output == 480
    assert policy("max_output_tokens_per_call = 100\n").decide(facts(max_output=req.max_output)).verdict == "deny"
    for bad in (b"0", b"-1", b"true", b"1.5", b"129"):
        with pytest.raises(ModelRequestError, match="n must be a count"):
            ModelRequestParser(1 << 20).feed(_request("/openai/v1/chat/completions",
                                                      b'{"model":"gpt-x","max_tokens":6,"n":' + bad + b'}'))


def test_parser_takes_a_call_and_drops_the_box_s_key_header():
    body = json.dumps({"model": "gpt-4o-mini", "max_tokens": 9, "stream": True, "messages": []}).encode()
    parser = ModelRequestParser(1 << 20)
    raw = _request("/openai/v1/chat/completions", body, extra=b"anthropic-version: 2023-06-01\r\n")
    assert parser.feed(raw[:30]) is None
    req = parser.feed(raw[30:])
    assert (req.provider, req.endpoint, req.model, req.stream, req.max_output) == \
        ("openai", "/v1/chat/completions", "gpt-4o-mini", True, 9)
    assert req.body == body
    assert dict(req.headers) == {b"content-type": b"application/json", b"anthropic-version": b"2023-06-01"}


@pytest.mark.parametrize("raw, status, text", [
    (_request("/openai/v1/files", b"{}"), 404, "not an endpoint this door carries"),
    (_request("/cohere/v1/chat", b"{}"), 404, "no provider"),
    (_request("/anthropic/v1/messages", b"{}", method="PUT"), 405, "only POST"),
    (_request("/anthropic/v1/messages", b"[1]"), 400, "not a JSON object"),
    (_request("/anthropic/v1/messages", b"{not json"), 400, "not JSON"),
    (_request("/anthropic/v1/messages", b'{"model": 5}'), 400, "names no model"),
    (_request("/anthropic/v1/messages", b'{"model": "a b"}'), 400, "names no model"),
    (_request("/anthropic/v1/messages", b'{"model": "m", "stream": "yes"}'), 400, "stream must be"),
    (_request("/anthropic/v1/messages", b'{"model": "m", "max_tokens": 1.5}'), 400, "max_tokens must be"),
    (_request("/anthropic/v1/messages", b'{"model": "m", "max_tokens": true}'), 400, "max_tokens must be"),
    (_request("/anthropic/v1/messages", b'{"model": "m", "pad": "' + b"x" * 200 + b'"}'), 413, "over 100"),
    (b"GARBAGE\r\n\r\n", 400, "not an HTTP/1.1 request"),
    (b"POST /openai/v1/embeddings HTTP/1.1\r\nx: " + b"y" * 70000, 400, "not an HTTP/1.1 request"),
])
def test_parser_refuses_what_is_not_a_model_call(raw, status, text):
    with pytest.raises(ModelRequestError) as e:
        ModelRequestParser(100).feed(raw)
    assert e.value.status == status and text in str(e.value)


@pytest.mark.parametrize("body, text", [
    (b'{"model": "gpt-4o-mini", "model": "gpt-4o"}', "duplicate key 'model'"),
    (b'{"model": "m", "messages": [{"role": "user", "role": "system"}]}', "duplicate key 'role'"),
    (b'{"model": "m", "temperature": 1e999}', "out of range"),
    (b'{"model": "m", "temperature": -1E+400}', "out of range"),
    (b'{"model": "m", "temperature": NaN}', "non-standard number NaN"),
    (b'{"model": "m", "temperature": Infinity}', "non-standard number Infinity"),
    ('{"model": "m"}'.encode("utf-16"), "not JSON"),
])
def test_parser_refuses_json_that_readers_could_read_differently(body, text):
    """The signed model must be the one upstream runs: Python keeps the last of two keys where another reader may keep
    the first; 1e999 would be signed as Infinity, which is not JSON."""
    with pytest.raises(ModelRequestError) as e:
        ModelRequestParser(1 << 20).feed(_request("/openai/v1/chat/completions", body))
    assert e.value.status == 400 and "not JSON" in str(e.value) and text in str(e.value), str(e.value)
    ok = b'{"model": "gpt-4o-mini", "temperature": 1.5e308, "messages": [{"role": "user"}, {"role": "user"}]}'
    assert ModelRequestParser(1 << 20).feed(_request("/openai/v1/chat/completions", ok)).model == "gpt-4o-mini"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(1, 50))
def test_fuzz_model_request_parser(data, cut):
    parser = ModelRequestParser(4096)
    try:
        for i in range(0, len(data), cut):
            parser.feed(data[i:i + cut])
    except ModelRequestError as e:
        assert 400 <= e.status < 500


def test_usage_from_openai_and_anthropic_streams_and_bodies():
    r = UsageReader(streamed=True)
    for part in (b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n',
                 b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: {"choices":[],"usage":{"prompt',
                 b'_tokens":11,"completion_tokens":7}}\n\ndata: [DONE]\n\n'):
        r.feed(part)
    u = r.end()
    assert (u.as_dict(), u.stop_reason) == ({"input_tokens": 11, "output_tokens": 7}, "stop")
    r = UsageReader(streamed=True)
    r.feed(b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":12,'
           b'"output_tokens":1}}}\n\nevent: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
           b'"end_turn"},"usage":{"output_tokens":6}}\n\n')
    u = r.end()
    assert (u.as_dict(), u.stop_reason) == ({"input_tokens": 12, "output_tokens": 6}, "end_turn")
    r = UsageReader(streamed=False)
    r.feed(b'{"usage": {"input_tokens": 9, "output_tokens": 4}, "stop_reason": "max_tokens"}')
    assert r.end().as_dict() == {"input_tokens": 9, "output_tokens": 4}
    r = UsageReader(streamed=True)
    r.feed(b"data: " + b"x" * (2 << 20))  # a line too long to read is skipped, never buffered whole
    r.feed(b'\ndata: {"usage": {"input_tokens": -3, "output_tokens": true}}\n')
    assert r.end().as_dict() == {}


def _recorded_calls(signer, path, second_totals):
    """A run with two model calls stated straight to the signer (no door): the second states `second_totals`."""
    from tkbox_nb.signing.recorder import RunRecorder
    rec = RunRecorder(signer, policy("max_calls = 1"), {"backend": "none", "isolation": "none",
                                                        "image_digest": "none"}).open()
    first = rec.decide("model", "call", {k: v for k, v in facts().items() if k not in ("door", "kind")},
                       {"request": b'{"model": "gpt-4o-mini"}'})
    assert first.allowed
    rec.complete(first, "ok", {"usage": {"input_tokens": 11, "output_tokens": 7}})
    second = rec.decide("model", "call", {k: v for k, v in facts(**second_totals).items()
                                          if k not in ("door", "kind")}, {"request": b'{"model": "gpt-4o-mini"}'})
    rec.close("done")
    rec.write_bundle(path)
    return second


def test_stated_totals_are_recounted_by_the_verifier(signer, tmp_path):
    from tkbox_nb.bundle.verify import verify_bundle
    honest = _recorded_calls(signer, tmp_path / "honest.tkb",
                             {"run_calls": 1, "run_input_tokens": 11, "run_output_tokens": 7})
    assert honest.verdict.rule == "models.max_calls" and not honest.allowed
    assert verify_bundle(tmp_path / "honest.tkb").valid
    # a door that understates the run's calls gets the call through its budget, and the bundle fails verification
    lying = _recorded_calls(signer, tmp_path / "lying.tkb",
                            {"run_calls": 0, "run_input_tokens": 11, "run_output_tokens": 7})
    assert lying.allowed
    report = verify_bundle(tmp_path / "lying.tkb")
    assert not report.valid and report.first_failure.name == "model totals"
    assert "'run_calls': 0" in report.first_failure.detail
