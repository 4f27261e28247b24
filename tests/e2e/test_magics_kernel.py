"""The IPython extension in a real ipykernel (the plain python3 kernel, driven by jupyter_client), where the host
kernel has a parent per request: what a `%%box` cell shows after an interrupt, `[exec] timeout_s` without a later
cell, and `%box_pull` of the host kernel's own names."""

from __future__ import annotations

import json
import time

import pytest
from jupyter_client.manager import KernelManager

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.jupyter.magics import BoxInterrupted
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])


class Python3:
    """A python3 kernel with the extension loaded; every iopub message is kept as (parent msg_id, type, content)."""

    def __init__(self):
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.seen: list[tuple[str, str, dict]] = []
        reply = self.run("%load_ext tkbox_nb")
        assert reply["status"] == "ok", reply

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def read(self, until, timeout: float) -> None:
        """Keep iopub messages until `until(parent, type, content)` holds for one."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; seen: {self.seen[-20:]}"
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except Exception:
                continue
            item = (msg["parent_header"].get("msg_id"), msg["msg_type"], msg["content"])
            self.seen.append(item)
            if until(*item):
                return

    def wait(self, msg_id: str, timeout: float = 90) -> dict:
        """The request's reply, once its idle has come."""
        self.read(lambda parent, t, c: parent == msg_id and t == "status" and c["execution_state"] == "idle", timeout)
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]

    def run(self, code: str, timeout: float = 90) -> dict:
        return self.wait(self.send(code), timeout)

    def shown(self, msg_id: str) -> list[tuple[str, dict]]:
        return [(t, c) for parent, t, c in self.seen if parent == msg_id and t != "status"]

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def py3(signer, tmp_path, monkeypatch):
    monkeypatch.setenv("TKBOX_BUNDLE_DIR", str(tmp_path / "bundles"))
    k = Python3()
    yield k
    k.stop()


PRINTS_AND_CLEARS = """\
%%box
import threading, time
from IPython.display import clear_output
def loop():
    n = 0
    while True:
        n += 1
        print('BOXOUT', n, flush=True)
        clear_output()
        time.sleep(0.05)
t = threading.Thread(target=loop, daemon=True)
t.start()
t.join()
"""


def test_an_interrupted_box_cell_shows_nothing_more_in_host_cells(py3, tmp_path):
    """Ctrl-C on a %%box cell whose thread prints and clears: the box's cell is interrupted too, and none of its
    output (its clear_output included) lands in the host cells that follow; `result = 42` stays."""
    cell = py3.send(PRINTS_AND_CLEARS)
    py3.read(lambda parent, t, c: parent == cell and t == "stream" and "BOXOUT" in c["text"], 90)
    py3.km.interrupt_kernel()
    reply = py3.wait(cell, 30)
    assert reply["status"] == "error" and reply["ename"] == "BoxInterrupted", reply
    assert [c["traceback"] for t, c in py3.shown(cell) if t == "error"] == [[BoxInterrupted.LINE]]
    after = len(py3.seen)
    host = py3.send("result = 42\nprint('result =', result)")
    assert py3.wait(host)["status"] == "ok"
    slow = py3.send("import time\nfor i in range(10):\n    time.sleep(0.2)\n    print('host', i, flush=True)")
    assert py3.wait(slow)["status"] == "ok"
    later = py3.seen[after:]
    assert not any("BOXOUT" in json.dumps(c) for _, _, c in later), later
    assert not any(t == "clear_output" for _, t, _ in later), later
    assert ("stream", {"name": "stdout", "text": "result = 42\n"}) in py3.shown(host)
    # the box's kernel was interrupted: its next cell runs at once (its thread still prints, never shown here)
    # (its thread's prints may be shown there: the box's own kernel names its current cell as their parent)
    nxt = py3.send("%%box\nprint('next box cell')")
    assert py3.wait(nxt, 60)["status"] == "ok"
    assert "next box cell" in "".join(c["text"] for t, c in py3.shown(nxt) if t == "stream")
    # what the box sent for the interrupted cell is in the run, under that cell: with it, then as its late output
    assert py3.run("%unload_ext tkbox_nb")["status"] == "ok"
    [bundle] = sorted((tmp_path / "bundles").glob("*.tkb"))
    assert verify_bundle(bundle).valid
    run = open_run(bundle)
    cells = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "cell"]
    late = [x for x in run.crossings() if x.door == "exec" and x.args.get("kind") == "late_output"]
    assert b"BOXOUT" in run.content(cells[0].result["outputs"])
    assert late and all(x.args["cell_seq"] in (cells[0].seq, cells[1].seq) for x in late)
    assert any(b"BOXOUT" in run.content(x.args["outputs"]) for x in late
               if x.args["cell_seq"] == cells[0].seq and "outputs" in x.args)


