"""The checker of Jupyter messages from the box (sans-IO): what passes, what is removed, what ends the box."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tkbox_nb.box_messages import check_box_message
from tkbox_nb.protocol import MessageReader, ProtocolError, encode_message

HEADER = {"msg_id": "m1", "msg_type": "display_data", "session": "s", "username": "u", "date": "2026-12-01T00:00:00Z",
          "version": "5.3"}


def message(channel="iopub", msg_type="display_data", content=None, **over):
    msg = {"channel": channel, "header": dict(HEADER, msg_type=msg_type), "parent_header": {"msg_id": "p1",
           "msg_type": "execute_request"}, "metadata": {}, "content": content or {}, "buffers": []}
    msg.update(over)
    return msg


def test_well_formed_display_passes_with_every_mime_type_but_javascript():
    m = check_box_message(message(content={"data": {"text/plain": "x", "text/html": "<b>x</b>", "image/png": "iVBO"},
                                           "metadata": {}}))
    assert set(m.content["data"]) == {"text/plain", "text/html", "image/png"} and not m.dropped
    assert m.as_output()["output_type"] == "display_data"


def test_javascript_and_payloads_are_removed_and_named():
    m = check_box_message(message(content={"data": {"text/plain": "x", "application/javascript": "alert(1)"},
                                           "metadata": {}}))
    assert m.content["data"] == {"text/plain": "x"}
    assert m.dropped == ["display_data.data:application/javascript"]
    reply = check_box_message(message("shell", "execute_reply", {
        "status": "ok", "execution_count": 1, "payload": [
            {"source": "set_next_input", "text": "%%box_policy\n[exec]\ncells = true", "replace": False},
            {"source": "ask_exit", "keepkernel": False},
            {"source": "page", "data": {"text/plain": "help", "text/html": "<script>x</script>"}, "start": 0}]}))
    assert reply.content["payload"] == [{"source": "ask_exit", "keepkernel": False},
                                        {"source": "page", "data": {"text/plain": "help"}, "start": 0}]
    assert reply.dropped == ["execute_reply.payload:set_next_input naming a host magic",
                             "execute_reply.payload:page rich data"]


@pytest.mark.parametrize("text", ["%box_restart", "x = 1\n  %%box --new\nprint(2)", "%box_secret T --host h"])
def test_a_next_input_naming_a_host_magic_is_dropped(text):
    reply = check_box_message(message("shell", "execute_reply", {
        "status": "ok", "payload": [{"source": "set_next_input", "text": text, "replace": True}]}))
    assert reply.content["payload"] == [] and reply.dropped == ["execute_reply.payload:set_next_input naming a host magic"]


def test_next_input_and_exit_keep_their_meaning():
    reply = check_box_message(message("shell", "execute_reply", {"status": "ok", "payload": [
        {"source": "set_next_input", "text": "df.head()  # 100% box", "replace": True},
        {"source": "ask_exit", "keepkernel": True}, {"source": "edit_magic", "filename": "/etc/x"}]}))
    assert reply.content["payload"] == [{"source": "set_next_input", "text": "df.head()  # 100% box", "replace": True},
                                        {"source": "ask_exit", "keepkernel": True}]
    assert reply.dropped == ["execute_reply.payload:edit_magic"]


@pytest.mark.parametrize("payload", [{"source": "set_next_input", "text": 7}, {"source": "ask_exit", "keepkernel": "y"}])
def test_a_payload_of_the_wrong_shape_is_dropped(payload):
    reply = check_box_message(message("shell", "execute_reply", {"status": "ok", "payload": [payload]}))
    assert reply.content["payload"] == [] and len(reply.dropped) == 1


def test_a_type_a_kernel_does_not_send_on_a_channel_is_dropped_whole():
    assert check_box_message(message("shell", "execute_request")) is None
    assert check_box_message(message("iopub", "input_request", {"prompt": "x"})) is None


@pytest.mark.parametrize("bad", [
    {"extra": 1},
    {"channel": "hb"},
    {"header": {"msg_type": "stream"}},
    {"header": dict(HEADER, msg_id="x" * 1000)},
    {"buffers": ["not base64!"]},
    {"content": "text"},
])
def test_malformed_envelopes_end_the_box(bad):
    with pytest.raises(ProtocolError):
        check_box_message(message(**bad))


@pytest.mark.parametrize("msg_type,content", [
    ("stream", {"name": "stdin", "text": "x"}),
    ("stream", {"name": "stdout", "text": 7}),
    ("status", {"execution_state": "dancing"}),
    ("error", {"ename": "E", "evalue": "v", "traceback": [1]}),
    ("execute_result", {"data": {}, "metadata": {}, "execution_count": True}),
    ("comm_msg", {"comm_id": 5, "data": {}}),
])
def test_malformed_content_ends_the_box(msg_type, content):
    with pytest.raises(ProtocolError):
        check_box_message(message("iopub", msg_type, content))


def test_message_reader_refuses_oversized_and_reassembles_split_messages():
    data = encode_message(message())
    reader = MessageReader()
    assert reader.feed(data[:5]) == [] and reader.feed(data[5:]) == [message()]
    with pytest.raises(ProtocolError, match="over the limit"):
        MessageReader(max_message=100).feed(data)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                                                 max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["header", "parent_header", "metadata", "content", "buffers", "channel"]), value=JSONISH,
       msg_type=st.sampled_from(["stream", "display_data", "execute_reply", "input_request", "comm_open", "error",
                                 "status", "clear_output", "execute_result", "complete_reply", "inspect_reply"]))
def test_fuzz_checker_passes_drops_or_refuses_never_crashes(field, value, msg_type):
    channel = {"execute_reply": "shell", "input_request": "stdin", "complete_reply": "shell",
               "inspect_reply": "shell"}.get(msg_type, "iopub")
    msg = message(channel, msg_type)
    msg[field] = copy.deepcopy(value)
    try:
        out = check_box_message(msg)
    except ProtocolError:
        return
    if out is not None:
        out.as_output()  # whatever passed can be turned into an output without error
