"""The kernel bridge's wire format (guest/jsession.py) is jupyter_client's: each reads what the other signs."""

import pytest
from jupyter_client.session import Session as JSession

from tkbox_nb.guest.jsession import DELIM, Session


class Frames:
    """A socket stand-in: keeps what was sent."""

    def send_multipart(self, frames, copy=True):
        self.frames = frames


def test_what_the_bridge_signs_jupyter_client_reads():
    ours = Session(b"k" * 64)
    theirs = JSession(key=b"k" * 64)
    sock = Frames()
    msg = ours.msg("kernel_info_request", {"x": "\u00e9"})
    ours.send(sock, msg, buffers=[b"\x00\x01"])
    _, msg_list = theirs.feed_identities(sock.frames)
    got = theirs.deserialize(msg_list)
    assert got["header"]["msg_id"] == msg["header"]["msg_id"] and got["msg_type"] == "kernel_info_request"
    assert got["content"] == {"x": "\u00e9"} and bytes(got["buffers"][0]) == b"\x00\x01"


def test_what_jupyter_client_signs_the_bridge_reads_and_a_bad_signature_is_refused():
    ours = Session(b"k" * 64)
    theirs = JSession(key=b"k" * 64)
    frames = [b"ident"] + theirs.serialize(theirs.msg("status", {"execution_state": "idle"}))
    idents, msg_list = ours.feed_identities(frames)
    assert idents == [b"ident"]
    got = ours.deserialize(msg_list)
    assert got["msg_type"] == "status" and got["content"] == {"execution_state": "idle"}
    assert isinstance(got["header"]["date"], str)  # dates stay the strings they were
    assert ours.sign(msg_list[1:5]) == msg_list[0]
    with pytest.raises(ValueError):
        ours.deserialize([b"0" * 64] + msg_list[1:])
    with pytest.raises(ValueError):
        ours.deserialize(msg_list[:4])
    with pytest.raises(ValueError):
        ours.feed_identities([b"no delimiter"])
    assert DELIM == b"<IDS|MSG>"
