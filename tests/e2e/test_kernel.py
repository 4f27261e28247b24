"""The Tracekit Box kernel, driven by real Jupyter clients (jupyter_client, nbclient) with real boxes behind it.

The kernelspec under test is the shipped one (`kernels/tkbox`), found through JUPYTER_PATH.
"""

from __future__ import annotations

import contextlib
import json
import re
import os
import shutil
import weakref
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from conftest import run_cli
from jupyter_client.manager import KernelManager

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.jupyter.kernel.comms import MAX_SIGNED
from tkbox_nb.jupyter.kernel.relay import NOTICE_MIME
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernel_env(signer, tmp_path, monkeypatch):
    bundles = tmp_path / "bundles"
    monkeypatch.setenv("JUPYTER_PATH", str(ROOT))
    monkeypatch.setenv("TKBOX_BUNDLE_DIR", str(bundles))
    return bundles


class Client:
    """A jupyter_client kernel with a few helpers; outputs are (msg_type, content) pairs, status messages left out."""

    def __init__(self, cwd: str | Path | None = None):
        """A kernel started in `cwd`, the notebook's folder (its box's workspace): by default a new empty one."""
        self.cwd = Path(cwd) if cwd is not None else Path(tempfile.mkdtemp(prefix="tkbox-nb-folder-"))
        if cwd is None:  # removed with the client even by a test that ends its kernel itself and never calls stop()
            weakref.finalize(self, shutil.rmtree, str(self.cwd), True)
        self.km = KernelManager(kernel_name="tkbox")
        self.km.start_kernel(cwd=str(self.cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self._drop_extra_kernel_info_replies()

    def _drop_extra_kernel_info_replies(self):
        """wait_for_ready asks kernel_info again each second it waits and takes one reply: under load the others
        come later and would be read as the reply to a test's own request. Only kernel_info replies are dropped."""
        import queue
        while True:
            try:
                msg = self.kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                return
            assert msg["msg_type"] == "kernel_info_reply", msg["msg_type"]

    def run(self, code: str, stdin=None, timeout: float = 90):
        outs = []
        reply = self.kc.execute_interactive(
            code, timeout=timeout, allow_stdin=stdin is not None, stdin_hook=stdin,
            output_hook=lambda m: outs.append((m["msg_type"], m["content"])) if m["msg_type"] != "status" else None)
        return reply["content"], outs

    def stop(self):
        if self.km.has_kernel:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        if self.cwd.name.startswith("tkbox-nb-folder-"):
            shutil.rmtree(self.cwd, ignore_errors=True)


@pytest.fixture
def client(kernel_env):
    c = Client()
    yield c
    c.stop()


def only_bundle(bundles: Path) -> Path:
    found = sorted(bundles.glob("*.tkb"))
    assert len(found) == 1, found
    return found[0]


def test_kernelspec_is_listed_with_its_display_name_and_logos(kernel_env):
    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec("tkbox")
    # the checkout's own: once kernels/tkbox pointed at a folder the layers' move left empty, and the tests started
    # whichever tkbox kernel was installed elsewhere (another checkout's code), passing or failing for it
    assert Path(spec.resource_dir).resolve() == (ROOT / "tkbox_nb/jupyter/kernel/spec").resolve(), spec.resource_dir
    assert spec.argv[0] == "python"  # jupyter_client runs it with the tests' own interpreter
    assert spec.display_name == "Python 3 (Tracekit Box)" and spec.interrupt_mode == "message"
    assert {"logo-32x32.png", "logo-64x64.png", "logo-svg.svg"} <= {p.name for p in Path(spec.resource_dir).iterdir()}


def test_streams_rich_display_results_and_errors_reach_the_frontend(client):
    reply, outs = client.run("import socket\nprint('inside')\nsorted(n for _, n in socket.if_nameindex())")
    assert reply["status"] == "ok"
    assert ("stream", {"name": "stdout", "text": "inside\n"}) in outs
    assert any(t == "execute_result" and c["data"]["text/plain"] == "['lo']" for t, c in outs)
    reply, outs = client.run("import pandas as pd\nfrom IPython.display import display, HTML\n"
                             "display(HTML('<b>bold</b>'))\npd.DataFrame({'a': [1, 2]})")
    kinds = [(t, sorted(c.get("data", {}))) for t, c in outs if t in ("display_data", "execute_result")]
    assert kinds[0] == ("display_data", ["text/html", "text/plain"])
    assert kinds[1][0] == "execute_result" and "text/html" in kinds[1][1]
    reply, outs = client.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert any(t == "display_data" and "image/png" in c["data"] for t, c in outs), outs
    reply, outs = client.run("h = display('first', display_id=True)\nh.update('second')")
    assert [t for t, _ in outs if t.endswith("display_data")] == ["display_data", "update_display_data"]
    reply, outs = client.run("1 / 0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    assert any(t == "error" and "ZeroDivisionError" in "".join(c["traceback"]) for t, c in outs)


def test_javascript_from_the_box_never_reaches_the_frontend(client):
    reply, outs = client.run("from IPython.display import Javascript, display\n"
                             "display(Javascript('alert(1)'))\nget_ipython().set_next_input('%box_restart')")
    assert reply["status"] == "ok" and reply["payload"] == []
    assert not any("application/javascript" in c.get("data", {}) for _, c in outs)


SCRIPTED_OUTPUTS = """\
from IPython.display import HTML, SVG, Markdown, display, publish_display_data
import pandas as pd
display(HTML('<img src=x onerror="alert(1)"><script>alert(2)</script><b>kept</b>'))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" onload="alert(3)"><circle r="5"/></svg>'))
display(Markdown('[click](javascript:alert(4))'))
display(Markdown('*fine* <img src=y onerror="alert(5)">'))
publish_display_data({'text/plain': 'p', 'TEXT/HTML': '<iframe src="/lab"></iframe><i>case</i>',
                      'application/vnd.evil+json': {}})
h = display(HTML('<b>first</b>'), display_id=True)
h.update(HTML('<img src=z onerror="alert(6)">second'))
pd.DataFrame({'a': [1, 2]})
"""


def test_script_in_html_svg_and_markdown_from_the_box_never_reaches_the_frontend(client, kernel_env):
    reply, outs = client.run(SCRIPTED_OUTPUTS)
    assert reply["status"] == "ok", reply
    bundles = [c["data"] for t, c in outs if t in ("display_data", "update_display_data", "execute_result")]
    allowed = {"text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg", "image/gif",
               "image/webp", "image/bmp", "application/json", "application/vnd.jupyter.widget-view+json"}
    assert bundles and all(set(b) <= allowed for b in bundles), bundles
    rendered = " ".join(str(b.get(k, "")) for b in bundles for k in ("text/html", "text/markdown")).lower()
    for bad in ("onerror", "<script", "<svg", "onload", "javascript:", "<iframe", "alert("):
        assert bad not in rendered, bad
    assert "<b>kept</b>" in rendered and "<i>case</i>" in rendered and "second" in rendered and "*fine*" in rendered
    table = [c["data"]["text/html"] for t, c in outs if t == "execute_result"]
    assert len(table) == 1 and '<table border="1" class="dataframe">' in table[0] and "<td>2</td>" in table[0]
    client.stop()
    cell = [x for x in open_run(only_bundle(kernel_env)).crossings() if x.door == "exec"][-1]
    named = " ".join(cell.result["dropped"])
    for what in ("display_data.data:image/svg+xml",
                 "display_data.data:text/markdown (a script URL or a remote image)",
                 "display_data.data:TEXT/HTML (sanitised)", "display_data.data:application/vnd.evil+json",
                 "update_display_data.data:text/html (sanitised)", "execute_result.data:text/html (sanitised)"):
        assert what in named, (what, named)


WIDGETS_WITH_MARKUP = """\
import ipywidgets as w
from IPython.display import HTML, display
h = w.HTML(value='<img src=x onerror="alert(1)"><b>bold</b>')
t = w.Text(value='<script>x</script>')
s = w.IntSlider(value=1, description='<img src=y onerror="alert(2)">', description_allow_html=True)
o = w.Output()
display(h, t, s, o)
o.append_display_data(HTML('<script>alert(3)</script><i>inside</i>'))  # carried in the widget's `outputs` state
h.value = '<svg onload="alert(4)"></svg><u>later</u>'
i = w.Image(value=b'\\x89PNG', format='png')
u = w.Image(value=b'https://evil.example/x', format='url')  # the view would load it as a URL, with no click
display(i, u)
t._view_name = 'HTMLView'  # the Text's value was never sanitised as HTML: refused
"""


def test_widget_state_from_the_box_is_sanitised_and_widgets_still_work(client):
    msg_id = client.kc.execute(WIDGETS_WITH_MARKUP)
    msgs = _iopub_until_idle(client, msg_id)
    states: dict[str, list[dict]] = {}
    for m in msgs:
        if m["msg_type"] in ("comm_open", "comm_msg") and isinstance(m["content"]["data"].get("state"), dict):
            states.setdefault(m["content"]["comm_id"], []).append(m["content"]["data"]["state"])
    by_model = {st[0].get("_model_name"): (cid, st) for cid, st in states.items() if "_model_name" in st[0]}
    _, html_states = by_model["HTMLModel"]
    values = [st["value"] for st in html_states if "value" in st]
    assert values[0] == '<img src="x"><b>bold</b>' and values[-1] == "<u>later</u>", values
    assert by_model["TextModel"][1][0]["value"] == "<script>x</script>"  # a Text widget shows text, untouched
    slider_id, slider = by_model["IntSliderModel"]
    assert all(st.get("description_allow_html", False) is False for st in slider)
    outputs = [o for st in by_model["OutputModel"][1] for o in st.get("outputs", [])]
    shown = " ".join(str(o.get("data", {}).get("text/html", "")) for o in outputs)
    assert "<i>inside</i>" in shown and "<script" not in shown and "alert" not in shown
    assert all(st.get("_view_name") != "HTMLView" for st in by_model["TextModel"][1])
    images = [m for m in msgs if m["msg_type"] == "comm_open"
              and m["content"]["data"].get("state", {}).get("_model_name") == "ImageModel"]
    assert sorted(str(m["content"]["data"]["state"].get("format")) for m in images) == ["None", "png"]
    png = next(m for m in images if m["content"]["data"]["state"].get("format") == "png")
    assert [bytes(b) for b in png["buffers"]] == [b"\x89PNG"]  # a media widget's bytes still pass
    # the slider still works both ways
    client.kc.shell_channel.send(client.kc.session.msg("comm_msg", {"comm_id": slider_id, "data": {
        "method": "update", "state": {"value": 9}, "buffer_paths": []}}))
    time.sleep(1)
    reply, outs = client.run("s.value")
    assert any(t == "execute_result" and c["data"]["text/plain"] == "9" for t, c in outs)


def test_an_output_widget_of_the_box_never_names_a_host_request_and_no_link_reaches_the_frontend(client, kernel_env):
    """jupyter_client's msg_ids are sequential (`SESSION_PID_N`): a box cell can name the next request's, a host-magic
    cell's, as an Output widget's msg_id, and the frontend would capture that cell's outputs into the widget and sync
    them back into the box. Only a request of the box's passes (its own cell's, as `with out:` sets); a jsdlink's
    comm_open never reaches the frontend; the refusals are named in the cell's signed result."""
    msg_id = client.kc.execute(
        "import ipywidgets as w\n"
        "mine = get_ipython().kernel.get_parent()['header']['msg_id']\n"
        "head, _, n = mine.rpartition('_')\n"  # the box sees only the host's ids now (I15): guess as it can
        "o = w.Output(msg_id=f'{head}_{int(n) + 1}' if n.isdigit() else mine + '_1')\n"
        "p = w.Output(msg_id=mine)\n"
        "t = w.Text(value='x')\n"
        "link = w.jsdlink((t, 'value'), (o, 'msg_id'))\n"
        "display(o, p, t)")
    msgs = _iopub_until_idle(client, msg_id)
    states = [m["content"]["data"]["state"] for m in msgs if m["msg_type"] == "comm_open"]
    assert sorted(st.get("msg_id") for st in states if st.get("_model_name") == "OutputModel") == ["", msg_id]
    assert [st["_model_name"] for st in states if "Link" in st.get("_model_name", "")] == []
    assert any(st.get("_model_name") == "TextModel" for st in states)
    client.stop()
    cell = [x for x in open_run(only_bundle(kernel_env)).crossings() if x.door == "exec"][-1]
    named = " ".join(cell.result["dropped"])
    assert "comm_open (a link between widgets)" in named and "msg_id (no request of the box's)" in named, named


def test_a_box_prompt_cannot_pass_for_the_host_s_password_prompt(client):
    prompts = []

    def answer(msg):
        prompts.append((msg["content"]["prompt"], msg["content"]["password"]))
        client.kc.input("typed")

    reply, _ = client.run("import getpass\nv = getpass.getpass('value of API_KEY (stays on the host): ')\n"
                          "w = input('ok\\nvalue of API_KEY (stays on the host): ')", stdin=answer)
    assert reply["status"] == "ok"
    assert prompts == [("[box] value of API_KEY (stays on the host): ", True),
                       ("[box] ok\n[box] value of API_KEY (stays on the host): ", False)]


def test_a_comm_message_from_the_box_naming_a_comm_it_does_not_hold_is_refused_and_signed(client, kernel_env):
    msg_id = client.kc.execute(
        "k = get_ipython().kernel\n"
        "for t in ('comm_msg', 'comm_close'):\n"
        "    k.session.send(k.iopub_socket, t, {'comm_id': 'e' * 32, 'data': {'method': 'update', 'state': {}}},\n"
        "                   parent=k.get_parent('shell'))\n"
        "from comm import create_comm\nc = create_comm(target_name='tkbox.test', data={})\nc.send({'x': 1})")
    msgs = _iopub_until_idle(client, msg_id)
    comms = [(m["msg_type"], m["content"]["comm_id"]) for m in msgs if m["msg_type"].startswith("comm_")]
    assert [t for t, _ in comms] == ["comm_open", "comm_msg"] and "e" * 32 not in {c for _, c in comms}
    reply, _ = client.run("1")  # the box goes on
    assert reply["status"] == "ok"
    client.stop()
    run = open_run(only_bundle(kernel_env))
    faults = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "comm_fault"]
    assert [(f.decision, f.args["msg_type"], f.args["comm_id"], f.args["from"]) for f in faults] == [
        ("deny", "comm_msg", "e" * 32, "box"), ("deny", "comm_close", "e" * 32, "box")]
    assert verify_bundle(only_bundle(kernel_env)).valid


def test_a_box_spamming_comm_faults_gets_its_first_signed_and_the_rest_counted(client, kernel_env):
    reply, _ = client.run(
        "k = get_ipython().kernel\n"
        "for i in range(100):\n"
        "    k.session.send(k.iopub_socket, 'comm_msg', {'comm_id': f'{i:032x}', 'data': {}},\n"
        "                   parent=k.get_parent('shell'))")
    assert reply["status"] == "ok"
    client.stop()  # no further cell: the count is signed as the kernel stops the box
    run = open_run(only_bundle(kernel_env))
    faults = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "comm_fault"]
    assert len(faults) == MAX_SIGNED + 1 and faults[0].args["comm_id"] == "0" * 32
    assert (faults[-1].args["from"], faults[-1].args["fault"]) == ("box", f"{100 - MAX_SIGNED} more, not each signed")
    assert verify_bundle(only_bundle(kernel_env)).valid


def test_a_frontend_comm_message_before_the_first_cell_is_refused_and_signed(kernel_env):
    c = Client()
    try:
        stray = c.kc.session.msg("comm_msg", {"comm_id": "a" * 32, "data": {}})
        c.kc.shell_channel.send(stray)  # the box is still starting: no run is open yet
        time.sleep(0.5)
        reply, outs = c.run("print('first')")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "first\n"}) in outs
    finally:
        c.stop()
    run = open_run(only_bundle(kernel_env))
    exec_ = [x for x in run.crossings() if x.door == "exec"]
    assert [(x.decision, x.args.get("kind"), x.args.get("from"), x.args.get("comm_id")) for x in exec_][0] == \
        ("deny", "comm_fault", "frontend", "a" * 32)
    assert verify_bundle(only_bundle(kernel_env)).valid


