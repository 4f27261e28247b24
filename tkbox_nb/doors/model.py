"""The model door on the host: each model API call from the box parsed, decided, budgeted, signed, and then sent
upstream with the key added here (live, record) or served from a bundle's recordings (replay).

The box's OpenAI and Anthropic clients talk plain HTTP/1.1 to the agent's endpoint (guest/forwarder.py, kind
"model"); each connection is one door stream and carries one call (answered with `Connection: close`). The request is
parsed by `model_request` (sans-IO, with limits). The door states the call to the signer: provider, model, endpoint,
stream, the requested output limit, the request body's digest (the body itself disclosed in the bundle), the mode,
and the run's totals before this call, so the budgets in `policy/models.decide` are a pure function of signed facts.
A refusal is an error body in the provider's own shape (status 403), so the official clients raise it with its
reason. Keys are read on the host and never reach the box: the box's OPENAI_API_KEY / ANTHROPIC_API_KEY are
meaningless placeholders, dropped here with every header not in `model_request.PASSED_HEADERS`.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from typing import TYPE_CHECKING

import h11

from tkbox_nb.guest import protocol as p
from tkbox_nb.stream.connection import Stream, StreamClosed
from tkbox_nb.stream.events import Data
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.doors.door import Door
from tkbox_nb.doors.model_replay import Recordings
from tkbox_nb.rules.model_request import ModelRequest, ModelRequestError, ModelRequestParser
from tkbox_nb.rules.model_usage import UsageReader
from tkbox_nb.rules.door_table import MODEL

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext

PORT = 3129
HEAD_TIMEOUT_S = 60.0
MAX_AT_ONCE = 16              # calls read and served at once; more wait (their bytes held by the stream's window)
MAX_RESPONSE = 32 << 20        # a response larger than this is cut (a bundle's content part is at most this)
DUMMY_KEY = "tkbox-model-door-no-key"   # what the box's clients send as a key: it means nothing, and is dropped


def box_env(port: int = PORT) -> dict[str, str]:
    """The box's model clients go to the agent's endpoint, which leads only to this door."""
    base = f"http://127.0.0.1:{port}"
    return {"TKBOX_MODEL_PORT": str(port), "OPENAI_BASE_URL": f"{base}/openai/v1",
            "ANTHROPIC_BASE_URL": f"{base}/anthropic", "OPENAI_API_KEY": DUMMY_KEY, "ANTHROPIC_API_KEY": DUMMY_KEY,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def error_body(provider: str, message: str, kind: str = "permission_error") -> bytes:
    """An error in the provider's own JSON shape, so its official client raises it with this message."""
    if provider == "anthropic":
        doc = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        doc = {"error": {"message": message, "type": kind, "param": None, "code": "tkbox_model_door"}}
    return json.dumps(doc).encode()


