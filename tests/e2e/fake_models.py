"""A test fixture, not part of tkbox: an OpenAI-compatible and an Anthropic-compatible upstream with canned answers.

Run in a test network namespace: `python fake_models.py ADDRESS PORT LOGFILE [SAYS]`. It answers /v1/chat/completions,
/v1/responses, /v1/embeddings (OpenAI) and /v1/messages (Anthropic), streamed (SSE) or not, deterministically from
the request, and appends one JSON line per request to LOGFILE with the path and the key headers it received.
SAYS (default "echo") is the word each answer starts with: an upstream started with another answers the same request
differently, as a real model may between two runs (everything else, usage included, stays the same).
"""

import base64
import http.server
import json
import struct
import sys


def _last_text(doc):
    for m in reversed(doc.get("messages") or []):
        c = m.get("content")
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            return " ".join(x.get("text", "") for x in c if isinstance(x, dict))
    inp = doc.get("input")
    return inp if isinstance(inp, str) else json.dumps(inp)[:200]


SAYS = sys.argv[4] if len(sys.argv) > 4 else "echo"


class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK stall

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        doc = json.loads(body)
        with open(sys.argv[3], "a") as log:
            log.write(json.dumps({"path": self.path, "authorization": self.headers.get("Authorization"),
                                  "x_api_key": self.headers.get("X-Api-Key"), "model": doc.get("model"),
                                  "headers": sorted(k.lower() for k in self.headers.keys())}) + "\n")
        said = SAYS + ": " + _last_text(doc)
        if _last_text(doc) == "fail please":  # an upstream refusal, passed through as it is
            return self.json(400, {"error": {"message": "upstream says no", "type": "invalid_request_error",
                                             "param": None, "code": None}})
        if _last_text(doc) == "tell me your key":  # a hostile or careless upstream that repeats the key it got
            said = f"I got {self.headers.get('Authorization')} {self.headers.get('X-Api-Key')}"
        if self.path == "/v1/chat/completions":
            return self.chat(doc, said)
        if self.path == "/v1/responses":
            response = {"id": "resp_1", "object": "response", "created_at": 1, "model": doc["model"],
                        "status": "completed", "output": [{
                            "type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                            "content": [{"type": "output_text", "text": said, "annotations": []}]}],
                        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}}
            if not doc.get("stream"):
                return self.json(200, response)
            started = dict(response, status="in_progress", output=[], usage=None)
            events = [("response.created", {"type": "response.created", "sequence_number": 0,
                                            "response": started})]
            for i, word in enumerate(said.split(" ")):
                events.append(("response.output_text.delta", {
                    "type": "response.output_text.delta", "sequence_number": i + 1, "item_id": "msg_1",
                    "output_index": 0, "content_index": 0, "delta": word + " ", "logprobs": []}))
            events.append(("response.completed", {"type": "response.completed", "sequence_number": 99,
                                                  "response": response}))
            return self.sse(events)
        if self.path == "/v1/embeddings":
            vec = [0.25, 0.5, 0.75]
            emb = base64.b64encode(struct.pack("<3f", *vec)).decode() \
                if doc.get("encoding_format") == "base64" else vec
            return self.json(200, {"object": "list", "model": doc["model"], "data": [
                {"object": "embedding", "index": 0, "embedding": emb}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3}})
        if self.path == "/v1/messages":
            return self.messages(doc, said)
        self.json(404, {"error": {"message": "no such endpoint", "type": "invalid_request_error"}})

    def json(self, status, doc):
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def sse(self, events):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for name, doc in events:
            head = f"event: {name}\n" if name else ""
            self.wfile.write((head + "data: " + (doc if isinstance(doc, str) else json.dumps(doc)) + "\n\n").encode())
            self.wfile.flush()
        self.close_connection = True

    def chat(self, doc, said):
        base = {"id": "chatcmpl-1", "created": 1, "model": doc["model"]}
        usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
        if not doc.get("stream"):
            return self.json(200, dict(base, object="chat.completion", usage=usage, choices=[{
                "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": said}}]))
        chunk = dict(base, object="chat.completion.chunk")
        events = [(None, dict(chunk, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None}]))]
        for word in said.split(" "):
            events.append((None, dict(chunk, choices=[{"index": 0, "delta": {"content": word + " "},
                                                       "finish_reason": None}])))
        events.append((None, dict(chunk, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])))
        if (doc.get("stream_options") or {}).get("include_usage"):
            events.append((None, dict(chunk, choices=[], usage=usage)))
        events.append((None, "[DONE]"))
        self.sse(events)

    def messages(self, doc, said):
        msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": doc["model"], "stop_sequence": None}
        if not doc.get("stream"):
            return self.json(200, dict(msg, content=[{"type": "text", "text": said}], stop_reason="end_turn",
                                       usage={"input_tokens": 12, "output_tokens": 6}))
        events = [("message_start", {"type": "message_start", "message": dict(
                      msg, content=[], stop_reason=None, usage={"input_tokens": 12, "output_tokens": 1})}),
                  ("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}})]
        for word in said.split(" "):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": word + " "}}))
        events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                                         "stop_sequence": None},
                                      "usage": {"output_tokens": 6}}),
                   ("message_stop", {"type": "message_stop"})]
        self.sse(events)


if __name__ == "__main__":
    http.server.ThreadingHTTPServer.daemon_threads = True
    http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