def check_input_and_getpass(client: Client) -> None:
    """A cell reads a line and a password from the frontend: each prompt reaches it as an input_request."""
    prompts = []

    def answer(msg):
        prompts.append((msg["content"]["prompt"], msg["content"]["password"]))
        client.kc.input("typed" if not msg["content"]["password"] else "hidden")

    reply, outs = client.run("import getpass\na = input('name? ')\nb = getpass.getpass('pw? ')\nprint(a, b)",
                             stdin=answer)
    assert reply["status"] == "ok" and prompts == [("[box] name? ", False), ("[box] pw? ", True)]
    assert ("stream", {"name": "stdout", "text": "typed hidden\n"}) in outs


def test_input_and_getpass_go_through_stdin(client):
    check_input_and_getpass(client)


def test_interrupt_stops_the_cell_and_the_box_survives(client):
    client.run("x = 41")
    msg_id = client.kc.execute("import time; time.sleep(60)")
    time.sleep(2)
    t = time.monotonic()
    client.km.interrupt_kernel()
    reply = client.kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - t < 10
    reply, outs = client.run("x + 1")
    assert any(t == "execute_result" and c["data"]["text/plain"] == "42" for t, c in outs), (reply, outs)


def test_completion_inspection_and_is_complete_come_from_the_box(client):
    client.run("box_only_name = 123")
    client.kc.complete("box_only_", 9)
    assert "box_only_name" in client.kc.get_shell_msg(timeout=30)["content"]["matches"]
    client.kc.inspect("box_only_name", 13)
    reply = client.kc.get_shell_msg(timeout=30)["content"]
    assert reply["found"] and "int" in reply["data"]["text/plain"]
    client.kc.is_complete("for i in x:")
    assert client.kc.get_shell_msg(timeout=30)["content"]["status"] == "incomplete"


