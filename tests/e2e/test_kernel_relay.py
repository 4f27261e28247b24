"""The Tracekit Box kernel against a frontend's expectations and a hostile box: the host's prompt kept apart from the
box's, cells run one at a time in order, host magics that fail still end their cell, and what the box sends is
rebuilt on the host (headers, parents, user expressions, display ids), and what comes after its cell was signed is
signed before it is shown."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import zipfile

import pytest
from conftest import VENV_BIN, run_cli

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.rules.late_outputs import FLUSH_S, MAX_CELL_MESSAGES

from . import test_kernel

# the Tracekit Box kernel's fixtures, shared with test_kernel.py (pytest finds a fixture by its name here)
client, kernel_env = test_kernel.client, test_kernel.kernel_env

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])


def _reply(kc, msg_id, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        m = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if m["parent_header"].get("msg_id") == msg_id:
            return m


def _iopub(kc, msg_id, timeout=30):
    """Every iopub message of one request, up to its idle."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            m = kc.get_iopub_msg(timeout=0.5)
        except Exception:
            continue
        if m["parent_header"].get("msg_id") == msg_id:
            got.append(m)
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return got
    raise AssertionError(f"no idle for {msg_id}: {[m['msg_type'] for m in got]}")


READ_RAW_STDIN = ("k = get_ipython().kernel\nmsgs = []\n"
                  "while k.stdin_socket.poll(500): msgs.append(k.stdin_socket.recv_multipart())\n"
                  "print('raw stdin:', [f.decode(errors='replace') for m in msgs for f in m if b'value' in f])")


def test_a_reply_to_the_host_s_prompt_never_reaches_the_box(client):
    """The host's %box_secret prompt takes only the reply naming it; a reply naming a host prompt (here one answered
    after the prompt was interrupted) is never forwarded to the box, even while the box's own prompt waits; the
    control channel is answered while the host's prompt waits."""
    kc = client.kc
    client.run("1+1")
    secret = "hunter2-" + os.urandom(6).hex()
    mid = kc.execute("%box_secret TOKEN --host api.example.com", allow_stdin=True)
    host_req = kc.get_stdin_msg(timeout=30)
    assert host_req["content"] == {"prompt": "value of TOKEN (stays on the host): ", "password": True}
    # a reply naming another request is not the answer: the prompt still waits
    kc.stdin_channel.send(kc.session.msg("input_reply", {"value": "WRONG"}, parent={"msg_id": "other"}))
    time.sleep(0.5)
    t = time.monotonic()
    kc.session.send(kc.control_channel.socket, kc.session.msg("interrupt_request", {}))
    assert kc.get_control_msg(timeout=10)["msg_type"] == "interrupt_reply"
    reply = _reply(kc, mid, timeout=10)
    assert time.monotonic() - t < 10
    assert reply["content"]["status"] == "error" and "interrupted" in reply["content"]["evalue"]
    # the box asks; the user types the secret into the host's old prompt, then answers the box's
    m1 = kc.execute("x = input('name? ')\nprint('the box got:', x)", allow_stdin=True)
    box_req = kc.get_stdin_msg(timeout=30)
    assert box_req["content"]["prompt"] == "[box] name? "
    kc.stdin_channel.send(kc.session.msg("input_reply", {"value": secret}, parent=host_req["header"]))
    time.sleep(0.5)
    kc.stdin_channel.send(kc.session.msg("input_reply", {"value": "alice"}, parent=box_req["header"]))
    streams = [m["content"]["text"] for m in _iopub(kc, m1) if m["msg_type"] == "stream"]
    assert _reply(kc, m1)["content"]["status"] == "ok"
    assert streams == ["the box got: alice\n"]
    reply, outs = client.run(READ_RAW_STDIN)
    assert reply["status"] == "ok" and secret not in repr(outs) and "WRONG" not in repr(outs)
    # a reply answering the box's prompt a second time is not forwarded either (no prompt of the box pends)
    kc.stdin_channel.send(kc.session.msg("input_reply", {"value": secret}, parent=box_req["header"]))
    reply, outs = client.run(READ_RAW_STDIN)
    assert ("stream", {"name": "stdout", "text": "raw stdin: []\n"}) in outs


