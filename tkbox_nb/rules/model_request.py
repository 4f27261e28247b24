"""A model call from the box, parsed strictly and sans-IO: the HTTP/1.1 request (h11), its route, its JSON body.

The box's clients reach the model endpoint with base URLs `http://127.0.0.1:3129/openai/v1` and
`http://127.0.0.1:3129/anthropic`, so the path names the provider and the endpoint. Only POST to a few endpoints
passes; the body must be one JSON object of at most the policy's `max_request_bytes`, naming a model; what it asks the
provider to fetch or run on its side (server-side tools, MCP servers, URLs) is listed (model_fetches.py). Everything
here is hostile input: the parser returns a ModelRequest, or raises ModelRequestError with the HTTP status to answer
and a reason (both end up in the signed refusal when the route is known).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import h11

from tkbox_nb.guest.protocol import loads_one_reading
from tkbox_nb.rules.model_fetches import provider_fetches

MAX_HEAD = 64 * 1024
ROUTES = {  # box path prefix -> (provider, allowed endpoints)
    "/openai": ("openai", ("/v1/chat/completions", "/v1/responses", "/v1/embeddings")),
    "/anthropic": ("anthropic", ("/v1/messages",)),
}
# request headers a client may pass upstream; every other one (the box's dummy key among them) is dropped
PASSED_HEADERS = {b"content-type", b"accept", b"anthropic-version", b"anthropic-beta", b"openai-beta"}
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_FIELD_VALUE = re.compile(rb"[\x20-\x7e\t]*")
MAX_CHOICES = 128
MAX_OUTPUT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class ModelRequestError(ValueError):
    def __init__(self, status: int, message: str, provider: str = "", endpoint: str = ""):
        super().__init__(message)
        self.status, self.provider, self.endpoint = status, provider, endpoint


@dataclass
class ModelRequest:
    provider: str
    endpoint: str                     # e.g. /v1/chat/completions
    body: bytes                       # exactly as the box sent it
    model: str
    stream: bool
    max_output: int | None            # max_tokens (or its OpenAI names) times n (choices), when the request says
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)   # the passed ones only
    fetches: list[dict] = field(default_factory=list)  # what the provider would fetch or run: model_fetches.py

    @property
    def key(self) -> tuple[str, str, str]:
        """What a replay looks a recording up by: the provider, the endpoint and the digest of the exact body (the
        same three facts the call's signed decision states)."""
        return (self.provider, self.endpoint, "sha256:" + hashlib.sha256(self.body).hexdigest())


def route(target: str) -> tuple[str, str]:
    """(provider, endpoint) of a request target, or ModelRequestError."""
    path = target.split("?", 1)[0]
    for prefix, (provider, endpoints) in ROUTES.items():
        if path.startswith(prefix + "/"):
            endpoint = path[len(prefix):]
            if endpoint not in endpoints:
                raise ModelRequestError(404, f"{provider}: {endpoint[:100]!r} is not an endpoint this door carries "
                                             f"({', '.join(endpoints)})", provider, endpoint[:100])
            return provider, endpoint
    raise ModelRequestError(404, f"no provider at {path[:100]!r} (the box's base URLs are /openai/v1 and /anthropic)")


class ModelRequestParser:
    """feed(bytes) -> None until the whole request is in, then a ModelRequest; ModelRequestError on anything else."""

    def __init__(self, max_body: int):
        self.max_body = max_body
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._head: h11.Request | None = None
        self._route: tuple[str, str] = ("", "")
        self._body = bytearray()

    @property
    def conn(self) -> h11.Connection:
        """The h11 server connection, whose state the door's answer continues."""
        return self._conn

    def feed(self, data: bytes) -> ModelRequest | None:
        try:
            self._conn.receive_data(data)
            while True:
                event = self._conn.next_event()
                if event is h11.NEED_DATA:  # h11 itself refuses a head over MAX_HEAD
                    return None
                if isinstance(event, h11.Request):
                    self._start(event)
                elif isinstance(event, h11.Data):
                    self._body += event.data
                    if len(self._body) > self.max_body:
                        raise ModelRequestError(413, f"a request body over {self.max_body} bytes", *self._route)
                elif isinstance(event, h11.EndOfMessage):
                    return self._finish()
                else:
                    raise ModelRequestError(400, "not an HTTP/1.1 request")
        except h11.RemoteProtocolError as e:
            raise ModelRequestError(400, f"not an HTTP/1.1 request: {e}", *self._route) from None

    def _start(self, event: h11.Request) -> None:
        self._head = event
        method, target = event.method.decode("ascii", "replace"), event.target.decode("ascii", "replace")
        self._route = route(target)
        if method != "POST":
            raise ModelRequestError(405, f"{method[:20]} {target[:100]}: only POST passes the model door", *self._route)
        for k, v in event.headers:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body:
                raise ModelRequestError(413, f"a request body of {int(v)} bytes, over {self.max_body}", *self._route)

    def _finish(self) -> ModelRequest:
        provider, endpoint = self._route
        body = bytes(self._body)
        try:
            doc = loads_one_reading(body)
        except (ValueError, RecursionError) as e:
            raise ModelRequestError(400, f"the request body is not JSON: {str(e)[:120]}", provider, endpoint) from None
        if not isinstance(doc, dict):
            raise ModelRequestError(400, "the request body is not a JSON object", provider, endpoint)
        model = doc.get("model")
        if not isinstance(model, str) or not _MODEL.fullmatch(model):
            raise ModelRequestError(400, "the request names no model (a string of at most 128 plain characters)",
                                    provider, endpoint)
        stream = doc.get("stream", False)
        if not isinstance(stream, bool):
            raise ModelRequestError(400, "stream must be true or false", provider, endpoint)
        asked = [doc[k] for k in MAX_OUTPUT_KEYS if k in doc and doc[k] is not None]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in asked):
            raise ModelRequestError(400, "max_tokens must be a count", provider, endpoint)
        copies = doc.get("n", 1)  # OpenAI chat: n choices, each up to max_tokens
        if copies is None:
            copies = 1
        if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= MAX_CHOICES:
            raise ModelRequestError(400, f"n must be a count from 1 to {MAX_CHOICES}", provider, endpoint)
        headers = [(k, v) for k, v in self._head.headers if k in PASSED_HEADERS]
        for k, v in headers:  # h11 reads obs-text (bytes over 0x7f) in a value; the upstream client sends ASCII only
            if not _FIELD_VALUE.fullmatch(v):
                raise ModelRequestError(400, f"the {k.decode('ascii')} header is not visible ASCII", provider, endpoint)
        return ModelRequest(provider, endpoint, body, model, stream, max(asked) * copies if asked else None, headers,
                            provider_fetches(doc))