def test_widget_comm_round_trip(client):
    reply, outs = client.run("import ipywidgets as w\ns = w.IntSlider(value=1)\ndisplay(s)")
    assert reply["status"] == "ok"
    opens = [c for t, c in outs if t == "comm_open" and c["data"]["state"].get("_model_name") == "IntSliderModel"]
    assert opens, [t for t, _ in outs]
    comm_id = opens[0]["comm_id"]
    msg = client.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "method": "update", "state": {"value": 7}, "buffer_paths": []}})
    client.kc.shell_channel.send(msg)
    time.sleep(1)
    reply, outs = client.run("s.value")
    assert any(t == "execute_result" and c["data"]["text/plain"] == "7" for t, c in outs)


def test_restart_gives_a_new_box_and_writes_the_old_bundle(client, kernel_env):
    client.run("y = 1")
    client.km.restart_kernel(now=False)
    client.kc.wait_for_ready(timeout=60)
    old = only_bundle(kernel_env)
    assert verify_bundle(old).valid
    reply, outs = client.run("'y' in globals()")
    assert any(t == "execute_result" and c["data"]["text/plain"] == "False" for t, c in outs)


def test_bundle_holds_one_signed_exec_decision_per_cell_and_verifies(kernel_env):
    c = Client()
    cells = ["a = 1", "print(a)", "%box_status", "a + 1"]
    for code in cells:
        c.run(code)
    c.stop()
    bundle = only_bundle(kernel_env)
    report = verify_bundle(bundle)
    assert report.valid, report.summary()
    run = open_run(bundle)
    exec_cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    assert [run.content(x.args["code"]).decode() for x in exec_cells] == ["a = 1", "print(a)", "a + 1"]
    assert all(x.decision == "allow" and x.result["status"] == "ok" for x in exec_cells)
    host = [x for x in run.crossings() if x.door == "host"]
    assert [x.args["magic"] for x in host] == ["box_status"]


def test_user_expressions_are_evaluated_decided_with_their_cell_and_signed(client, kernel_env, tmp_path):
    """As in a plain ipykernel, each user expression is evaluated after its cell and answered {status, data,
    metadata} or as an error; it is code the box runs, so it is decided with the cell's code (the decision commits to
    it) and its result is signed in the cell's end. Past the limits, or in a cell of host magics only, nothing is
    evaluated; a cell asked no expression is stated as before (no `user_expressions` in its decision)."""
    kc = client.kc
    client.run("a = 21")
    mid = kc.execute("b = a * 2", user_expressions={"v": "b", "e": "1/0", "s": "str(b) + '!'"})
    reply = _shell_reply(kc, mid)
    assert reply["status"] == "ok", reply
    exprs = reply["user_expressions"]
    assert exprs["v"] == {"status": "ok", "data": {"text/plain": "42"}, "metadata": {}}
    assert exprs["s"]["data"] == {"text/plain": "'42!'"}
    assert exprs["e"]["status"] == "error" and exprs["e"]["ename"] == "ZeroDivisionError"
    # as ipykernel: a cell that fails evaluates none
    reply = _shell_reply(kc, kc.execute("1/0", user_expressions={"v": "b"}))
    assert reply["status"] == "error" and reply["user_expressions"] == {}, reply
    # over the limits: one error line, and nothing of the request runs (not its code, not its expressions)
    side = "__import__('pathlib').Path('/workspace/proof').write_text('ran')"
    for asked in ({f"k{i}": "1" for i in range(65)}, {"long": "1 + " * 2000 + "1"}):
        mid = kc.execute(side, user_expressions=asked)
        reply = _shell_reply(kc, mid)
        assert reply["status"] == "error" and reply["ename"] == "UserExpressionsRefused", reply
        assert "\n" not in reply["evalue"] and ("at most 64" in reply["evalue"] or "4096" in reply["evalue"])
    # a cell of host magics only evaluates nothing in the box
    mid = kc.execute("%box_status", user_expressions={"x": side})
    reply = _shell_reply(kc, mid)
    assert reply["status"] == "ok" and reply["user_expressions"]["x"]["ename"] == "NotEvaluated"
    reply, outs = client.run("import os\nprint(os.path.exists('/workspace/proof'), b)")
    assert ("stream", {"name": "stdout", "text": "False 42\n"}) in outs, outs
    client.stop()
    bundle = only_bundle(kernel_env)
    report = verify_bundle(bundle)
    assert report.valid, report.summary()
    run = open_run(bundle)
    cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    assert [run.content(x.args["code"]) for x in cells] == [
        b"a = 21", b"b = a * 2", b"1/0", b"import os\nprint(os.path.exists('/workspace/proof'), b)"]  # all that ran
    assert "user_expressions" not in cells[0].args and "user_expressions" not in cells[0].result
    asked = json.loads(run.content(cells[1].args["user_expressions"]))
    assert asked == {"v": "b", "e": "1/0", "s": "str(b) + '!'"}
    answered = json.loads(run.content(cells[1].result["user_expressions"]))
    assert answered["v"] == exprs["v"] and answered["e"]["ename"] == "ZeroDivisionError"
    # the replayed notebook keeps them in the cell's metadata
    nb = run.to_notebook()
    meta = [c.metadata["tkbox"] for c in nb.cells if c.cell_type == "code"][1]
    assert meta["user_expressions"] == asked and meta["user_expression_results"]["v"] == exprs["v"]


def _shell_reply(kc, msg_id: str, timeout: float = 90) -> dict:
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def test_host_policy_magic_takes_effect_and_refusals_show_in_the_notebook(client, kernel_env):
    reply, outs = client.run("%%box_policy\n[exec]\ncells = false\n")
    assert reply["status"] == "ok" and "the box starts with it" in outs[0][1]["text"]
    reply, outs = client.run("print('should not run')")
    assert reply["status"] == "error" and reply["ename"] == "DoorRefused"
    assert not any(t == "stream" and "should not run" in c["text"] for t, c in outs)
    # a refused cell sends nothing into the box, its user_expressions neither (they are decided with its code)
    mid = client.kc.execute("pass", user_expressions={"x": "open('/workspace/proof', 'w').write('ran')"})
    reply = _shell_reply(client.kc, mid)
    assert reply["status"] == "error" and reply["ename"] == "DoorRefused"
    reply, outs = client.run("%%box_policy\n[exec]\ncells = true\n")
    assert "in force for every crossing from now" in outs[0][1]["text"]
    reply, outs = client.run("import os; print('runs', os.path.exists('/workspace/proof'))")
    assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "runs False\n"}) in outs, outs
    client.stop()
    run = open_run(only_bundle(kernel_env))
    cells = [(x.decision, x.args["rule"]) for x in run.crossings() if x.door == "exec"]
    assert cells == [("deny", "exec.cells"), ("deny", "exec.cells"), ("allow", "exec.cells")]
    refused = [x for x in run.crossings() if x.door == "exec"][1]
    assert b"/workspace/proof" in run.content(refused.args["user_expressions"])  # what was refused, signed
    assert [x.args["magic"] for x in run.crossings() if x.door == "host"] == ["box_policy", "box_policy"]
    assert verify_bundle(only_bundle(kernel_env)).valid