BOX_PROMPT_UNDER_IS_COMPLETE = r"""
import threading
k = get_ipython().kernel
got = []
async def never_answers(stream, ident, parent):
    def ask():
        try:
            got.append(k._input_request("anything", ident, parent, password=False))
        except BaseException as e:
            got.append(repr(e))
    threading.Thread(target=ask, daemon=True).start()
k.shell_handlers["is_complete_request"] = never_answers
"""


def test_a_parentless_reply_while_the_host_s_prompt_waits_is_the_host_s_never_the_box_s(client):
    """A box keeps a prompt of its own pending (asked under an is_complete_request it never answers); the user
    answers the host's %box_secret prompt as jupyter_console and jupyter_client's input() do, with no parent: the
    value is the host's, and never reaches the box's prompt."""
    kc = client.kc
    reply, _ = client.run(BOX_PROMPT_UNDER_IS_COMPLETE)
    assert reply["status"] == "ok"
    kc.is_complete("x = 1")
    box_req = kc.get_stdin_msg(timeout=30)
    assert box_req["content"]["prompt"].startswith("[box] ")
    secret = "s3cret-" + os.urandom(6).hex()
    answered = []

    def hook(msg):
        if not answered:
            answered.append(msg["content"])
            kc.input(secret)  # parentless
    reply, outs = client.run("%box_secret TOKEN --host api.example.com", stdin=hook, timeout=30)
    assert answered == [{"prompt": "value of TOKEN (stays on the host): ", "password": True}]
    assert reply["status"] == "ok", (reply, outs)
    reply, outs = client.run("print('box got:', got)")
    assert ("stream", {"name": "stdout", "text": "box got: []\n"}) in outs and secret not in repr(outs)


def test_a_box_reply_of_another_type_than_its_request_ends_the_box_and_the_cell(client):
    """A box that answers the cell's execute_request with a complete_reply (so that its execute_reply, routed by
    the request's id alone, would be dropped and the cell never end) has broken the protocol: the box is ended,
    the cell ends with that reason, and the next cell runs in a new box."""
    arm = (
        "k = get_ipython().kernel\norig = k.shell_handlers['execute_request']\n"
        "async def ex(stream, ident, parent):\n"
        "    k.session.send(stream, 'complete_reply', {'status': 'ok', 'matches': [], 'cursor_start': 0,\n"
        "                   'cursor_end': 0, 'metadata': {}}, parent, ident)\n"
        "    r = orig(stream, ident, parent)\n"
        "    return (await r) if hasattr(r, '__await__') else r\n"
        "k.shell_handlers['execute_request'] = ex\n")
    reply, _ = client.run(arm)
    assert reply["status"] == "ok"
    t = time.monotonic()
    reply, outs = client.run("print('cell B')", timeout=40)
    assert time.monotonic() - t < 30
    assert reply["status"] == "error" and reply["ename"] == "BoxEnded"
    assert "door protocol violation: the box sent a complete_reply in reply to execute_request" in reply["evalue"]
    reply, outs = client.run("print('cell C')", timeout=60)
    assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "cell C\n"}) in outs


def test_cells_run_in_order_host_magics_wait_and_an_error_aborts_the_queue(client):
    kc = client.kc
    client.run("1+1")
    order = {kc.execute("import time; time.sleep(2); print('one')", stop_on_error=False): "box 1",
             kc.execute("%box_status", stop_on_error=False): "host 2", kc.execute("print('three')"): "box 3"}
    # the host answers kernel_info (and control) while the queue waits
    t = time.monotonic()
    info = kc.kernel_info()
    replies = []
    while len(replies) < 4:
        m = kc.get_shell_msg(timeout=30)
        if m["parent_header"]["msg_id"] == info:
            replies.append(("info", time.monotonic() - t))
        elif m["parent_header"]["msg_id"] in order:
            replies.append((order[m["parent_header"]["msg_id"]], m["content"]["status"]))
    assert replies[0][0] == "info" and replies[0][1] < 1.5
    assert replies[1:] == [("box 1", "ok"), ("host 2", "ok"), ("box 3", "ok")]
    # with stop_on_error, the requests queued behind a failed cell are aborted (busy, reply, idle), as ipykernel does
    ids = [kc.execute("import time; time.sleep(1); 1/0"), kc.execute("%box_restart"), kc.execute("print('no')")]
    statuses = [_reply(kc, i)["content"]["status"] for i in ids]
    assert statuses == ["error", "aborted", "aborted"]
    for i in ids[1:]:
        assert [m["msg_type"] for m in _iopub(kc, i)] == ["status", "status"]
    reply, outs = client.run("print('time' in dir())")  # the box was not restarted
    assert ("stream", {"name": "stdout", "text": "True\n"}) in outs