IGNORES_INTERRUPTS = """\
%%box
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
print('BOXSTUCK', flush=True)
while True:
    time.sleep(0.1)
"""

ENDED = "import tkbox_nb.jupyter.magics as m\nprint('ended:', next(iter(m._loaded.values())).nb.box.ended)"


def test_a_box_cell_past_timeout_s_is_ended_without_a_later_box_cell(py3):
    """[exec] timeout_s ends the box of a %%box cell that outlives it after the host stopped waiting (interrupted,
    and the box's cell ignores its interrupt): a timer, not a check when the next %%box cell comes."""
    assert py3.run("%%box_policy\n[exec]\ntimeout_s = 4\n")["status"] == "ok"
    cell = py3.send(IGNORES_INTERRUPTS)
    py3.read(lambda parent, t, c: parent == cell and t == "stream" and "BOXSTUCK" in c["text"], 90)
    started = time.monotonic()
    py3.km.interrupt_kernel()
    assert py3.wait(cell, 30)["ename"] == "BoxInterrupted"
    time.sleep(max(0.0, started + 8 - time.monotonic()))  # no cell meanwhile
    probe = py3.send(ENDED)
    assert py3.wait(probe)["status"] == "ok"
    [text] = [c["text"] for t, c in py3.shown(probe) if t == "stream"]
    assert "exec timed out after 4s" in text, text
    assert not any("BOXSTUCK" in json.dumps(c) for parent, _, c in py3.seen if parent != cell)


FAKES_PULLS = """\
%%box
import IPython.display as d
real = d.display
def display(obj, **kw):
    if isinstance(obj, dict) and 'tkbox-pull' in obj.get('application/json', {}):
        obj = {'application/json': {'tkbox-pull': {n: {'kind': 'json', 'value': 'from the box'}
                                                 for n in obj['application/json']['tkbox-pull']}}}
    return real(obj, **kw)
d.display = display
for name in ('get_ipython', 'In', 'Out', 'exit', 'quit', '_', '_i1', '_oh', '__name__', 'value'):
    globals()[name] = 'from the box'
"""


def test_box_pull_refuses_names_the_host_kernel_relies_on(py3):
    """A box answering %box_pull with whatever it likes (its display faked) cannot replace a name the host kernel
    relies on: one line each, the host's names unchanged; a plain name is still pulled."""
    assert py3.run(FAKES_PULLS)["status"] == "ok"
    before = py3.send("print(__builtins__.__name__, callable(get_ipython), type(In).__name__, __name__)")
    py3.wait(before)
    for name in ("__builtins__", "get_ipython", "In", "Out", "exit", "quit", "_", "__", "_i1", "_oh", "__name__",
                 "_private"):
        pull = py3.send(f"%box_pull {name}")
        reply = py3.wait(pull)
        assert reply["status"] == "error", (name, reply)
        lines = [line for t, c in py3.shown(pull) for line in
                 (c["text"].splitlines() if t == "stream" else c.get("traceback", [])) if line.strip()]
        assert len(lines) == 1 and f"%box_pull: {name} " in lines[0] and "not replaced" in lines[0], (name, lines)
    after = py3.send("print(__builtins__.__name__, callable(get_ipython), type(In).__name__, __name__)")
    py3.wait(after)
    assert [c["text"] for t, c in py3.shown(after) if t == "stream"] == \
        [c["text"] for t, c in py3.shown(before) if t == "stream"] == ["builtins True list __main__\n"]
    assert py3.run("%box_pull value")["status"] == "ok"
    check = py3.send("print(value)")
    py3.wait(check)
    assert [c["text"] for t, c in py3.shown(check) if t == "stream"] == ["from the box\n"]