def test_secret_value_never_reaches_the_notebook_the_box_or_the_bundle(client, kernel_env):
    value = "sk-test-" + os.urandom(8).hex()

    def answer(msg):  # the host's own prompt: never the box's mark
        assert msg["content"] == {"prompt": "value of API_KEY (stays on the host): ", "password": True}
        client.kc.input(value)

    reply, outs = client.run("%box_secret API_KEY --host api.example.org --header Authorization "
                             "--format 'Bearer {value}'", stdin=answer)
    assert reply["status"] == "ok", reply
    assert value not in repr(outs)
    reply, outs = client.run("import os\nprint(value_seen := [k for k, v in os.environ.items() if "
                             f"{value!r} in v])")
    assert ("stream", {"name": "stdout", "text": "[]\n"}) in outs
    client.stop()
    data = only_bundle(kernel_env).read_bytes()
    import zipfile, io  # noqa: E401
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert not any(value.encode() in z.read(n) for n in z.namelist())
    run = open_run(only_bundle(kernel_env))
    assert [x.args["magic"] for x in run.crossings() if x.door == "host"] == ["box_secret"]


def test_malformed_message_from_the_box_ends_the_box_and_the_kernel_stays_up(client, kernel_env):
    client.run("z = 1")
    reply, outs = client.run("k = get_ipython().kernel\n"
                             "k.session.send(k.iopub_socket, 'stream', {'name': 'bogus', 'text': 5}, "
                             "parent=k.get_parent('shell'))\nimport time; time.sleep(5)")
    assert reply["status"] == "error" and reply["ename"] == "BoxEnded"
    assert any(t == "display_data" and NOTICE_MIME in c["data"] and "protocol violation" in c["data"]["text/plain"]
               for t, c in outs)  # the host's notice, with its mark (relay.host_notice)
    reply, outs = client.run("'z' in globals()")  # a fresh box, a new run
    assert reply["status"] == "ok"
    assert any(t == "execute_result" and c["data"]["text/plain"] == "False" for t, c in outs)
    ended = only_bundle(kernel_env)
    assert "protocol violation" in open_run(ended).box["end_reason"]
    assert verify_bundle(ended).valid


def test_nbclient_executes_a_notebook_with_this_kernel(kernel_env, tmp_path):
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "tkbox", "display_name": "Python 3 (Tracekit Box)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("%box_status"), nbformat.v4.new_code_cell("n = 5\nn * 2"),
                nbformat.v4.new_code_cell("print('done')"), nbformat.v4.new_code_cell("%box_view")]
    folder = tmp_path / "folder"
    folder.mkdir()
    NotebookClient(nb, timeout=120, kernel_name="tkbox", resources={"metadata": {"path": str(folder)}}).execute()
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "10"
    assert nb.cells[2].outputs[0]["text"] == "done\n"
    view = nb.cells[3].outputs[0]  # the static view of the run so far: this host kernel has no widgets
    assert "tkbox-summary" in view["data"]["text/html"] and "OPEN" in view["data"]["text/html"]
    assert "bwrap" in nb.cells[0].outputs[0]["text"] or "not started" in nb.cells[0].outputs[0]["text"]
    assert verify_bundle(only_bundle(kernel_env)).valid


def test_a_killed_kernel_s_run_is_recovered_by_the_next_box(kernel_env, tmp_path):
    from tkbox_nb import Box
    c = Client()
    process = c.km.provisioner.process
    try:
        c.run("a = 1")
    finally:
        c.kc.stop_channels()
        os.kill(process.pid, 9)  # SIGKILL: no shutdown request, no bundle (and nothing left running if run failed)
        process.wait()
    assert not list(kernel_env.glob("*.tkb"))
    with Box(backend="bwrap", bundle_path=tmp_path / "next.tkb"):
        pass
    recovered = only_bundle(kernel_env)
    assert verify_bundle(recovered).valid
    run = open_run(recovered)
    assert run.sealed and run.box["end_reason"].startswith("recovered")
    cells = [x for x in run.crossings() if x.door == "exec"]
    assert run.content(cells[0].args["code"]) == b"a = 1"


def test_a_kernel_shut_down_by_its_frontend_writes_its_bundle_within_the_frontend_s_wait(kernel_env):
    """jupyter_client's shutdown_kernel(now=False) kills a kernel that has not exited within its wait: the kernel
    stops its box and writes the bundle before it answers and exits, within that wait."""
    c = Client()
    c.run("a = 1")
    c.kc.stop_channels()
    t = time.monotonic()
    c.km.shutdown_kernel(now=False)
    assert time.monotonic() - t < c.km.shutdown_wait_time  # it exited by itself, not killed
    bundle = only_bundle(kernel_env)
    assert verify_bundle(bundle).valid
    assert open_run(bundle).box["end_reason"] == "kernel shutdown"


def test_a_kernel_killed_after_closing_its_run_has_its_bundle_written_by_recovery(kernel_env, signer):
    """A kernel killed by its frontend after its run was closed but before the bundle was written (the export waits
    for the signer's checkpoint) left a run with no .tkb that recovery did not see (issue 34): `tkbox signer recover`
    now writes it where it was meant to go, and it verifies with the kernel's own end reason."""
    before = set(signer.runs_dir.iterdir())  # a spool of a dead holder whose pid this kernel now has is not its
    c = Client()
    pid = c.km.provisioner.process.pid
    c.run("a = 1")
    spools = [s for s in set(signer.runs_dir.iterdir()) - before
              if (s / "handle.json").exists() and json.loads((s / "handle.json").read_text())["pid"] == pid]
    assert len(spools) == 1
    c.kc.shutdown()  # the shutdown request; then the frontend's kill, once the run is closed
    deadline = time.monotonic() + 60
    while (spools[0] / "handle.json").exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(pid, 9)
    c.km.provisioner.process.wait()
    c.kc.stop_channels()
    assert not list(kernel_env.glob("*.tkb"))  # the export was still waiting for a checkpoint
    r = run_cli("signer", "recover")
    bundled = re.search(r"(\d+) orphaned run\(s\) bundled", r.stdout)  # ours, and any an earlier test left
    assert r.returncode == 0 and bundled and int(bundled.group(1)) >= 1, r.stdout + r.stderr
    bundle = only_bundle(kernel_env)
    assert verify_bundle(bundle).valid
    run = open_run(bundle)
    assert run.sealed and run.box["end_reason"] == "kernel shutdown"
    assert run.content([x for x in run.crossings() if x.door == "exec"][0].args["code"]) == b"a = 1"


def test_the_box_starts_with_the_kernel_and_the_first_cell_takes_it(kernel_env):
    import datetime
    c = Client()
    time.sleep(3)  # the frontend idles: the box and its kernel start meanwhile
    before = datetime.datetime.now(datetime.timezone.utc)
    reply, outs = c.run("print('first')")
    assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "first\n"}) in outs
    c.stop()
    run = open_run(only_bundle(kernel_env))  # the early box is the notebook's box: one run, in the bundle folder
    assert verify_bundle(run.path).valid
    crossings = run.crossings()
    assert crossings[0].door == "box"
    assert datetime.datetime.fromisoformat(crossings[0].time.replace("Z", "+00:00")) < before


def test_box_restart_starts_the_next_box_in_the_background(kernel_env):
    import datetime
    c = Client()
    try:
        c.run("a = 1")
        reply, outs = c.run("%box_restart")
        text = "".join(x.get("text", "") for t, x in outs if t == "stream")
        assert reply["status"] == "ok" and "starting in the background" in text
        time.sleep(3)  # the frontend idles: the next box and its kernel start meanwhile
        before = datetime.datetime.now(datetime.timezone.utc)
        reply, outs = c.run("print(globals().get('a'))")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "None\n"}) in outs
    finally:
        c.stop()
    runs = [open_run(b) for b in sorted(kernel_env.glob("*.tkb"))]
    assert len(runs) == 2 and all(verify_bundle(r.path).valid for r in runs)
    second = next(r for r in runs if any(x.door == "host" for x in r.crossings()))  # %box_restart is recorded there
    assert datetime.datetime.fromisoformat(second.crossings()[0].time.replace("Z", "+00:00")) < before


