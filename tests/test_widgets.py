"""The run view's state (filters, sort, paging, details, verification) and its widgets, without a browser."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import record_run, tamper_content

from tkbox_nb.jupyter.run_view import RunView, static_html, summary, view


@pytest.fixture(scope="module")
def bundle(signer, tmp_path_factory):
    return record_run(signer, tmp_path_factory.mktemp("v") / "run.tkb",
                      cells=("x = 1\n", "print('<script>alert(1)</script>')\n"),
                      commands=(["ls", "-l"], ["echo", "hi"]),
                      egress=(("metadata.internal", "169.254.169.254"), ("example.org", "198.18.0.7")))


def test_summary_counts_doors_and_decisions(bundle):
    s = summary(RunView(bundle).run)
    assert s["per_door"] == {"box": 2, "egress": 2, "exec": 4}
    assert (s["allowed"], s["denied"]) == (6, 2) and s["sealed"] is True
    assert s["origin"].startswith("tkbox.local/") and s["key_id"].startswith("sha256:")


def test_filters_by_door_decision_and_text_then_sorts(bundle):
    v = RunView(bundle)
    v.door, v.decision = "egress", "deny"
    assert list(v.filtered()["door"]) == ["egress", "egress"]
    v.door, v.decision, v.text = "all", "all", "echo"
    assert list(v.filtered()["summary"]) == ["echo hi"]
    v.text, v.sort_by, v.ascending = "", "seq", False
    seqs = list(v.filtered()["seq"])
    assert seqs == sorted(seqs, reverse=True)


def test_paging_holds_100000_crossings_and_renders_one_page(bundle):
    v = RunView(bundle, page_size=50)
    v.df = pd.concat([v.df] * 12_500, ignore_index=True)  # 100,000 rows of the real shape
    assert len(v.df) == 100_000 and v.pages == 2000
    v.page = 1999
    assert len(v.page_rows()) == 50
    v.page = 10_000  # past the end: the last page
    assert len(v.page_rows()) == 50 and v.page == 1999
    v.door = "egress"
    assert v.pages == 500


def test_details_decode_the_signed_records_and_disclosed_content(bundle):
    v = RunView(bundle)
    cell = next(c for c in v.run.crossings() if c.door == "exec" and c.args["kind"] == "cell")
    d = v.details(cell.seq)
    assert d["content"]["code"] == "x = 1\n" and d["result"]["status"] == "ok"
    assert {r["type"] for r in d["records"]} == {"policy.decision", "tool.result"}


def test_verify_marks_every_row_valid(bundle):
    v = RunView(bundle)
    v.verify(background=False)
    assert v.report.valid and set(v.row_status.values()) == {"valid"}


def test_verify_marks_the_tampered_row_with_the_failing_check(bundle, tmp_path):
    v = RunView(tamper_content(bundle, tmp_path / "tampered.tkb"))
    v.verify(background=False)
    assert not v.report.valid
    bad = {seq: s for seq, s in v.row_status.items() if s != "valid"}
    assert bad and all("content" in s for s in bad.values()), v.row_status


def test_widget_filters_render_and_verify_in_a_thread(bundle):
    w = view(bundle)
    v = w.view
    v.w_door.value = "egress"
    assert v.w_table.value.count("<tr data-seq") == 2
    assert "page 1 of 1 (2 rows)" in v.w_page.value
    v.w_select.value = v.w_select.options[0][1]
    assert "box.connect" in v.w_details.value
    v._on_verify()
    for _ in range(600):
        if v.report is not None and not v.verifying:
            break
        import time
        time.sleep(0.05)
    v.render()
    assert "VALID" in v.w_verdict.value and "✔ valid" in v.w_table.value
    assert "text/html" in w._repr_mimebundle_()  # the static fallback travels with the widget


def test_static_html_escapes_everything_from_the_bundle(bundle):
    page = static_html(RunView(bundle).run)
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page


def test_a_run_left_last_in_a_cell_shows_this_view_and_makes_its_notebook(bundle, monkeypatch):
    """bundle/read_back.py does not import widgets or replay (they read runs: docs/layers.md); the package hands them
    to Run."""
    import IPython.display

    from tkbox_nb import open_run
    run = open_run(bundle)
    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    run._ipython_display_()
    assert [type(s).__name__ for s in shown] == ["ViewBox"] and shown[0].static == static_html(run)
    assert run._repr_html_() == static_html(run) and "tkbox-summary" in run._repr_html_()
    assert any("x = 1" in c.source for c in run.to_notebook().cells)