def test_a_host_magic_that_raises_anything_still_ends_its_cell(client):
    client.run("1+1")
    reply, outs = client.run("%box_bundle /proc/nope/x.tkb", timeout=30)
    assert reply["status"] == "error" and reply["ename"] == "FileNotFoundError" and "/proc/nope" in reply["evalue"]
    assert [t for t, _ in outs] == ["error"]
    reply, outs = client.run("%box_status", timeout=30)
    assert reply["status"] == "ok"


def test_the_box_s_headers_and_parents_never_reach_the_frontend(client):
    """A date the box made up would crash a jupyter_client frontend (nbclient, papermill, nbval): every message is
    given a header made on the host, and as parent the frontend's own request or nothing."""
    client.run("1+1")
    reply, outs = client.run(
        "k = get_ipython().kernel\n"
        "m = k.session.msg('stream', {'name': 'stdout', 'text': 'hello\\n'}, parent=k.get_parent())\n"
        "m['header']['date'] = '2024-13-45T00:00:00'\nm['parent_header']['date'] = 'nope'\n"
        "k.session.send(k.iopub_socket, m)\n"
        "k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'orphan\\n'}, "
        "parent={'msg_id': 'invented', 'msg_type': 'execute_request', 'date': '2024-99-99'})\n"
        "import time; time.sleep(0.5)", timeout=30)
    assert reply["status"] == "ok"
    assert ("stream", {"name": "stdout", "text": "hello\n"}) in outs
    assert not any(c.get("text") == "orphan\n" for _, c in outs)


def test_user_expression_results_are_rebuilt_and_nothing_of_the_box_s_reaches_the_frontend(client):
    """Each expression asked is evaluated in the box and answered from its signed result, rebuilt from an allowlist:
    scripted HTML sanitised, SVG and JavaScript dropped, metadata empty, and no key the frontend did not ask for."""
    kc = client.kc
    client.run("class R:\n    def _repr_html_(self): return '<img src=x onerror=alert(1)><script>alert(2)</script>'\n"
               "    def _repr_svg_(self): return '<svg xmlns=\"http://www.w3.org/2000/svg\" onload=\"alert(3)\"/>'\n"
               "    def _repr_javascript_(self): return 'alert(4)'\nr = R()")
    mid = kc.execute("pass", user_expressions={"v": "r", "e": "1/0"})
    exprs = _reply(kc, mid)["content"]["user_expressions"]
    assert set(exprs) == {"v", "e"}
    assert exprs["e"]["status"] == "error" and exprs["e"]["ename"] == "ZeroDivisionError"
    assert exprs["v"]["status"] == "ok" and exprs["v"]["metadata"] == {}
    assert set(exprs["v"]["data"]) == {"text/plain", "text/html"}, exprs
    assert "onerror" not in exprs["v"]["data"]["text/html"] and "<script" not in exprs["v"]["data"]["text/html"]


def test_a_box_display_id_is_namespaced_to_its_box(client):
    reply, outs = client.run("h = display('first', display_id='status')\nh.update('second')")
    ids = [c["transient"]["display_id"] for t, c in outs if t.endswith("display_data")]
    assert len(ids) == 2 and ids[0] == ids[1] and ids[0].startswith("tkbox-") and ids[0].endswith("-status")