def machine_policy(tmp_path, monkeypatch, toml: str, name: str = "machine.toml") -> Path:
    """The machine's policy (TKBOX_POLICY, read by each kernel started after this): `toml`, written as `name`."""
    policy = tmp_path / name
    policy.write_text(toml)
    monkeypatch.setenv("TKBOX_POLICY", str(policy))
    return policy


def refused_until_a_policy_cell(c: Client, policy_cell: str, code: str = "print('now')", prints: str = "now\n") -> str:
    """The kernel's first cell fails, printing nothing of its own; after `policy_cell` (a %%box_policy the machine
    can run) `code` runs in a box that starts then and prints `prints`. Returns the first cell's error line."""
    reply, outs = c.run("print('never')")
    assert reply["status"] == "error", reply
    assert not any(t == "stream" and "never" in x.get("text", "") for t, x in outs)
    refused = reply["evalue"]
    c.run(policy_cell)
    reply, outs = c.run(code)
    assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": prints}) in outs, (reply, outs)
    return refused


def _machine_policy_that_cannot_start(tmp_path, monkeypatch) -> None:
    """The machine's policy (TKBOX_POLICY) names Firecracker, which has no guest image here: its early box fails."""
    machine_policy(tmp_path, monkeypatch, '[box]\nbackend = "firecracker"\n', "fc.toml")


def test_an_early_box_that_cannot_start_says_why_on_the_first_cell(kernel_env, tmp_path, monkeypatch):
    _machine_policy_that_cannot_start(tmp_path, monkeypatch)
    c = Client()
    try:  # then a policy the machine can run: the next box starts
        assert "guest image" in refused_until_a_policy_cell(c, "%%box_policy\n[exec]\ncells = true\n")
    finally:
        c.stop()


def test_a_policy_set_before_the_first_cell_replaces_an_early_box_that_failed_under_the_old_one(kernel_env, tmp_path,
                                                                                              monkeypatch):
    """The early box starts under the machine's policy and fails; the notebook's first cell sets a policy the machine
    can run, so the next code cell starts a box under it, rather than reporting the failure of a start nobody now
    asks for."""
    _machine_policy_that_cannot_start(tmp_path, monkeypatch)
    c = Client()
    try:
        reply, _ = c.run("%%box_policy\n[exec]\ncells = true\n")
        assert reply["status"] == "ok", reply
        reply, outs = c.run("print('now')")
        assert reply["status"] == "ok", reply
        assert ("stream", {"name": "stdout", "text": "now\n"}) in outs
    finally:
        c.stop()


def _iopub_until_idle(c: Client, msg_id: str, timeout: float = 60) -> list[dict]:
    msgs = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = c.kc.get_iopub_msg(timeout=timeout)
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return msgs
        msgs.append(m)
    raise AssertionError("no idle")


def test_box_view_is_the_live_widget_view_and_its_comms_stay_on_the_host(client, kernel_env):
    client.run("x = 1")
    msg_id = client.kc.execute("%box_view")
    msgs = _iopub_until_idle(client, msg_id)
    opened = {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in msgs if m["msg_type"] == "comm_open"}
    shown = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"]
    assert len(shown) == 1 and "text/html" in shown[0]
    assert shown[0]["application/vnd.jupyter.widget-view+json"]["model_id"] in opened
    verify = next(cid for cid, st in opened.items() if st.get("_model_name") == "ButtonModel"
                  and st.get("description") == "Verify")
    # the frontend clicks Verify: handled on the host, the verdict comes back as widget updates
    click = client.kc.session.msg("comm_msg", {"comm_id": verify, "data": {"method": "custom",
                                                                           "content": {"event": "click"}}})
    client.kc.shell_channel.send(click)
    verdict, deadline = None, time.monotonic() + 60
    while verdict is None and time.monotonic() < deadline:
        m = client.kc.get_iopub_msg(timeout=60)
        value = m["content"].get("data", {}).get("state", {}).get("value") if m["msg_type"] == "comm_msg" else None
        if isinstance(value, str) and "tkbox-verdict" in value:
            verdict = value
    assert verdict is not None and "VALID" in verdict
    # a frontend message naming a comm neither side holds is refused and signed; the box cannot reach a host comm
    stray = client.kc.session.msg("comm_msg", {"comm_id": "f" * 32, "data": {}})
    client.kc.shell_channel.send(stray)
    client.run(f"from comm import create_comm\nc = create_comm(comm_id={verify!r}, target_name='x')\n"
               "import time; time.sleep(2)")  # the cell's reply may pass before the host sees its comm_open
    reply, outs = client.run("print('a new box')")  # the box that named a host comm was ended
    assert reply["status"] == "ok"
    client.stop()
    first, second = sorted(kernel_env.glob("*.tkb"))
    run = open_run(first)
    faults = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "comm_fault"]
    assert [(f.decision, f.args["fault"]) for f in faults] == [("deny", "a comm the box does not hold")]
    assert "names a host comm" in run.box["end_reason"] and verify_bundle(first).valid
    assert "names a host comm" in run.crossings()[-1].args["reason"]


# -- a box whose start stalls: the kernel answers the frontend meanwhile; the first cell waits, then runs or says why --
class Standin:
    """A stand-in signer the test owns: it accepts connections (on a Unix socket, or on TCP for a central signer's
    URL) and never answers. An environment condition, not a mock: the kernel's real signer client meets it."""

    def __init__(self, family: int, address):
        import socket
        import threading
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(16)
        self.address = self.sock.getsockname()
        self.held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        import socket
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.held:
            c.close()


def _descendants(pid: int) -> set[int]:
    """The live processes under `pid` (zombies are not live), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _in_session(sid: int, keep: set[int] = frozenset()) -> list[int]:
    """The live processes (zombies are not) of session `sid`: jupyter_client starts a kernel as a session leader, and
    its boxes stay in its session (the machine signer starts in a session of its own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in keep:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z" and int(fields[4]) == sid:
                    out.append(int(d.name))
    return out


def _answered_while_stalled(c: Client, stall_s: float) -> None:
    """What the host answers itself, without the box: kernel_info (already, by wait_for_ready), is_complete,
    comm_info and a host magic, each well before the stalled start could end."""
    t = time.monotonic()
    c.kc.kernel_info()
    assert c.kc.get_shell_msg(timeout=stall_s)["content"]["implementation"] == "tkbox-nb"
    c.kc.is_complete("for i in x:")
    assert c.kc.get_shell_msg(timeout=stall_s)["content"]["status"] == "unknown"  # no box yet to ask
    c.kc.comm_info()
    assert c.kc.get_shell_msg(timeout=stall_s)["content"] == {"status": "ok", "comms": {}}
    reply, outs = c.run("%box_status", timeout=stall_s)
    assert reply["status"] == "ok" and "not started" in outs[0][1]["text"]
    assert time.monotonic() - t < 3, "the host's own answers waited for the box"


def _interrupt_the_waiting_cell(c: Client, msg_id: str) -> None:
    """While cell `msg_id` waits for its stalled box: the control channel answers kernel_info (as JupyterLab asks
    it there), and an interrupt ends the cell at once, with a reply saying it did not run."""
    t = time.monotonic()
    c.kc.control_channel.send(c.kc.session.msg("kernel_info_request"))
    assert c.kc.get_control_msg(timeout=3)["content"]["implementation"] == "tkbox-nb"
    c.km.interrupt_kernel()
    reply = c.kc.get_shell_msg(timeout=3)
    assert time.monotonic() - t < 3  # well before the stalled start ends (three status calls of 2 s)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert "did not run" in reply["content"]["evalue"]


def _shut_down_leaving_nothing(c: Client, keep: set[int] = frozenset()) -> None:
    from tkbox_nb.core.processes import pid_alive
    kernel_pid = c.km.provisioner.process.pid
    under = _descendants(kernel_pid) - set(keep)
    c.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid_alive(p) for p in under | {kernel_pid}):
        time.sleep(0.1)
    assert not c.km.is_alive()
    assert not [p for p in under | {kernel_pid} if pid_alive(p)], "processes left behind"
    assert not _in_session(kernel_pid, keep), "processes left behind in the kernel's session"