class ModelDoor(Door):
    name = "model"

    def __init__(self, box: "DoorContext", recordings: Recordings | None = None):
        self.box = box
        self.recordings = recordings
        self.lock = threading.Lock()
        self.calls = 0              # calls allowed so far in this run
        self.input_tokens = 0       # reported by finished calls
        self.output_tokens = 0      # reported by finished calls
        self.reserved = 0           # output tokens asked for by calls still in flight
        self._keys: dict[tuple[str, str], str] = {}
        self._client = None
        # bounds what a box can make the host hold: MAX_AT_ONCE request bodies of at most max_request_bytes each
        self.slots = threading.BoundedSemaphore(MAX_AT_ONCE)

    def env(self) -> dict[str, str]:
        """The box's model clients lead to this door; a binding of a dummy key's name replaces it (secrets_env)."""
        bound = {b.name for b in self.box.bindings}
        return {name: value for name, value in box_env().items() if name not in bound}

    def start(self) -> None:  # at the box's start: a missing key stops it with one line, not its first call
        if self.recordings is None and self.box.policy.model("mode") != "replay":
            self.read_keys()

    def read_keys(self) -> None:
        """Read every provider's key now, on the host, so a missing key stops the box at its start with one line
        (PolicyError) instead of failing its first call."""
        for name, provider in self.box.policy.data.get("models", {}).get("providers", {}).items():
            if "key" in provider and (name, provider["key"]) not in self._keys:
                self._keys[(name, provider["key"])] = _read_key(name, provider["key"])

    def accept(self, stream: Stream, body: dict) -> bool:
        if body.get("kind") != "model":
            return False
        threading.Thread(target=self._serve, args=(stream,), daemon=True, name="tkbox-model").start()
        return True

    def stop(self, reason: str) -> None:  # the upstream client closed
        if self._client is not None:
            self._client.close()

    # -- one call ------------------------------------------------------------------------------------------------
    def _serve(self, stream: Stream) -> None:
        with self.slots:
            self._serve_one(stream)

    def _serve_one(self, stream: Stream) -> None:
        parser = ModelRequestParser(self.box.policy.model("max_request_bytes"))
        try:
            try:
                req = self._read(stream, parser)
            except ModelRequestError as e:
                if e.provider:  # a call to a known provider that is malformed: a signed refusal
                    self.box.recorder.decide(MODEL, "call", {"provider": e.provider, "endpoint": e.endpoint,
                                                               "request_error": str(e)[:300]})
                return self._answer(stream, parser, e.provider, e.status, f"tkbox model door: {e}",
                                    "invalid_request_error")
            if req is None:
                return self.box.conn.close(stream.sid)
            self._call(stream, parser, req)
        except (StreamClosed, OSError):
            pass
        except p.ProtocolError as e:
            self.box.fail_closed(f"door protocol violation: {e}")
        except Exception as e:  # a fault of this door: the box's client gets an answer, never a hang
            self._answer(stream, parser, "", 502, f"tkbox model door: internal error: {type(e).__name__}", "api_error")

    def _read(self, stream: Stream, parser: ModelRequestParser) -> ModelRequest | None:
        deadline = time.monotonic() + HEAD_TIMEOUT_S
        while True:
            try:
                event = stream.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ModelRequestError(408, "no complete request within 60s") from None
            if not isinstance(event, Data):
                return None
            if event.channel != p.CH_BYTES:
                raise p.ProtocolError(f"model data on channel {event.channel}")
            req = parser.feed(event.payload)
            if req is not None:
                return req

    def _call(self, stream: Stream, parser: ModelRequestParser, req: ModelRequest) -> None:
        policy, recorder = self.box.policy, self.box.recorder
        mode = "replay" if self.recordings is not None else policy.model("mode")
        with self.lock:  # one decision at a time, so the totals each states are the run's
            facts = {"provider": req.provider, "model": req.model, "endpoint": req.endpoint, "stream": req.stream,
                     "max_output": req.max_output, "mode": mode, "run_calls": self.calls,
                     "run_input_tokens": self.input_tokens, "run_output_tokens": self.output_tokens + self.reserved,
                     "request_size": len(req.body)}
            if req.fetches:  # server-side tools, MCP servers, URLs the provider would fetch: decided, then signed
                facts["fetches"] = req.fetches
            if mode == "replay":
                facts["recorded"] = self.recordings is not None and self.recordings.has(req.key)
            crossing = recorder.decide(MODEL, "call", facts, {"request": req.body})
            if crossing.allowed:
                self.calls += 1
                self.reserved += req.max_output or 0
        if not crossing.allowed:
            if recorder.broken:
                self.box.fail_closed(f"signer lost: {recorder.broken}")
            why = crossing.verdict.reason or crossing.reason
            rules = ", ".join(crossing.rule_ids) or "refused"
            return self._answer(stream, parser, req.provider, 403,
                                f"tkbox model door: refused by {crossing.verdict.rule} ({rules}): {why}")
        result: dict = {"mode": mode, "streamed": req.stream}
        usage_reader = UsageReader(req.stream)
        body = bytearray()
        failure: _Failed | None = None
        started = time.monotonic()
        try:
            if mode == "replay":
                recorded = self.recordings.take(req.key) if self.recordings else None
                if recorded is None:  # taken by a concurrent identical call since the decision
                    raise _Failed(403, "this request was recorded fewer times than it is made now")
                result.update(status_code=recorded.status_code, content_type=recorded.content_type)
                self._send_head(stream, parser, recorded.status_code, recorded.content_type)
                self._send_body(stream, parser, recorded.body, body, usage_reader)
            else:
                recorder.model_event(crossing, "request", req.provider, req.model,
                                     content_digest=crossing.args["request"], streamed=req.stream)
                self._upstream(stream, parser, req, result, body, usage_reader, started)
        except _Failed as e:
            result["error"], failure = str(e)[:300], e
        except (StreamClosed, OSError, h11.LocalProtocolError) as e:
            result["error"] = f"the box's connection ended: {e}"[:300]
        except Exception as e:  # a fault of this door: the call still gets its signed end, its reservation released
            result["error"] = f"tkbox model door: internal error: {type(e).__name__}"
            failure = _Failed(502, "internal error", "api_error")
        finally:
            # signed before the box sees the end of the answer, so the box's next call is decided on totals that
            # hold this one (and the verifier can recount them exactly, bundle/verify.py); on any exception too
            self._sign_end(crossing, req, mode, result, bytes(body), usage_reader.end(), started)
        try:
            if failure is not None and "status_code" not in result:  # nothing sent yet: the reason, in its shape
                self._answer(stream, parser, req.provider, failure.status, f"tkbox model door: {failure}",
                             failure.kind)
            elif "error" not in result:
                self._send(stream, parser, h11.EndOfMessage())
        except (StreamClosed, OSError, h11.LocalProtocolError):
            pass
        finally:
            try:
                self.box.conn.close(stream.sid)
            except (StreamClosed, OSError):
                pass

    def _sign_end(self, crossing, req: ModelRequest, mode: str, result: dict, data: bytes, usage, started: float):
        """Tracekit's response event, then the call's result and the run's totals together under the door's lock:
        the totals each later decision states are exactly the signed results before it (plus calls in flight)."""
        from tkbox_nb.signing.recorder import sha256_digest
        recorder = self.box.recorder
        charged = self._charge_unreported(req, result, usage)
        result.update(latency_ms=int((time.monotonic() - started) * 1000), usage=usage.as_dict())
        if charged:
            result["usage_charged"] = charged
        if usage.stop_reason:
            result["stop_reason"] = usage.stop_reason
        if mode != "replay":
            event = {k: v for k, v in (("usage", usage.as_dict()), ("stop_reason", usage.stop_reason),
                                       ("error", result.get("error"))) if v}
            recorder.model_event(crossing, "response", req.provider, req.model, content_digest=sha256_digest(data),
                                 streamed=req.stream, **event)
        content = {}
        if mode in ("record", "replay") and "error" not in result:
            content["response"] = data  # disclosed: what a later replay serves
        else:
            result.update(response_digest=sha256_digest(data), response_size=len(data))
        ok = "error" not in result and 200 <= result.get("status_code", 0) < 300
        with self.lock:
            self.reserved -= req.max_output or 0
            self.input_tokens += usage.input_tokens or 0
            self.output_tokens += usage.output_tokens or 0
            recorder.complete(crossing, "ok" if ok else "error", result, content)

    def _charge_unreported(self, req: ModelRequest, result: dict, usage) -> list[str]:
        """Counts a response that the upstream answered does not report (an OpenAI stream without
        `stream_options.include_usage`, say), charged in full when a budget counts them: output as the tokens the call
        reserved, input as the request's size in bytes. The counts the result states; the names charged so."""
        if "status_code" not in result:  # nothing came from upstream (or a replay's recording)
            return []
        charged = []
        if usage.output_tokens is None and self.box.policy.model("max_output_tokens"):
            usage.output_tokens, charged = req.max_output or 0, charged + ["output_tokens"]
        if usage.input_tokens is None and self.box.policy.model("max_input_tokens"):
            usage.input_tokens, charged = len(req.body), charged + ["input_tokens"]
        return charged

    def _upstream(self, stream: Stream, parser: ModelRequestParser, req: ModelRequest, result: dict,
                  body: bytearray, usage_reader: UsageReader, started: float) -> None:
        import httpx

        from tkbox_nb.rules.secrets import Scrubber, error_text
        provider = self.box.policy.data.get("models", {}).get("providers", {}).get(req.provider)
        if provider is None:  # the policy changed since the decision
            raise _Failed(403, f"[models.{req.provider}] is not configured")
        key = self._key(req.provider, provider)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers]
        headers += [("authorization", f"Bearer {key}")] if req.provider == "openai" else [("x-api-key", key)]
        headers.append(("user-agent", "tkbox-nb model door"))
        with self.lock:
            if self._client is None:  # one pool for the box's calls; the host's proxy settings are not the box's
                self._client = httpx.Client(timeout=self.box.policy.model("timeout_s"), trust_env=False)
        scrub = Scrubber([key])
        try:
            with self._client.stream("POST", provider["base_url"] + req.endpoint, content=req.body,
                                     headers=headers, timeout=self.box.policy.model("timeout_s")) as r:
                result["first_byte_ms"] = int((time.monotonic() - started) * 1000)
                ctype = scrub.scrub(r.headers.get("content-type", "application/json").encode("utf-8", "replace"))
                # scrubbed: a head's words reach the box too; visible ASCII only, as h11 sends no other str
                ctype = re.sub(r"[^\x20-\x7e]", "?", ctype.decode("ascii", "replace"))[:200]
                result.update(status_code=r.status_code, content_type=ctype)
                self._send_head(stream, parser, r.status_code, ctype)
                for chunk in r.iter_bytes():
                    self._send_body(stream, parser, scrub.feed(chunk), body, usage_reader)
                self._send_body(stream, parser, scrub.flush(), body, usage_reader)
        except httpx.HTTPError as e:
            # h11 and httpx name an illegal header value in their errors: the key is starred if it is in one
            raise _Failed(502, f"{req.provider} upstream: {error_text(e, [key])}", "api_error") from None

    def _key(self, name: str, provider: dict) -> str:
        """The provider's key, read on the host (once per source): a [secrets.NAME] binding's value, or
        key = env:/file:."""
        if "secret" in provider:
            for b in self.box.bindings:
                if b.name == provider["secret"]:  # its value was checked when it was bound (secrets.check_binding)
                    if not b.value.isascii():
                        raise _Failed(502, f"the secret {b.name} holding the {name} key is not ASCII", "api_error")
                    return b.value
            raise _Failed(502, f"the secret {provider['secret']} holding the {name} key is not bound", "api_error")
        source = provider.get("key", "")
        if (name, source) not in self._keys:
            try:
                self._keys[(name, source)] = _read_key(name, source)
            except PolicyError as e:
                raise _Failed(502, f"the host has no {name} key: {e}", "api_error") from None
        return self._keys[(name, source)]

    # -- answering the box ---------------------------------------------------------------------------------------
    def _send(self, stream: Stream, parser: ModelRequestParser, event) -> None:
        data = parser.conn.send(event)
        if data:
            self.box.conn.send_data(stream.sid, p.CH_BYTES, data)

    def _send_head(self, stream: Stream, parser: ModelRequestParser, status: int, ctype: str) -> None:
        self._send(stream, parser, h11.Response(status_code=status, headers=[
            ("content-type", ctype), ("connection", "close"), ("cache-control", "no-store")]))

    def _send_body(self, stream: Stream, parser: ModelRequestParser, data: bytes, body: bytearray,
                   usage_reader: UsageReader) -> None:
        if not data:
            return
        if len(body) + len(data) > MAX_RESPONSE:
            raise _Failed(502, f"the response is over {MAX_RESPONSE} bytes", "api_error")
        body += data
        usage_reader.feed(data)
        self._send(stream, parser, h11.Data(data=data))

    def _answer(self, stream: Stream, parser: ModelRequestParser, provider: str, status: int, message: str,
                kind: str = "permission_error") -> None:
        data = error_body(provider, message, kind)
        try:
            conn = parser.conn
            if conn.our_state is not h11.SEND_RESPONSE:  # the request was not whole: answer without h11's state
                head = (f"HTTP/1.1 {status} Error\r\ncontent-type: application/json\r\ncontent-length: {len(data)}"
                        "\r\nconnection: close\r\n\r\n").encode()
                self.box.conn.send_data(stream.sid, p.CH_BYTES, head + data)
            else:
                self._send(stream, parser, h11.Response(status_code=status, headers=[
                    ("content-type", "application/json"), ("content-length", str(len(data))),
                    ("connection", "close")]))
                self._send(stream, parser, h11.Data(data=data))
                self._send(stream, parser, h11.EndOfMessage())
            self.box.conn.close(stream.sid)
        except (StreamClosed, OSError, h11.LocalProtocolError):
            pass


def _read_key(name: str, source: str) -> str:
    """A provider's key from `source`, checked as read_value checks a secret (a legal HTTP header value) and ASCII,
    as httpx sends a header; errors name the source, never the key."""
    from tkbox_nb.rules.secrets import read_value
    try:
        key = read_value(name, source)
    except PolicyError as e:  # its message names the source, never a value
        raise PolicyError(str(e).replace(f"secrets.{name}:", f"models.{name}.key:", 1)) from None
    if not key.isascii():
        raise PolicyError(f"models.{name}.key: the value from {source} is not ASCII")
    return key


class _Failed(Exception):
    def __init__(self, status: int, message: str, kind: str = "permission_error"):
        super().__init__(message)
        self.status, self.kind = status, kind