def test_a_fake_reply_ends_the_signed_record_and_nothing_after_it_is_shown_unsigned(client, kernel_env):
    """The box's own execute_reply and idle end its cell early: the first reply is the cell's (forwarded and
    signed), what follows naming the cell is held as late output, and the real reply, a second one, ends the box:
    what was held is dropped unsigned, never shown, and counted in the box's end reason."""
    kc = client.kc
    client.run("1+1")
    mid = kc.execute("k = get_ipython().kernel; p = k.get_parent()\n"
                     "k.session.send(k.shell_stream, 'execute_reply', {'status': 'ok', 'execution_count': 7, "
                     "'payload': [], 'user_expressions': {}}, parent=p, ident=k._parent_ident['shell'])\n"
                     "k.session.send(k.iopub_socket, 'status', {'execution_state': 'idle'}, parent=p)\n"
                     "import time; time.sleep(0.5)\nprint('UNSIGNED-AFTER-FAKE-END')\n1/0")
    reply = _reply(kc, mid)
    # the count shown is the host's for the cell (cells.Cells.numbered), never the 7 the box made up
    assert reply["content"]["status"] == "ok" and reply["content"]["execution_count"] == 2
    seen = []
    t = time.monotonic()
    while time.monotonic() - t < 4:
        try:
            seen.append(kc.get_iopub_msg(timeout=0.5))
        except Exception:
            pass
    assert {m["msg_type"] for m in seen if m["parent_header"].get("msg_id") == mid} <= {"execute_input", "status"}
    assert "UNSIGNED" not in repr([m["content"] for m in seen if m["msg_type"] != "execute_input"])
    reply, outs = client.run("print('next')")
    assert reply["status"] == "ok"
    client.stop()
    first, second = sorted(kernel_env.glob("*.tkb"))
    assert "a second execute_reply" in open_run(first).box["end_reason"]
    assert "messages naming cells already signed were dropped" in open_run(first).box["end_reason"]
    assert not [x for x in open_run(first).crossings() if x.args.get("kind") == "late_output"]
    for b in (first, second):
        with zipfile.ZipFile(b) as z:
            assert not any(b"UNSIGNED-AFTER" in z.read(n) for n in z.namelist())


def _late(kc, msg_id, seconds):
    """The iopub messages naming `msg_id` that come within `seconds` (after its idle)."""
    got, t = [], time.monotonic()
    while time.monotonic() - t < seconds:
        try:
            m = kc.get_iopub_msg(timeout=0.2)
        except Exception:
            continue
        if m["parent_header"].get("msg_id") == msg_id:
            got.append(m)
    return got