@pytest.fixture
def stalled_home(kernel_env, monkeypatch):
    """A TKBOX_HOME of its own whose signer socket is a stand-in that never answers (its machine signer, once
    started by the kernel, stopped afterwards)."""
    import shutil
    import socket
    from tkbox_nb.signing.signer import MachineSigner
    home = Path(tempfile.mkdtemp(prefix="tks-", dir="/tmp"))  # short: a Unix socket path
    (home / "signer").mkdir(mode=0o700)
    standin = Standin(socket.AF_UNIX, str(home / "signer" / "signer.sock"))
    monkeypatch.setenv("TKBOX_HOME", str(home))
    try:
        yield home, standin
    finally:
        standin.close()
        MachineSigner(home).stop()
        shutil.rmtree(home, ignore_errors=True)


def test_a_stalled_signer_delays_only_the_first_cell_which_runs_once_it_is_replaced(stalled_home, kernel_env):
    """The signer the kernel is told to use (TKBOX_HOME) accepts but never answers. The frontend's kernel_info and
    the requests the host answers itself are answered at once; the first cell waits while the box's start asks the
    signer (2 s per try), the stalled signer is replaced by a fresh one (MachineSigner._start: never trusted), and the
    cell then runs in a box whose start is signed."""
    from tkbox_nb.signing.signer import MachineSigner
    home, standin = stalled_home
    t0 = time.monotonic()
    c = Client()
    try:
        assert time.monotonic() - t0 < 10  # the kernel started and answered kernel_info while its box stalls
        _answered_while_stalled(c, stall_s=4)
        reply, outs = c.run("print('first')", timeout=60)
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "first\n"}) in outs
        assert standin.held, "the kernel's box start never reached the stand-in signer"
        assert time.monotonic() - t0 > 4  # it did wait out the stand-in (three status calls of 2 s)
        signer_pid = MachineSigner(home).pid()
        assert signer_pid and MachineSigner(home).answering()
    finally:
        _shut_down_leaving_nothing(c, keep={MachineSigner(home).pid() or -1})
    run = open_run(only_bundle(kernel_env))
    assert verify_bundle(run.path).valid
    crossings = run.crossings()
    assert crossings[0].door == "box"  # the start, signed, before the cell's signed allow
    cells = [x for x in crossings if x.door == "exec" and x.args.get("kind") == "cell"]
    assert [(x.decision, run.content(x.args["code"])) for x in cells] == [("allow", b"print('first')")]


def test_an_interrupt_while_the_box_is_starting_ends_that_cell_and_later_cells_run(stalled_home, kernel_env):
    """While the first cell waits for the stalled box, the control channel is still answered (kernel_info there,
    as JupyterLab asks it); an interrupt ends the waiting cell at once, before it reaches the exec door, so it runs
    nothing and is not in the run; the next cell waits for the same box and runs in it."""
    from tkbox_nb.signing.signer import MachineSigner
    home, _ = stalled_home
    c = Client()
    try:
        msg_id = c.kc.execute("x = 41")
        time.sleep(0.5)
        _interrupt_the_waiting_cell(c, msg_id)
        reply, outs = c.run("print(globals().get('x'))", timeout=60)
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "None\n"}) in outs
    finally:
        _shut_down_leaving_nothing(c, keep={MachineSigner(home).pid() or -1})
    run = open_run(only_bundle(kernel_env))  # one box, one run: the interrupted cell never reached the exec door
    assert verify_bundle(run.path).valid
    cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    assert [run.content(x.args["code"]) for x in cells] == [b"print(globals().get('x'))"]


@pytest.mark.parametrize("early", ["1", "0"])
def test_a_shutdown_while_the_box_is_starting_ends_the_waiting_cell_and_closes_the_run(stalled_home, kernel_env,
                                                                                      monkeypatch, early):
    """A shutdown while the first cell waits for the stalled box (started with the kernel, or for the cell with
    TKBOX_EARLY_BOX=0): the kernel waits for the start to end, stops the unused box (its run closed and bundled, with
    no cell in it), ends the waiting cell, which ran nothing, and exits by itself, leaving no process behind."""
    from tkbox_nb.signing.signer import MachineSigner
    monkeypatch.setenv("TKBOX_EARLY_BOX", early)
    home, _ = stalled_home
    c = Client()
    kernel_pid = c.km.provisioner.process.pid
    try:
        msg_id = c.kc.execute("print('never')")
        time.sleep(0.5)
        c.kc.shutdown()  # on the control channel, as a frontend asks
        assert c.kc.get_control_msg(timeout=60)["msg_type"] == "shutdown_reply"
        reply = c.kc.get_shell_msg(timeout=10)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "BoxEnded" and "did not run" in reply["content"]["evalue"]
        assert c.km.provisioner.process.wait(timeout=30) == 0  # it exits by itself, not killed by the frontend
    finally:
        c.stop()
    assert not _in_session(kernel_pid, keep={MachineSigner(home).pid() or -1}), "processes left behind"
    assert not list(kernel_env.glob("*.tkb"))  # no cell took the early box: its bundle goes to the signer's home
    run = open_run(only_bundle(home / "bundles"))
    assert verify_bundle(run.path).valid and run.sealed and "not used" in run.box["end_reason"]
    assert not [x for x in run.crossings() if x.door == "exec"]


def test_a_central_signer_that_never_answers_fails_the_first_cell_closed_with_one_line(kernel_env, tmp_path,
                                                                                      monkeypatch):
    """The policy names a central signer that accepts TCP but never answers (not even TLS): the kernel answers the
    frontend meanwhile; the first cell waits for the signer's deadline (5 s), then fails closed, running nothing,
    with one line saying the signer did not answer; no run opens, no bundle is written."""
    import socket
    from tkbox_nb.rules.box_ca import BoxCA
    standin = Standin(socket.AF_INET, ("127.0.0.1", 0))
    (tmp_path / "ca.pem").write_bytes(BoxCA("test").trust_bundle())
    (tmp_path / "token").write_text("tk_nothing\n")
    (tmp_path / "store.dsn").write_text("host=/nonexistent\n")
    machine_policy(tmp_path, monkeypatch, f'[signer]\nurl = "https://127.0.0.1:{standin.address[1]}"\n'
                   f'token_file = "{tmp_path}/token"\nca = "{tmp_path}/ca.pem"\n'
                   f'store_dsn_file = "{tmp_path}/store.dsn"\n', "central.toml")
    home = tmp_path / "home"
    monkeypatch.setenv("TKBOX_HOME", str(home))
    t0 = time.monotonic()
    c = Client()
    try:
        assert time.monotonic() - t0 < 10
        _answered_while_stalled(c, stall_s=4)
        reply, outs = c.run("print('never')", timeout=60)
        assert reply["status"] == "error" and reply["ename"] == "SignerError", reply
        assert "does not answer" in reply["evalue"] and "\n" not in reply["evalue"], reply["evalue"]
        assert not any(t == "stream" and "never" in x.get("text", "") for t, x in outs)
        assert standin.held, "the box's start never reached the stand-in signer"
        reply, outs = c.run("print('still never')", timeout=60)  # the next cell tries again, and fails closed too
        assert reply["status"] == "error" and "does not answer" in reply["evalue"]
        assert not any(t == "stream" and "never" in x.get("text", "") for t, x in outs)
        msg_id = c.kc.execute("print('interrupted')")  # a retry can be interrupted while it waits for the signer
        time.sleep(0.5)
        t = time.monotonic()
        c.km.interrupt_kernel()
        reply = c.kc.get_shell_msg(timeout=3)
        assert time.monotonic() - t < 3 and reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        reply, outs = c.run("print('never either')", timeout=60)  # it takes that start's failure, said in one line
        assert reply["status"] == "error" and "does not answer" in reply["evalue"] and "\n" not in reply["evalue"]
        assert not any(t == "stream" and "never" in x.get("text", "") for t, x in outs)
    finally:
        _shut_down_leaving_nothing(c)
        standin.close()
    assert not list(kernel_env.glob("*.tkb"))
    assert not any((home / "central").rglob("*.tkb")) if (home / "central").exists() else True


def _statuses(c: Client, msg_id: str, timeout: float = 60) -> list[str]:
    """The iopub messages of one request, up to its idle and a moment after it (a late or second status would show),
    as msg_type, or `status:STATE`."""
    import queue
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            m = c.kc.get_iopub_msg(timeout=0.5 if out[-1:] == ["status:idle"] else timeout)
        except queue.Empty:
            break
        if m["parent_header"].get("msg_id") == msg_id:
            t = m["msg_type"]
            out.append(f"status:{m['content']['execution_state']}" if t == "status" else t)
    return out


