"""Issue #11's whole loop on one notebook run: prints, a DataFrame, a matplotlib figure, a random seed, an allowed
egress call and a model call, recorded; then replayed as a notebook, rerun in a fresh box (the model call served
from the recording, the upstream gone) and audited: equivalent. A run that differs in one cell is reported at exactly
that cell."""

from __future__ import annotations


import nbformat
import pytest
from conftest import run_cli

from tests.e2e.test_models import ANTHROPIC_KEY, OPENAI_KEY, PORT, Upstream
from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
from testnet import NamespaceNet, available
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(not available()[0], reason=available()[1])]

CELLS = [
    "import random\nrandom.seed(7)\nprint('draws', [random.randint(0, 100) for _ in range(3)])",
    "import pandas as pd\npd.DataFrame({'door': ['exec', 'egress', 'model'], 'n': [1, 2, 3]})",
    "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(2, 2))\nax.plot([1, 4, 9])\nplt.show()",
    "import urllib.request\n"
    "print(urllib.request.urlopen('http://web.tkb.test:8080/hello.txt', timeout=20).read().decode())",
    "import openai\nr = openai.OpenAI().chat.completions.create(model='gpt-4o-mini', max_tokens=20, "
    "messages=[{'role': 'user', 'content': 'reproduce me'}])\nprint(r.choices[0].message.content)",
]


def policy(net) -> str:
    return f"""
[egress]
allow = ["web.tkb.test:8080"]
allow_cidrs = ["198.18.0.0/15"]
nameservers = ["{net.web}"]

[models]
mode = "record"
allow = ["openai:gpt-4o-mini"]

[models.openai]
base_url = "http://{net.web}:{PORT}"
key = "env:TKB_TEST_OPENAI_KEY"
"""


def record(net, out_dir, cells):
    nb = NotebookBox(bundle_dir=out_dir)
    HostMagics(nb, lambda prompt: "").run("box_policy", "", policy(net))
    outputs = [nb.ensure_box().execute(code).outputs for code in cells]
    return nb.stop("done"), outputs


def test_record_replay_rerun_and_audit_one_notebook(signer, tmp_path, monkeypatch):
    monkeypatch.setenv("TKB_TEST_OPENAI_KEY", OPENAI_KEY)
    monkeypatch.setenv("TKB_TEST_ANTHROPIC_KEY", ANTHROPIC_KEY)
    with NamespaceNet(index=19) as net:
        up = Upstream(net)
        try:
            original, outs = record(net, tmp_path / "a", CELLS)
            changed, _ = record(net, tmp_path / "b", [CELLS[0].replace("seed(7)", "seed(8)")] + CELLS[1:])
        finally:
            up.stop()  # from here on no model upstream exists: the rerun must be served from the recording
        assert outs[0][0]["text"].startswith("draws ") and "text/html" in outs[1][-1]["data"]
        assert "image/png" in outs[2][-1]["data"] and outs[3][0]["text"] == "hello from the test network\n\n"
        assert outs[4][0]["text"] == "echo: reproduce me\n"
        assert verify_bundle(original).valid
        # replay: the run as a notebook, each cell with its recorded outputs
        assert run_cli("replay", str(original), "-o", str(tmp_path / "run.ipynb")).returncode == 0
        nb = nbformat.read(tmp_path / "run.ipynb", 4)
        code = [c for c in nb.cells if c.cell_type == "code" and "tkbox-host" not in c.metadata.get("tags", [])]
        assert [c.source for c in code] == CELLS
        assert "image/png" in code[2].outputs[-1]["data"]
        # rerun in a fresh box, under the bundle's own policy: egress live (the web server is up), the model replayed
        r = run_cli("rerun", str(original), "-o", str(tmp_path / "rerun.tkb"), "--backend", "bwrap")
        assert r.returncode == 0, r.stderr
    rerun = open_run(tmp_path / "rerun.tkb")
    assert [c.args["mode"] for c in rerun.crossings() if c.door == "model"] == ["replay"]
    assert [c.decision for c in rerun.crossings() if c.door == "egress"] == ["allow"]
    r = run_cli("audit", str(original), str(tmp_path / "rerun.tkb"))
    assert r.returncode == 0 and r.stdout.startswith("EQUIVALENT"), r.stdout
    # one changed cell: audit names exactly it (its code and its output), nothing else
    r = run_cli("audit", str(original), str(changed), "--json")
    assert r.returncode == 1
    import json
    assert sorted(d["what"] for d in json.loads(r.stdout)["differences"]) == ["cell code #1", "cell outputs #1"]
