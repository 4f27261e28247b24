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


def test_a_reply_made_here_names_its_parent_goes_to_its_identities_and_a_replay_is_refused():
    ours = Session(b"k" * 64, username="tkbox", signature_scheme="hmac-sha256")
    theirs = JSession(key=b"k" * 64)
    request = theirs.msg("kernel_info_request", {})
    frames = theirs.serialize(request, ident=[b"client"])
    idents, msg_list = ours.feed_identities(frames)
    got = ours.deserialize(msg_list)
    with pytest.raises(ValueError):  # the same signed message again: a replay
        ours.deserialize(msg_list)
    sock = Frames()
    ours.send(sock, "kernel_info_reply", {"status": "ok"}, parent=got["header"], ident=idents)
    assert sock.frames[0] == b"client"
    _, reply_list = theirs.feed_identities(sock.frames)
    reply = theirs.deserialize(reply_list)
    assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"]
    assert reply["header"]["version"] == "5.3" and reply["header"]["username"] == "tkbox"
    assert str(reply["header"]["date"].tzinfo) == "tzutc()" or reply["header"]["date"].utcoffset().total_seconds() == 0


def test_no_key_means_unsigned_and_an_unknown_scheme_is_refused():
    ours, theirs = Session(b""), JSession(key=b"")
    sock = Frames()
    ours.send(sock, "status", {"execution_state": "idle"})
    assert sock.frames[1] == b""
    assert theirs.deserialize(theirs.feed_identities(sock.frames)[1])["content"]["execution_state"] == "idle"
    with pytest.raises(ValueError):
        Session(b"k", signature_scheme="rsa-sha256")