def test_a_cell_is_busy_once_from_the_start_and_idle_once_at_its_end(client):
    """As with a plain ipykernel, each execute_request gets exactly one busy, first, and one idle, last, with its
    header as parent: the host publishes busy as it takes the cell and drops the box's kernel's own."""
    for code, inner in (("print(1)", ["execute_input", "stream"]),
                        ("%box_status\nprint(2)", ["stream", "execute_input", "stream"]),
                        ("%box_status", ["stream"]), ("1 / 0", ["execute_input", "error"])):
        msg_id = client.kc.execute(code)
        assert _statuses(client, msg_id) == ["status:busy", *inner, "status:idle"], code
        client.kc.get_shell_msg(timeout=30)


def test_an_interrupt_while_a_box_starts_for_the_cell_ends_that_cell_and_later_cells_run(stalled_home, kernel_env,
                                                                                        monkeypatch):
    """TKBOX_EARLY_BOX=0: no box starts with the kernel; the first cell starts one, in the background, against the
    stalled signer. The cell is busy at once; the control channel is answered while it waits; an interrupt ends it at
    once, with one busy and one idle, before it reaches the exec door; the next cell waits for the same start and runs
    in that box, the only cell in its run."""
    from tkbox_nb.signing.signer import MachineSigner
    monkeypatch.setenv("TKBOX_EARLY_BOX", "0")
    home, standin = stalled_home
    c = Client()
    try:
        time.sleep(0.3)
        assert not standin.held, "a box started with the kernel although TKBOX_EARLY_BOX=0"
        t = time.monotonic()
        msg_id = c.kc.execute("x = 41")
        busy = c.kc.get_iopub_msg(timeout=3)
        assert busy["parent_header"]["msg_id"] == msg_id and busy["content"] == {"execution_state": "busy"}
        assert time.monotonic() - t < 1, "busy waited for the box"
        time.sleep(0.5)
        assert standin.held, "the cell's box start never reached the stand-in signer"
        _interrupt_the_waiting_cell(c, msg_id)
        assert _statuses(c, msg_id, timeout=3) == ["error", "status:idle"]  # its busy was the first message above
        msg_id = c.kc.execute("print(globals().get('x'))")
        assert _statuses(c, msg_id) == ["status:busy", "execute_input", "stream", "status:idle"]
        reply = c.kc.get_shell_msg(timeout=10)
        assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
    finally:
        _shut_down_leaving_nothing(c, keep={MachineSigner(home).pid() or -1})
    run = open_run(only_bundle(kernel_env))  # one box, one run: the interrupted cell never reached the exec door
    assert verify_bundle(run.path).valid and run.crossings()[0].door == "box"
    cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    assert [run.content(x.args["code"]) for x in cells] == [b"print(globals().get('x'))"]


def test_an_honest_rerun_of_a_notebook_with_a_widget_box_bundle_and_box_view_is_equivalent(kernel_env, tmp_path):
    """The rerun leaves out %box_bundle and %box_view (replay.RERUN_SKIPS) and has no frontend to send comm
    messages: the audit counts those in the original and names them as not compared, and finds the rerun
    equivalent."""
    c = Client()
    reply, outs = c.run("import ipywidgets as w\ns = w.IntSlider(value=1)\ndisplay(s)")
    [comm_id] = [m["comm_id"] for t, m in outs if t == "comm_open"
                 and m["data"]["state"].get("_model_name") == "IntSliderModel"]
    for cid in (comm_id, "f" * 32):  # the frontend moves the slider to where it was; a stray message is refused
        c.kc.shell_channel.send(c.kc.session.msg("comm_msg", {"comm_id": cid, "data": {
            "method": "update", "state": {"value": 1}, "buffer_paths": []}}))
    time.sleep(1)
    assert c.run(f"%box_bundle {tmp_path / 'so-far.tkb'}")[0]["status"] == "ok"
    assert c.run("%box_view")[0]["status"] == "ok"
    reply, outs = c.run("print('value', s.value)")
    assert ("stream", {"name": "stdout", "text": "value 1\n"}) in outs, outs
    c.stop()
    original = only_bundle(kernel_env)
    run = open_run(original)
    assert sorted(x.args["kind"] for x in run.crossings() if x.door == "exec" and x.args["kind"] != "cell") == \
        ["comm", "comm_fault"]
    assert [x.args["magic"] for x in run.crossings() if x.door == "host"] == ["box_bundle", "box_view"]
    r = run_cli("rerun", str(original), "-o", str(tmp_path / "again.tkb"))
    assert r.returncode == 0, r.stderr
    r = run_cli("audit", str(original), str(tmp_path / "again.tkb"))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT"), r.stdout
    assert "exec cells 2/2" in r.stdout and "host magics 0/0" in r.stdout, r.stdout
    assert "not compared: host magics a rerun skips (%box_bundle, %box_restart, %box_view, %box_secret, " \
        "%box_push) 2/0, comm messages (widgets, from a frontend) 2/0" in r.stdout, r.stdout
    report = json.loads(run_cli("audit", str(original), str(tmp_path / "again.tkb"), "--json").stdout)
    assert report["not_compared"]["comm messages (widgets, from a frontend)"] == {"a": 2, "b": 0}


@pytest.mark.parametrize("case", ["bad-toml", "bad-value", "missing-file", "bad-toml-no-early-box"])
def test_a_tkbox_policy_that_does_not_load_fails_each_cell_closed_and_the_kernel_stays_up(kernel_env, tmp_path,
                                                                                          monkeypatch, case):
    """A bad TKBOX_POLICY used to kill the kernel before kernel_info ("Kernel died"): the kernel now starts, every
    code cell fails with the one-line reason and no box starts, until %%box_policy sets a policy that loads; then
    cells run in a box started with that policy."""
    policy = tmp_path / "policy.toml"
    if case.startswith("bad-toml"):
        policy.write_text("[exec\ncells = true\n")
        why = "not valid TOML"
    elif case == "bad-value":
        policy.write_text('[exec]\ncells = "yes please"\n')
        why = "cells"
    else:
        why = "cannot read the policy"
    monkeypatch.setenv("TKBOX_POLICY", str(policy))
    if case.endswith("no-early-box"):
        monkeypatch.setenv("TKBOX_EARLY_BOX", "0")
    c = Client()  # kernel_info answered: the kernel is up
    try:
        for code in ("1 + 1", "print('again')"):
            reply, outs = c.run(code)
            assert reply["status"] == "error" and reply["ename"] == "PolicyError", reply
            assert reply["evalue"].startswith(f"TKBOX_POLICY={policy} does not load (") and why in reply["evalue"]
            assert "%%box_policy" in reply["evalue"] and "\n" not in reply["evalue"]
            assert not any(t == "stream" for t, _ in outs), outs
        reply, outs = c.run("%box_status")
        assert reply["status"] == "ok" and "policy   none in force: TKBOX_POLICY=" in outs[0][1]["text"]
        assert c.km.is_alive() and not _descendants(c.km.provisioner.process.pid), "a box started under no policy"
        # the notebook sets a policy that loads: from then on, cells run in a box started with it
        reply, outs = c.run("%%box_policy\n[exec]\ncells = true\n")
        assert reply["status"] == "ok", reply
        reply, outs = c.run("print(6 * 7)")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "42\n"}) in outs, outs
    finally:
        c.stop()
    run = open_run(only_bundle(kernel_env))
    [start] = [x for x in run.crossings() if x.door == "box" and x.args.get("kind") == "start"]
    assert run.box["policy"]["name"] == "%%box_policy", run.box["policy"]


def test_every_executed_cell_takes_the_next_execution_count_as_ipykernel_does(client):
    """A cell of host magics only took no number (it showed the box's last one again), so the notebook read
    [1] [1] [2] (issue 36). Now every cell that stores history takes the next number, as a plain ipykernel gives it,
    whether the host or the box answers it: its execute_input, execute_result and execute_reply all say it, and a
    new box (`%box_restart`), whose own ipykernel counts from 1 again, does not set the notebook back."""
    def run(code, **kw):
        if kw:
            mid = client.kc.execute(code, **kw)
            msgs = _iopub_until_idle(client, mid)
            reply = client.kc.get_shell_msg(timeout=60)
            assert reply["parent_header"]["msg_id"] == mid
            return reply["content"], [(m["msg_type"], m["content"]) for m in msgs]
        return client.run(code)

    def count(code, **kw):
        reply, outs = run(code, **kw)
        assert reply["status"] == "ok", reply
        shown = {c["execution_count"] for t, c in outs if t in ("execute_input", "execute_result")}
        assert shown <= {reply["execution_count"]}, (code, shown, reply)
        return reply["execution_count"]

    assert count("1") == 1
    assert count("%box_status") == 2  # answered by the host
    assert count("2") == 3  # the box's ipykernel calls it 2
    assert count("%box_status\n3") == 4  # a host magic and box code: one cell, one number
    assert count("4", silent=True) == 4  # as ipykernel: a silent cell stores no history and takes no number
    assert count("5", store_history=False) == 4
    assert count("") == 4  # an empty cell takes none either
    assert count("%box_restart") == 5
    assert count("6") == 6  # the new box's first cell