def _verifies_both_ways(bundle, tmp_path):
    r = run_cli("verify", str(bundle))
    assert r.returncode == 0, r.stdout + r.stderr
    trust = tmp_path / "trust.json"
    assert run_cli("trust", "-o", str(trust)).returncode == 0
    r = subprocess.run([str(VENV_BIN / "tracekit"), "verify", str(bundle), "--trust", str(trust)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_thread_s_output_after_its_cell_ended_is_signed_then_shown_under_that_cell(client, kernel_env, tmp_path):
    """As in a plain ipykernel, a background thread's print after its cell ended shows under that cell: the host
    signs it first, as a record of its own naming the cell (exec, kind late_output), then forwards it with the
    cell's parent; replay shows it as an output of that cell, and the bundle verifies both ways."""
    kc = client.kc
    client.run("1+1")
    mid = kc.execute("import threading, time\n"
                     "threading.Thread(target=lambda: (time.sleep(0.5), print('LATE-LINE', flush=True))).start()")
    assert _reply(kc, mid)["content"]["status"] == "ok"
    _iopub(kc, mid)
    late = _late(kc, mid, 3)
    assert [(m["msg_type"], m["content"]) for m in late] == [("stream", {"name": "stdout", "text": "LATE-LINE\n"})]
    assert late[0]["parent_header"]["msg_type"] == "execute_request"  # the cell's own request, as ipykernel
    reply, outs = client.run("print('next')")
    assert reply["status"] == "ok" and [o for o in outs if o[0] == "stream"] == [
        ("stream", {"name": "stdout", "text": "next\n"})]  # nothing late in the next cell
    client.stop()
    bundle = test_kernel.only_bundle(kernel_env)
    _verifies_both_ways(bundle, tmp_path)
    run = open_run(bundle)
    cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    records = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "late_output"]
    assert len(records) == 1 and records[0].decision == "allow", records
    assert records[0].args["cell_seq"] == cells[1].seq and records[0].args["messages"] == 1
    assert cells[1].seq < records[0].seq < cells[2].seq  # signed after the cell's end, before the next crossing
    assert b"LATE-LINE" in run.content(records[0].args["outputs"])
    nb = run.to_notebook()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [o.get("text") for o in code[1].outputs] == ["LATE-LINE\n"]
    assert run_cli("audit", str(bundle), str(bundle)).returncode == 0


def test_a_flood_of_late_output_is_capped_and_the_cap_is_signed(client, kernel_env, tmp_path):
    """A thread that floods after its cell ended gets its first MAX_CELL_MESSAGES outputs signed (in batches, each
    a record) and shown; the rest are dropped, never shown, and their count signed at the next crossing."""
    kc = client.kc
    client.run("1+1")
    mid = kc.execute("import threading, time\nfrom IPython.display import display\n"
                     "def flood():\n    time.sleep(0.3)\n    for i in range(1500): display(i)\n"
                     "threading.Thread(target=flood).start()")
    assert _reply(kc, mid)["content"]["status"] == "ok"
    _iopub(kc, mid)
    late = _late(kc, mid, 8)
    assert len(late) == MAX_CELL_MESSAGES and {m["msg_type"] for m in late} == {"display_data"}
    assert [m["content"]["data"]["text/plain"] for m in late] == [str(i) for i in range(MAX_CELL_MESSAGES)]
    reply, outs = client.run("print('next')")
    assert reply["status"] == "ok"
    client.stop()
    bundle = test_kernel.only_bundle(kernel_env)
    _verifies_both_ways(bundle, tmp_path)
    records = [x.args for x in open_run(bundle).crossings() if x.args.get("kind") == "late_output"]
    assert sum(r["messages"] for r in records) == MAX_CELL_MESSAGES
    assert sum(r.get("dropped", 0) for r in records) == 1500 - MAX_CELL_MESSAGES
    assert len(records) <= 8 / FLUSH_S + 2  # batched: at most one record per cell each FLUSH_S, and the count


def test_a_rerun_sends_the_same_user_expressions_and_audit_names_a_result_that_differs(client, kernel_env, tmp_path):
    """`tkbox rerun` makes each cell again with the user_expressions it was decided with; two runs that differ only
    in an expression's result are DIFFERENT at `cell user_expressions`, the seq of the cell named in both."""
    kc = client.kc
    client.run("import time")
    mid = kc.execute("x = 6 * 7", user_expressions={"x": "x", "now": "time.time_ns()"})
    assert _reply(kc, mid)["content"]["user_expressions"]["x"]["data"] == {"text/plain": "42"}
    client.stop()
    original = test_kernel.only_bundle(kernel_env)
    again = tmp_path / "again.tkb"
    r = run_cli("rerun", str(original), "-o", str(again))
    assert r.returncode == 0, r.stderr
    cells = [[x for x in open_run(b).crossings() if x.args.get("kind") == "cell"] for b in (original, again)]
    assert cells[0][1].args["user_expressions"] == cells[1][1].args["user_expressions"]  # decided the same
    r = run_cli("audit", str(original), str(again), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    diffs = json.loads(r.stdout)["differences"]
    assert [d["kind"] for d in diffs] == ["cell user_expressions"], diffs
    assert (diffs[0]["seq_a"], diffs[0]["seq_b"]) == (cells[0][1].seq, cells[1][1].seq)


def test_a_shutdown_is_answered_even_when_stopping_the_box_fails(client, kernel_env):
    """The box's bundle cannot be written (its folder is now a file): the frontend, which waits for the
    shutdown_reply, still gets it, and the kernel ends."""
    kc = client.kc
    reply, _ = client.run("1+1")
    assert reply["status"] == "ok"
    shutil.rmtree(kernel_env, ignore_errors=True)
    kernel_env.write_text("not a folder")
    mid = kc.shutdown()
    got = kc.get_control_msg(timeout=30)
    assert got["parent_header"]["msg_id"] == mid and got["msg_type"] == "shutdown_reply"
    assert got["content"] == {"status": "ok", "restart": False}
    deadline = time.monotonic() + 30
    while client.km.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.km.is_alive()
