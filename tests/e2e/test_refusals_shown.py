"""A crossing refused while a cell runs is shown in that cell, as the host's notice, and on `tkbox run`'s stderr
(tkbox_nb/rules/refusal_notices.py). No traffic leaves: a name off [egress] allow is refused before it is looked up."""

from __future__ import annotations

import pytest
from conftest import run_cli

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.jupyter.kernel.relay import NOTICE_MIME

from . import test_kernel
from .test_kernel import only_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])
client, kernel_env = test_kernel.client, test_kernel.kernel_env

FETCH = ("import urllib.request\nfor i in range({n}):\n    try:\n"
         "        urllib.request.urlopen(f'http://pypi.org/simple/p{{i}}/', timeout=20)\n"
         "    except Exception as e:\n        print(type(e).__name__)\n")


def _notices(outs) -> list[str]:
    return [x["data"]["text/plain"] for t, x in outs if t == "display_data" and NOTICE_MIME in x.get("data", {})]


def test_a_refused_egress_is_shown_in_its_cell_as_the_host_s_notice_with_its_rule_and_record(client, kernel_env):
    reply, outs = client.run(FETCH.format(n=1))
    assert reply["status"] == "ok", reply
    notices = _notices(outs)
    assert len(notices) == 1, outs
    assert notices[0].startswith("[tkbox] egress to pypi.org:80 refused: pypi.org:80 is not in [egress] allow "
                                 "(rule egress.allow; signed, record "), notices
    seq = int(notices[0].rsplit("record ", 1)[1].split()[0])
    client.stop()
    refused = [c for c in open_run(only_bundle(kernel_env)).crossings() if c.door == "egress"]
    assert [c.seq for c in refused] == [seq] and refused[0].decision == "deny"


def test_a_refusal_flood_shows_its_first_five_then_one_line(client, kernel_env):
    reply, outs = client.run(FETCH.format(n=9))
    assert reply["status"] == "ok", reply
    notices = _notices(outs)
    assert len(notices) == 6 and all("egress to pypi.org:80 refused" in n for n in notices[:5]), notices
    assert "more refusals in this cell are counted in the run" in notices[5]
    reply, outs = client.run(FETCH.format(n=1))  # the next cell has its own share
    assert len(_notices(outs)) == 1
    client.stop()
    assert len([c for c in open_run(only_bundle(kernel_env)).crossings() if c.door == "egress"]) == 10


def test_tkbox_run_says_each_refusal_on_stderr(signer, tmp_path):
    r = run_cli("run", "--backend", "bwrap", "-o", str(tmp_path / "r.tkb"), "--", "python3", "-c",
                FETCH.format(n=1))
    assert r.returncode == 0, r.stderr
    assert "tkbox: egress to pypi.org:80 refused: pypi.org:80 is not in [egress] allow (rule egress.allow" \
        in r.stderr, r.stderr