def numbered(client: "Client", code: str) -> tuple[int, str]:
    """Run `code`, which must succeed: the execution count the frontend was given, and what the cell printed."""
    reply, outs = client.run(code)
    assert reply["status"] == "ok", (code, reply)
    return reply["execution_count"], "".join(c.get("text", "") for t, c in outs if t == "stream")


def test_the_box_s_in_out_and_underscore_names_use_the_number_the_frontend_shows(client, kernel_env):
    """The box's ipykernel counted only the cells it ran, so after a host-magic cell the notebook showed [3] for a
    cell the box called 2: `Out[3]`, `_3` and `In[3]` in the box named another cell, or none (issue 36). Now the host
    gives the box each cell's number before it runs it: `In[n]`, `Out[n]`, `_n` and `_in`/`_i<n>` in the box agree
    with the `[n]` the frontend shows (a host-magic cell's `In[n]` is empty: its code never reached the box), also in
    a new box after `%box_restart`; the run signs each cell's result under that number."""
    assert numbered(client, "10 + 1")[0] == 1
    assert numbered(client, "%box_status")[0] == 2
    assert numbered(client, "20 + 2")[0] == 3
    n, text = numbered(client, "print(sorted(Out), Out[3], _3, _, repr(In[3]), repr(In[2]), _i3, len(In))")
    assert n == 4 and text == "[1, 3] 22 22 22 '20 + 2' '' 20 + 2 5\n", text
    assert numbered(client, "%box_restart")[0] == 5
    assert numbered(client, "30 + 3")[0] == 6
    n, text = numbered(client, "print(sorted(Out), _6, _, repr(In[6]), len(In))")
    assert n == 7 and text == "[6] 33 33 '30 + 3' 8\n", text
    client.stop()
    first, second = sorted(kernel_env.glob("*.tkb"))
    counts = [[(c.result or {}).get("execution_count") for c in open_run(b).crossings()
               if c.door == "exec" and (c.args or {}).get("kind") == "cell"] for b in (first, second)]
    assert counts == [[1, 3, 4], [6, 7]], counts
    # the bridge's own request that sets each count is answered in the box: none of its answers reached the host
    # (one would be a stray message, counted and signed as a comm_fault)
    assert not [c for b in (first, second) for c in open_run(b).crossings() if (c.args or {}).get("kind") ==
                "comm_fault"]
    # a rerun gives each cell the number the original's box gave it (Box.execute's execution_count): the same text
    r = run_cli("rerun", str(first), "-o", str(kernel_env / "again.tkb"))
    assert r.returncode == 0, r.stderr
    r = run_cli("audit", str(first), str(kernel_env / "again.tkb"))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT") and "exec cells 3/3" in r.stdout, r.stdout


def test_the_box_s_numbers_hold_after_a_cell_rebinds_max_len_and_setattr(client):
    """The bridge's count setter looked up max, len, setattr and get_ipython in the user's namespace: after `from
    numpy import *` (numpy 2's max) it raised, its error stayed in the box, In was padded but the count not moved, and
    from then on In/Out/_n in the box named other cells than the frontend shows. It now names only `__import__`."""
    assert numbered(client, "from numpy import *")[0] == 1
    assert numbered(client, "%box_status")[0] == 2
    assert numbered(client, "20 + 2")[0] == 3
    n, text = numbered(client, "print(sorted(Out), Out[3], _3, repr(In[3]), repr(In[2]), len(In))")
    assert n == 4 and text == "[3] 22 22 '20 + 2' '' 5\n", text
    assert numbered(client, "max = None; len = None; setattr = None; min = None")[0] == 5
    assert numbered(client, "%box_status")[0] == 6
    assert numbered(client, "30 + 3")[0] == 7
    n, text = numbered(client, "print(sorted(Out), Out[7], _7, repr(In[7]), repr(In[6]), In.__len__())")
    assert n == 8 and text == "[3, 7] 33 33 '30 + 3' '' 9\n", text


def test_a_cell_the_box_could_not_number_says_so_and_its_numbers_are_left_as_they_were(client, kernel_env):
    """The count setter's failure stayed in the box (its error was the bridge's own answer), after it had padded In
    but before it moved the count. Now a cell that rebinds `__import__` (the one name the setter still looks up in the
    user's namespace) gets a line on the numbered cell's stderr, and the setter changed nothing: no padding."""
    def number(code):
        reply, outs = client.run(code)
        assert reply["status"] == "ok", (code, reply)
        return (reply["execution_count"], "".join(c.get("text", "") for t, c in outs if t == "stream" and
                                                  c.get("name") == "stdout"),
                "".join(c.get("text", "") for t, c in outs if t == "stream" and c.get("name") == "stderr"))

    assert number("__import__ = None") == (1, "", "")
    assert number("%box_status")[0] == 2
    n, _, err = number("20 + 2")
    assert n == 3 and err.startswith("tkbox: the box could not number this cell [3] (TypeError:"), err
    n, _, err = number("del __import__")
    assert n == 4 and "could not number this cell [4]" in err, err
    n, text, err = number("print(sorted(Out), repr(In[2]), len(In))")  # the failed settings padded nothing
    assert n == 5 and text == "[2] '20 + 2' 6\n" and err == "", (text, err)
    client.stop()
    run = open_run(only_bundle(kernel_env))  # the line is the cell's own output, signed with it, no stray message
    cells = [c for c in run.crossings() if c.door == "exec"]
    assert [(c.args or {}).get("kind") for c in cells] == ["cell"] * 4 and verify_bundle(only_bundle(kernel_env)).valid
    assert "could not number this cell [3]" in run.content(cells[1].result["outputs"]).decode()


def test_what_jupyterlab_does_at_page_load_and_unload_signs_no_deny(kernel_env):
    """Every JupyterLab session signed a deny the user did not cause (issue 36: `comm_fault`, "a comm the box does
    not hold, from=frontend", so `%box_status` said `1 deny`): at page load the widget manager asks comm_info, opens
    its control comm and asks it for the states, before any cell has taken the box; at unload or reload the page
    closes comms the box never had. As ipykernel: comm_info answered, the open answered with a comm_close, what was
    sent on that comm and the close dropped; nothing signed. A comm_msg naming a made-up comm is still a fault (I55,
    test_a_frontend_comm_message_before_the_first_cell_is_refused_and_signed)."""
    c = Client()
    try:
        kc = c.kc
        info = kc.comm_info(target_name="jupyter.widget")
        reply = kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == info and reply["content"]["status"] == "ok"
        opened = kc.session.msg("comm_open", {"comm_id": "c" * 32, "target_name": "jupyter.widget.control",
                                              "data": {}}, metadata={"version": "2.1.0"})
        kc.shell_channel.send(opened)
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": "c" * 32, "data": {"method": "request_states"}}))
        deadline, closed = time.monotonic() + 30, None
        while closed is None and time.monotonic() < deadline:
            m = kc.get_iopub_msg(timeout=30)
            if m["msg_type"] == "comm_close":
                closed = m
        assert closed["content"]["comm_id"] == "c" * 32
        assert closed["parent_header"]["msg_id"] == opened["header"]["msg_id"]
        kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": "d" * 32, "data": {}}))  # the page unloads
        reply, outs = c.run("print('first')")
        assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "first\n"}) in outs
        kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": "e" * 32, "data": {}}))  # with a run open
        reply, _ = c.run("1")
        assert reply["status"] == "ok"
    finally:
        c.stop()
    run = open_run(only_bundle(kernel_env))
    assert [x.args for x in run.crossings() if x.args.get("kind") == "comm_fault"] == []
    assert [x.decision for x in run.crossings() if x.door == "exec"] == ["allow", "allow"]
    assert verify_bundle(only_bundle(kernel_env)).valid
