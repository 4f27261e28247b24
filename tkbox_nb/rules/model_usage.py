"""Token usage and stop reason of a model response, plain JSON or a server-sent event stream (sans-IO).

The upstream is trusted more than the box, but its bytes are still parsed with limits: one SSE line at most 1 MiB
(longer ones are skipped, not buffered), counts only when they are non-negative integers. Both wire formats are read
the same way: every `usage` object found (top level, in `message`, in `response`) is folded in by taking, per count,
the largest value seen, which gives Anthropic's cumulative stream counts and OpenAI's final usage chunk alike.
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 1 << 20
_INPUT = ("input_tokens", "prompt_tokens")
_OUTPUT = ("output_tokens", "completion_tokens")


class Usage:
    def __init__(self) -> None:
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.stop_reason: str | None = None

    def as_dict(self) -> dict[str, int]:
        out = {}
        if self.input_tokens is not None:
            out["input_tokens"] = self.input_tokens
        if self.output_tokens is not None:
            out["output_tokens"] = self.output_tokens
        return out

    def fold(self, doc: Any) -> None:
        """Take the usage and stop reason of one JSON document (a whole response or one stream event)."""
        if not isinstance(doc, dict):
            return
        for holder in (doc, doc.get("message"), doc.get("response")):
            if not isinstance(holder, dict):
                continue
            usage = holder.get("usage")
            if isinstance(usage, dict):
                self.input_tokens = _bigger(self.input_tokens, usage, _INPUT)
                self.output_tokens = _bigger(self.output_tokens, usage, _OUTPUT)
            reason = holder.get("stop_reason")
            if isinstance(reason, str):
                self.stop_reason = reason[:100]
        delta = doc.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
            self.stop_reason = delta["stop_reason"][:100]
        choices = doc.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            reason = choices[0].get("finish_reason")
            if isinstance(reason, str):
                self.stop_reason = reason[:100]


def _bigger(current: int | None, usage: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = usage.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53:
            return v if current is None else max(current, v)
    return current


class UsageReader:
    """feed(bytes) as the response arrives; `usage` once it has ended. `streamed`: an SSE body, else one JSON."""

    def __init__(self, streamed: bool, max_json: int = 32 << 20):
        self.streamed, self.max_json = streamed, max_json
        self.usage = Usage()
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> None:
        if not self.streamed:
            if len(self._buf) + len(data) <= self.max_json:
                self._buf += data
            return
        self._buf += data
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_LINE:  # a line too long to read: skip it to its end
                    self._buf.clear()
                    self._skipping = True
                return
            line = bytes(self._buf[:end]).rstrip(b"\r")
            del self._buf[:end + 1]
            if self._skipping:
                self._skipping = False
                continue
            self._line(line)

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return
        try:
            self.usage.fold(json.loads(payload))
        except (ValueError, RecursionError):
            pass

    def end(self) -> Usage:
        if self.streamed:
            if self._buf and not self._skipping:
                self._line(bytes(self._buf).rstrip(b"\r"))
        else:
            try:
                self.usage.fold(json.loads(bytes(self._buf)))
            except (ValueError, RecursionError):
                pass
        self._buf.clear()
        return self.usage
