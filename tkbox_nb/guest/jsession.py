"""The Jupyter wire format, as much of it as the kernel bridge (kernel.py) needs: standard library only.

The bridge once used jupyter_client's Session; importing jupyter_client takes about a fifth of a second of CPU, which
in a box that has just started competes with the ipykernel being started (docs/jupyter.md, "The first cell"). This is
the same format (the messaging spec's "The wire protocol"): [identities..., DELIM, HMAC, header, parent_header,
metadata, content, buffers...], the HMAC-SHA256 hex digest of the four JSON parts under the connection file's key.
Messages read back keep their headers' dates as the strings they were (nothing here parses them).
"""

import hmac
import hashlib
import json
import os
import uuid
from datetime import datetime, timezone

DELIM = b"<IDS|MSG>"
PROTOCOL_VERSION = "5.3"


def pack(obj):
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8",
                                                                                          "surrogateescape")


class Session:
    """Signs and reads the messages of one kernel connection (`key`: bytes)."""

    def __init__(self, key, username="box"):
        self.key = key
        self.username = username
        self.session = str(uuid.uuid4())
        self.bsession = self.session.encode("ascii")
        self.pid = os.getpid()

    def sign(self, parts):
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.hexdigest().encode("ascii")

    def msg(self, msg_type, content=None):
        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": self.username,
                  "session": self.session, "date": datetime.now(timezone.utc).isoformat(),
                  "version": PROTOCOL_VERSION}
        return {"header": header, "parent_header": {}, "metadata": {}, "content": content or {}}

    def send(self, socket, msg, buffers=()):
        parts = [pack(msg["header"]), pack(msg.get("parent_header") or {}), pack(msg.get("metadata") or {}),
                 pack(msg.get("content") or {})]
        socket.send_multipart([DELIM, self.sign(parts)] + parts + [bytes(b) for b in buffers], copy=True)

    @staticmethod
    def feed_identities(frames):
        """(identities, the message's frames from its HMAC on); ValueError without the delimiter."""
        i = frames.index(DELIM)
        return frames[:i], frames[i + 1:]

    def deserialize(self, msg_list):
        """The message of `msg_list` (from its HMAC on) as a dict; ValueError when it is short or badly signed."""
        if len(msg_list) < 5:
            raise ValueError("a message has at least 5 parts")
        if not hmac.compare_digest(msg_list[0], self.sign(msg_list[1:5])):
            raise ValueError("bad signature")
        header, parent, metadata, content = (json.loads(part.decode("utf-8")) for part in msg_list[1:5])
        if not all(isinstance(part, dict) for part in (header, parent, metadata, content)):
            raise ValueError("a message's four parts are objects")
        if not (isinstance(header.get("msg_id"), str) and isinstance(header.get("msg_type"), str)):
            raise ValueError("a header names its msg_id and msg_type")
        return {"header": header, "parent_header": parent, "metadata": metadata, "content": content,
                "msg_id": header["msg_id"], "msg_type": header["msg_type"], "buffers": msg_list[5:]}
