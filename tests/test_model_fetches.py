"""Server-side tools, MCP servers and remote URLs in a model request: the provider would fetch or run them past the
egress door, so the request parser lists them (rules/model_fetches.py, pure), the call's signed facts state them, and
`[models] server_tools` refuses them (the default) or decides each host against `[egress]`. Driven through the real
model door with tests/bound_relay's in-memory stream and a recorder deciding with the real policy."""

from __future__ import annotations

import json

import pytest

from tests.bound_relay import FakeBox
from tests.test_model_door import serve, upstream
from tkbox_nb.doors.model import ModelDoor
from tkbox_nb.rules.model_fetches import provider_fetches
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy

ANTHROPIC = {"model": "claude-x", "max_tokens": 60,
             "tools": [{"type": "web_fetch_20250910", "name": "web_fetch", "allowed_domains": ["docs.tkb.test"]},
                       {"name": "get_weather", "input_schema": {"type": "object"}}],
             "mcp_servers": [{"type": "url", "url": "https://mcp.tkb.test/sse", "name": "m"}],
             "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "url", "url": "https://img.tkb.test/a.png"}},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                 {"type": "text", "text": "see https://not-fetched.example/ in the prompt"}]}]}
OPENAI = {"model": "gpt-x", "max_output_tokens": 40,
          "tools": [{"type": "function", "name": "f", "parameters": {}},
                    {"type": "mcp", "server_label": "m", "server_url": "https://mcp.tkb.test/mcp"},
                    {"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}],
          "input": [{"role": "user", "content": [
              {"type": "input_image", "image_url": "https://img.tkb.test/b.png"},
              {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
              {"type": "input_file", "file_url": "http://198.18.0.9/c.pdf"}]}]}


def test_the_parser_lists_server_tools_mcp_servers_and_urls_the_provider_would_fetch():
    a = provider_fetches(ANTHROPIC)
    assert [(f["kind"], f.get("tool"), f.get("url"), f.get("domains")) for f in a] == [
        ("mcp", None, "https://mcp.tkb.test/sse", None),
        ("tool", "web_fetch_20250910", None, ["docs.tkb.test"]),
        ("url", None, "https://img.tkb.test/a.png", None)]
    o = provider_fetches(OPENAI)
    assert [(f["kind"], f.get("tool"), f.get("url")) for f in o] == [
        ("mcp", "mcp", "https://mcp.tkb.test/mcp"), ("tool", "web_search_preview", None),
        ("tool", "file_search", None), ("url", None, "https://img.tkb.test/b.png"),
        ("url", None, "http://198.18.0.9/c.pdf")]
    assert o[1]["domains"] is None and o[2]["network"] is False
    chat = {"model": "gpt-x", "web_search_options": {}, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://img.tkb.test/c.png"}}]}]}
    assert [f["kind"] for f in provider_fetches(chat)] == ["tool", "url"]
    assert provider_fetches({"model": "m", "messages": [{"role": "user", "content": "https://x.example"}],
                             "tools": [{"type": "function", "function": {"name": "f"}},
                                       {"type": "bash_20250124", "name": "bash"}]}) == []
    many = {"model": "m", "input": [{"type": "input_image", "image_url": f"https://h{i}.example/"} for i in range(99)]}
    assert provider_fetches(many)[-1]["kind"] == "cut" and len(provider_fetches(many)) == 33


ALLOW = '"docs.tkb.test:443", "*.docs.tkb.test:443", "mcp.tkb.test:443", "img.tkb.test:443"'


def _policy(extra: str = "", port: int = 9, allow: str = ALLOW) -> Policy:
    return Policy.from_toml(f'[egress]\nallow = [{allow}]\nallow_cidrs = ["198.18.0.0/15"]\n'
                            f'[models]\nallow = ["anthropic:*", "openai:*"]\n{extra}\n'
                            f'[models.anthropic]\nbase_url = "http://127.0.0.1:{port}"\nkey = "env:TKB_TEST_KEY"\n'
                            f'[models.openai]\nbase_url = "http://127.0.0.1:{port}"\nkey = "env:TKB_TEST_KEY"\n')


def _facts(provider: str, doc: dict) -> dict:
    return {"door": "model", "kind": "call", "provider": provider, "model": doc["model"], "mode": "live",
            "run_calls": 0, "run_input_tokens": 0, "run_output_tokens": 0, "request_size": 10, "max_output": 60,
            "fetches": provider_fetches(doc)}


def test_the_policy_refuses_them_by_default_and_decides_each_host_against_egress_when_asked():
    refused = _policy().decide(_facts("anthropic", ANTHROPIC))
    assert (refused.verdict, refused.rule) == ("deny", "models.server_tools")
    assert "mcp_servers[0]" in refused.reason and 'server_tools = "refuse"' in refused.reason
    egress = _policy('server_tools = "egress"')
    assert egress.decide(_facts("anthropic", ANTHROPIC)).verdict == "allow"
    v = _policy('server_tools = "egress"', allow=ALLOW.replace('"*.docs.tkb.test:443", ', "")).decide(
        _facts("anthropic", ANTHROPIC))  # the provider reads a web tool's allowed domain as its subdomains too
    assert v.verdict == "deny" and "admits its subdomains" in v.reason and "*.docs.tkb.test" in v.reason
    narrower = _policy('server_tools = "egress"', allow='"docs.tkb.test:443", "*.docs.tkb.test:443", '
                                                         '"img.tkb.test:443"')
    v = narrower.decide(_facts("anthropic", ANTHROPIC))
    assert (v.verdict, v.rule) == ("deny", "models.server_tools") and "mcp.tkb.test:443 is not in [egress] allow" \
        in v.reason
    # a web tool kept to no domains could reach any host; a refused address class stays refused whatever the list
    v = egress.decide(_facts("openai", OPENAI))
    assert v.verdict == "deny" and "web_search_preview" in v.reason and "allowed_domains" in v.reason
    for url in ("http://169.254.169.254/latest", "http://127.0.0.1:9/", "http://localhost/", "file:///etc/passwd"):
        doc = {"model": "gpt-x", "input": [{"type": "input_image", "image_url": url}]}
        v = _policy('server_tools = "egress"', allow='"*:*"').decide(_facts("openai", doc))
        assert (v.verdict, v.rule) == ("deny", "models.server_tools"), url
    with pytest.raises(PolicyError, match="server_tools must be one of refuse, egress"):
        _policy('server_tools = "allow"')


def _upstream(seen: list) -> int:
    answer = b'{"id":"m","usage":{"input_tokens":1,"output_tokens":1}}'
    return upstream(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n" % len(answer) + answer, seen)


def _call(door: ModelDoor, path: bytes, doc: dict) -> bytes:
    body = json.dumps(doc).encode()
    return serve(door, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: "
                 b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


def test_a_call_naming_a_web_fetch_tool_an_mcp_server_and_an_image_url_through_the_door(monkeypatch):
    """Refused by default with a provider-shaped error and a signed decision stating what it named, nothing sent
    upstream; with `server_tools = "egress"` it goes up when every host is on the allow list, and is refused (signed)
    when one is not."""
    monkeypatch.setenv("TKB_TEST_KEY", "sk-ant-legal")
    seen: list = []
    port = _upstream(seen)
    door = ModelDoor(FakeBox(_policy(port=port), []))
    out = _call(door, b"/anthropic/v1/messages", ANTHROPIC)
    assert out.startswith(b"HTTP/1.1 403") and seen == []
    error = json.loads(out.partition(b"\r\n\r\n")[2])
    assert error["type"] == "error" and "models.server_tools" in error["error"]["message"]
    decided = [e for e in door.box.recorder.log if e[0] == "decide"]
    assert decided[-1][4] == "deny" and [f["kind"] for f in decided[-1][3]["fetches"]] == ["mcp", "tool", "url"]
    out = _call(door, b"/openai/v1/responses", OPENAI)
    assert out.startswith(b"HTTP/1.1 403") and json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == \
        "tkbox_model_door" and seen == []

    door = ModelDoor(FakeBox(_policy('server_tools = "egress"', port=port), []))
    out = _call(door, b"/anthropic/v1/messages", ANTHROPIC)
    assert out.startswith(b"HTTP/1.1 200") and len(seen) == 1
    assert door.box.recorder.log[0][4] == "allow" and door.box.recorder.log[0][3]["fetches"]

    door = ModelDoor(FakeBox(_policy('server_tools = "egress"', port=port,
                                     allow=ALLOW.replace(', "img.tkb.test:443"', "")), []))
    out = _call(door, b"/anthropic/v1/messages", ANTHROPIC)
    assert out.startswith(b"HTTP/1.1 403") and b"img.tkb.test:443 is not in [egress] allow" in out and len(seen) == 1


def test_a_deep_and_wide_body_is_walked_without_a_path_per_node():
    """Each node's JSON path was built as a string when it was pushed: a body nested 900 deep around 20 000 objects
    made the host hold 20 000 paths of kilobytes at once (gigabytes for a 16 MiB body). Now a place is a cell made in
    O(1) and rendered only for what is named."""
    import tracemalloc

    from tkbox_nb.guest.protocol import loads_one_reading
    doc = loads_one_reading(b'{"model":"m","x":' + b"[" * 900 + b'{"a":0},' * 20000
                            + b'{"image_url":"https://a.example/"}' + b"]" * 900 + b"}")
    tracemalloc.start()
    try:
        found = provider_fetches(doc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [f["url"] for f in found] == ["https://a.example/"] and len(found[0]["where"]) == 200
    assert peak < 12 << 20, peak
