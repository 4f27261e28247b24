"""The Tracekit Box kernel shows only what the box was asked for (issue 33): a box message goes to the frontend only
under a request the host sent into that box, and the box never sees the frontend's headers, so it cannot name a
host cell, a `kernel_info`, or any request it was not given; what it sends under any other parent is dropped,
counted and the count signed. The host's own notices carry a mark no box output can carry."""

from __future__ import annotations

import json
import time

import pytest

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.rules.output_sanitiser import mimebundle
from tkbox_nb.jupyter.kernel.relay import NOTICE_MIME
from tkbox_nb.bundle.verify import verify_bundle

from . import test_kernel
from .test_kernel_relay import _iopub, _reply

client, kernel_env = test_kernel.client, test_kernel.kernel_env

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

SPOOF = """import threading, time
k = get_ipython().kernel
def spoof(parents):
    time.sleep(1.0)  # after this cell has ended: no request of the box's is open
    for pid in parents:
        p = {{'msg_id': pid, 'msg_type': 'execute_request', 'session': pid.rsplit('_', 2)[0], 'username': 'x',
             'date': '2026-01-01T00:00:00Z', 'version': '5.3'}}
        k.session.send(k.iopub_socket, 'stream', {{'name': 'stdout', 'text': 'FAKE under ' + pid + '\\n'}}, parent=p)
        k.session.send(k.iopub_socket, 'display_data', {{'data': {{'text/plain': 'FAKE display'}}, 'metadata': {{}}}},
                       parent=p)
    k.session.send(k.iopub_socket, 'stream', {{'name': 'stderr', 'text': 'FAKE with no parent\\n'}}, parent={{}})
threading.Thread(target=spoof, args=({parents!r},)).start()
"""


def _all_iopub(kc, seconds: float) -> list[dict]:
    got, t = [], time.monotonic()
    while time.monotonic() - t < seconds:
        try:
            got.append(kc.get_iopub_msg(timeout=0.2))
        except Exception:
            continue
    return got


def test_a_box_thread_naming_the_frontend_s_requests_is_never_shown_and_its_count_is_signed(client, kernel_env):
    """A box cell's thread sends, with the box's own ipykernel session, streams and displays under the frontend's
    earlier `%box_status` request (its jupyter_client msg_id and the ids next to it, as guessed), a finished host
    cell's reused id, the `kernel_info` request's id, a made-up id and no parent: none reaches the frontend, under
    any parent; their count is signed at the next crossing and the bundle verifies."""
    kc = client.kc
    client.run("1+1")
    info_id = kc.kernel_info()
    status_id = kc.execute("%box_status")
    assert _reply(kc, status_id)["content"]["status"] == "ok"
    _iopub(kc, status_id)
    prefix, counter = status_id.rsplit("_", 1)
    guessed = [f"{prefix}_{int(counter) + d}" for d in range(-2, 5)]  # status_id among them; later ones too
    parents = [*guessed, info_id, "made-up-" + "0" * 24]
    mid = kc.execute(SPOOF.format(parents=parents))
    assert _reply(kc, mid)["content"]["status"] == "ok"
    _iopub(kc, mid)
    seen = _all_iopub(kc, 4)
    assert not [m for m in seen if "FAKE" in json.dumps(m["content"])], seen
    reply, outs = client.run("print('next')")  # the next crossing signs the count
    assert reply["status"] == "ok" and ("stream", {"name": "stdout", "text": "next\n"}) in outs
    client.stop()
    bundle = test_kernel.only_bundle(kernel_env)
    assert verify_bundle(bundle).valid
    run = open_run(bundle)
    strays = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "comm_fault"
              and x.args.get("msg_type") == "stray"]
    assert len(strays) == 1, [x.args for x in strays]
    assert strays[0].args["fault"] == f"{2 * len(parents) + 1} messages naming no request the host sent into the box"
    cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    assert cells[-2].seq < strays[0].seq < cells[-1].seq


def test_the_box_never_sees_the_frontend_s_msg_ids_or_session(client):
    """Every request goes into the box under a header the host made: the box's kernel holds none of the frontend's
    ids (its session, this request's msg_id, an earlier host cell's), nor its username; what it sends under the
    request it was given still shows under the frontend's own request."""
    kc = client.kc
    status_id = kc.execute("%box_status")
    _reply(kc, status_id)
    mid = kc.execute("import json\nip = get_ipython()\n"
                     "print(json.dumps([ip.parent_header, ip.kernel.get_parent()], default=str))")
    assert _reply(kc, mid)["content"]["status"] == "ok"
    msgs = _iopub(kc, mid)
    text = "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
    seen = json.loads(text)
    assert seen[0]["header"]["msg_type"] == "execute_request" and seen[1]["header"]["msg_id"]
    for frontend_id in (kc.session.session, mid, status_id):
        assert frontend_id not in text, frontend_id
    assert seen[0]["header"]["username"] == "tkbox" and seen[0]["header"]["msg_id"] != mid
    assert all(m["parent_header"]["msg_id"] == mid for m in msgs)


def test_the_host_s_notice_carries_a_mark_no_box_output_can(client):
    """The box may print `[tkbox] ...` on stderr or display it, even naming the notice's MIME type: its outputs never
    carry that type nor an inline style; the host's own notice (its box ended) carries both."""
    reply, outs = client.run(
        "import sys\nfrom IPython.display import display, HTML\n"
        "print('[tkbox] the box ended\\n[tkbox] the next cell starts a new box', file=sys.stderr)\n"
        f"display({{'{NOTICE_MIME}': {{'notice': ['x']}}, 'text/plain': '[tkbox] x'}}, raw=True)\n"
        "display(HTML('<div style=\"border-left:4px solid #c77700\">[tkbox] y</div>'))")
    assert reply["status"] == "ok"
    shown = [c for t, c in outs if t == "display_data"]
    assert len(shown) == 2 and all(NOTICE_MIME not in c["data"] for c in shown)
    assert "style" not in shown[1]["data"]["text/html"]
    assert not [c for t, c in outs if t == "stream" and c["name"] not in ("stdout", "stderr")]
    reply, outs = client.run("k = get_ipython().kernel\n"  # a malformed message: the box is ended
                             "k.session.send(k.iopub_socket, 'stream', {'name': 'bogus', 'text': 5}, "
                             "parent=k.get_parent('shell'))\nimport time; time.sleep(5)")
    notices = [c for t, c in outs if t == "display_data" and NOTICE_MIME in c["data"]]
    assert reply["status"] == "error" and len(notices) == 1, outs
    assert notices[0]["data"][NOTICE_MIME]["notice"][-1] == "the next cell starts a new box"
    assert 'style="' in notices[0]["data"]["text/html"]
    assert "protocol violation" in notices[0]["data"]["text/plain"]
    assert set(mimebundle(notices[0]["data"], "display_data.data", [])) == {"text/plain", "text/html"}  # not the mark
