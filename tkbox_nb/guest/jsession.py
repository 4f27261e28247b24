"""The Jupyter wire format, as much of it as the kernel bridge (kernel.py) and the Tracekit Box kernel's host process
(jupyter/kernel/app.py) need: standard library only.

Both once used jupyter_client's Session; importing jupyter_client takes about 0.15 s of CPU, which at a kernel's start
competes with the box and the ipykernel being started (docs/jupyter.md, "Start to the first result"). This is the same
format (the messaging spec's "The wire protocol"): [identities..., DELIM, HMAC, header, parent_header, metadata,
content, buffers...], the HMAC of the four JSON parts under the connection file's key and signature scheme (no key:
unsigned).
Messages read keep their headers' dates as the strings they were (nothing here parses them); a signature seen
before is refused, as jupyter_client refuses it.
"""

import hashlib
import hmac
import itertools
import json
import os
import uuid
from collections import deque
from datetime import datetime, timezone

DELIM = b"<IDS|MSG>"
PROTOCOL_VERSION = "5.3"
DIGEST_HISTORY = 1 << 16  # signatures remembered against replays


def _default(obj):
    if isinstance(obj, datetime):  # a date given by a caller: ISO 8601, as jupyter_client writes it
        if obj.tzinfo is None:
            obj = obj.replace(tzinfo=timezone.utc)
        return obj.isoformat().replace("+00:00", "Z")
    raise TypeError("%s is not JSON" % type(obj).__name__)


def pack(obj):
    return json.dumps(obj, default=_default, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8", "surrogateescape")


def now():
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Session:
    """Signs and reads the messages of one kernel connection (`key`: bytes; `signature_scheme`: hmac-ALGORITHM)."""

    def __init__(self, key, username="box", signature_scheme="hmac-sha256"):
        scheme, _, algorithm = signature_scheme.partition("-")
        if scheme != "hmac" or algorithm not in hashlib.algorithms_available:
            raise ValueError("unsupported signature scheme %r" % signature_scheme)
        self.key = key
        self.digestmod = algorithm
        self.username = username
        self.session = str(uuid.uuid4())
        self.bsession = self.session.encode("ascii")
        self.pid = os.getpid()
        self._count = itertools.count(1)  # next() is atomic: messages are made on several threads
        self._seen = set()
        self._seen_order = deque()

    def sign(self, parts):
        if not self.key:
            return b""
        h = hmac.new(self.key, digestmod=self.digestmod)
        for part in parts:
            h.update(part)
        return h.hexdigest().encode("ascii")

    def msg_header(self, msg_type):
        return {"msg_id": "%s_%d_%d" % (self.session, self.pid, next(self._count)), "msg_type": msg_type,
                "username": self.username, "session": self.session, "date": now(), "version": PROTOCOL_VERSION}

    def msg(self, msg_type, content=None, parent=None, metadata=None):
        """A new message; `parent` is the message (or header) it answers."""
        if parent and "header" in parent:
            parent = parent["header"]
        return {"header": self.msg_header(msg_type), "parent_header": dict(parent or {}),
                "metadata": dict(metadata or {}), "content": {} if content is None else content}

    def send(self, socket, msg, content=None, parent=None, ident=None, metadata=None, buffers=None):
        """Send `msg`: a message dict (as made by msg(), or relayed) or a msg_type, made here with `content`,
        `parent` and `metadata`. `ident`: the routing identities (bytes, or a list of them)."""
        if isinstance(msg, str):
            msg = self.msg(msg, content, parent, metadata)
        if buffers is None:
            buffers = msg.get("buffers") or []
        parts = [pack(msg["header"]), pack(msg.get("parent_header") or {}), pack(msg.get("metadata") or {}),
                 pack(msg.get("content") if msg.get("content") is not None else {})]
        idents = list(ident) if isinstance(ident, (list, tuple)) else ([ident] if ident is not None else [])
        socket.send_multipart(idents + [DELIM, self.sign(parts)] + parts + [bytes(b) for b in buffers], copy=True)
        return msg

    @staticmethod
    def feed_identities(frames):
        """(identities, the message's frames from its HMAC on); ValueError without the delimiter."""
        frames = [bytes(f) for f in frames]
        i = frames.index(DELIM)
        return frames[:i], frames[i + 1:]

    def deserialize(self, msg_list):
        """The message of `msg_list` (from its HMAC on) as a dict; ValueError when it is short, badly signed or a
        replay of one already read."""
        if len(msg_list) < 5:
            raise ValueError("a message has at least 5 parts")
        signature = bytes(msg_list[0])
        if self.key:
            if not signature:
                raise ValueError("unsigned message")
            if signature in self._seen:
                raise ValueError("duplicate signature")
            if not hmac.compare_digest(signature, self.sign(msg_list[1:5])):
                raise ValueError("bad signature")
            self._seen.add(signature)
            self._seen_order.append(signature)
            if len(self._seen_order) > DIGEST_HISTORY:
                self._seen.discard(self._seen_order.popleft())
        header, parent, metadata, content = (json.loads(bytes(part).decode("utf-8")) for part in msg_list[1:5])
        if not all(isinstance(part, dict) for part in (header, parent, metadata, content)):
            raise ValueError("a message's four parts are objects")
        if not (isinstance(header.get("msg_id"), str) and isinstance(header.get("msg_type"), str)):
            raise ValueError("a header names its msg_id and msg_type")
        return {"header": header, "parent_header": parent, "metadata": metadata, "content": content,
                "msg_id": header["msg_id"], "msg_type": header["msg_type"],
                "buffers": [bytes(b) for b in msg_list[5:]]}
