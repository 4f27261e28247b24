"""Browse and verify a signed run inline: an ipywidgets view over `Run.to_dataframe()`.

`view(run_or_path)` shows, top to bottom: a summary (run, backend and isolation, signing origin and key, sealed or
open, crossings per door, allowed/denied/flagged), a timeline of crossings per door over the run's time (an SVG:
refusals stand out in red), the run as a paged table with filters (door, decision, text), sorting and paging (fit for
100,000 crossings: only one page is ever rendered), the selected crossing's details (its signed record, disclosed
arguments, result and content), and a Verify button that runs `tkbox verify` in a thread, then marks each row valid
or with the check that failed, beside the verdict and the assurance line.

The state (filters, sort, page, verification) lives in `RunView` and is plain Python, so it is tested without a
browser; the widgets only render it. Where widgets do not run (nbconvert, GitHub) the view's display carries a
static HTML rendering too (`static_html`).

Everything shown comes from the bundle, which is untrusted until verified: every string is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.bundle.read_back import Run, open_run
from tkbox_nb.rules.door_table import BOX, TABLE, Door, names

PAGE_SIZE = 25
DOORS = names()  # in the table's order (rules/door_table.py): the timeline's rows, the door filter's choices
DOOR_COLORS = {"allow": "#2e7d32", "deny": "#c62828", "ask": "#ef6c00"}
STATIC_ROWS = 200


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def summary(run: Run) -> dict[str, Any]:
    df = run.to_dataframe()
    per_door = {str(k): int(v) for k, v in df["door"].value_counts().items() if v}
    decisions = Counter(str(d) for d in df["decision"])
    flagged = sum(1 for c in run.crossings() if "flag" in c.decision or any("FLAG" in r for r in c.rule_ids))
    return {"run_id": run.run_id, "backend": run.box.get("backend", "?"), "isolation": run.box.get("isolation", "?"),
            "origin": run.origin, "key_id": run.key_id, "sealed": run.sealed, "crossings": len(df),
            "per_door": per_door, "allowed": decisions.get("allow", 0), "denied": decisions.get("deny", 0),
            "flagged": flagged, "end_reason": run.box.get("end_reason", ""), "environment": environment_line(run)}


def environment_line(run: Run) -> str:
    """What the box ran, in one line (environment.summary), as the box.start committed to it."""
    from tkbox_nb.bundle.environment import summary as env_summary
    try:
        m = run.environment_manifest()
    except TkboxError as e:
        return f"unreadable: {e}"
    from tkbox_nb.bundle.installs import rows, summary as installs_summary
    during = installs_summary(rows(run.crossings()))
    line = "not recorded (a run made before tkbox recorded environments)" if m is None else env_summary(m)
    return f"{line}; {during}" if during else line


def summary_html(s: dict[str, Any]) -> str:
    doors = ", ".join(f"{_esc(d)} {n}" for d, n in sorted(s["per_door"].items()))
    state = "sealed (run closed)" if s["sealed"] else "OPEN (a snapshot of a running box)"
    return (f"<div class='tkbox-summary'><b>run</b> <code>{_esc(s['run_id'])}</code> · <b>box</b> "
            f"{_esc(s['backend'])} ({_esc(s['isolation'])}) · <b>{_esc(state)}</b><br>"
            f"<b>environment</b> {_esc(s['environment'])}<br>"
            f"<b>signed by</b> {_esc(s['origin'])} · key <code>{_esc(s['key_id'][:23])}</code><br>"
            f"<b>{s['crossings']} crossings</b>: {doors} · <span style='color:{DOOR_COLORS['allow']}'>"
            f"{s['allowed']} allowed</span> · <span style='color:{DOOR_COLORS['deny']}'>{s['denied']} denied</span>"
            f" · {s['flagged']} flagged" + (f"<br><b>ended</b>: {_esc(s['end_reason'])}" if s["end_reason"] else "")
            + "</div>")


def timeline_svg(df, width: int = 720, row: int = 18, table: tuple[Door, ...] = TABLE) -> str:
    """Crossings per door over the run's time: one row per door of `table` (named by its label), one tick per
    crossing, refusals red."""
    labels = {d.name: d.label for d in table}
    doors = [d for d in labels if (df["door"] == d).any()] or [BOX]
    height = row * len(doors) + 24
    if len(df):
        t0, t1 = df["time"].min(), df["time"].max()
        span = max((t1 - t0).total_seconds(), 1e-6)
    parts = [f"<svg class='tkbox-timeline' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"]
    for i, door in enumerate(doors):
        y = i * row + 4
        parts.append(f"<text x='0' y='{y + 12}' font-size='11'>{_esc(labels.get(door, door))}</text>")
        parts.append(f"<line x1='60' x2='{width - 5}' y1='{y + 8}' y2='{y + 8}' stroke='#ddd'/>")
    step = max(1, len(df) // 4000)  # at most ~4000 ticks; refusals are always drawn
    for k, r in enumerate(df.itertuples(index=False)):
        if k % step and r.decision == "allow":
            continue
        x = 60 + (width - 70) * ((r.time - t0).total_seconds() / span)
        y = doors.index(r.door) * row + 4 if r.door in doors else 0
        color = DOOR_COLORS.get(str(r.decision), "#555")
        parts.append(f"<rect x='{x:.1f}' y='{y + 2}' width='2' height='12' fill='{color}'>"
                     f"<title>{_esc(r.seq)} {_esc(r.door)} {_esc(r.decision)}</title></rect>")
    if len(df):
        parts.append(f"<text x='60' y='{height - 4}' font-size='10'>{_esc(t0.isoformat())}</text>")
        parts.append(f"<text x='{width - 5}' y='{height - 4}' font-size='10' text-anchor='end'>"
                     f"+{span:.1f}s</text>")
    parts.append("</svg>")
    return "".join(parts)


def table_html(rows, status: dict[int, str] | None = None) -> str:
    cols = ["seq", "time", "door", "kind", "decision", "rule_ids", "status", "summary"]
    head = "".join(f"<th>{c}</th>" for c in cols) + ("<th>verified</th>" if status is not None else "")
    body = []
    for r in rows.itertuples(index=False):
        color = DOOR_COLORS.get(str(r.decision), "inherit")
        cells = [_esc(r.seq), _esc(r.time.strftime("%H:%M:%S.%f")[:-3]), _esc(r.door), _esc(r.kind),
                 f"<span style='color:{color}'>{_esc(r.decision)}</span>", _esc(r.rule_ids), _esc(r.status),
                 _esc(r.summary)]
        if status is not None:
            verdict = status.get(int(r.seq), "")
            mark = "✔ valid" if verdict == "valid" else f"✘ {verdict}" if verdict else ""
            cells.append(f"<span class='tkbox-verified' style='color:{'#2e7d32' if verdict == 'valid' else '#c62828'}'"
                         f">{_esc(mark)}</span>")
        body.append(f"<tr data-seq='{_esc(r.seq)}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<table class='tkbox-table' style='font-size:12px'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def static_html(run: Run) -> str:
    df = run.to_dataframe()
    more = f"<p>… {len(df) - STATIC_ROWS} more crossings (tkbox show)</p>" if len(df) > STATIC_ROWS else ""
    return summary_html(summary(run)) + timeline_svg(df) + table_html(df.head(STATIC_ROWS)) + more


class RunView:
    """The view's state over one run (plain Python) and, when ipywidgets is there, its widgets."""

    def __init__(self, run: Run | str | Path, page_size: int = PAGE_SIZE, trust: str | Path | None = None):
        self.run = run if isinstance(run, Run) else open_run(run)
        self.trust = trust
        self.df = self.run.to_dataframe()
        self._crossings = {c.seq: c for c in self.run.crossings()}
        self.page_size = page_size
        self.door: str = "all"
        self.decision: str = "all"
        self.text: str = ""
        self.sort_by: str = "seq"
        self.ascending: bool = True
        self.page: int = 0
        self.selected: int | None = None
        self.report = None
        self.verifying = False
        self.row_status: dict[int, str] | None = None
        self.widget = None

    # -- state ---------------------------------------------------------------------------------------------------
    def filtered(self):
        df = self.df
        if self.door != "all":
            df = df[df["door"] == self.door]
        if self.decision != "all":
            df = df[df["decision"] == self.decision]
        if self.text:
            needle = self.text.lower()
            hay = (df["summary"].fillna("") + " " + df["rule_ids"].fillna("") + " " + df["kind"].fillna("")).str.lower()
            df = df[hay.str.contains(needle, regex=False)]
        return df.sort_values(self.sort_by, ascending=self.ascending, kind="stable")

    @property
    def pages(self) -> int:
        return max(1, -(-len(self.filtered()) // self.page_size))

    def page_rows(self):
        self.page = min(max(self.page, 0), self.pages - 1)
        start = self.page * self.page_size
        return self.filtered().iloc[start:start + self.page_size]

    def details(self, seq: int) -> dict[str, Any]:
        """The selected crossing: its signed records, decoded, and the content it discloses."""
        c = self._crossings[seq]
        records = [e for e in self.run.records if e.get("run_seq") in (c.seq, c.result_seq)]
        content = {}
        for where in (c.args or {}, c.result or {}):
            for key, ref in where.items():
                if isinstance(ref, str) and ref.startswith("sha256:") and self.run.content(ref) is not None:
                    content[key] = self.run.content(ref).decode("utf-8", "replace")
        return {"seq": c.seq, "tool": c.tool, "decision": c.decision, "rule_ids": c.rule_ids, "args": c.args,
                "result": c.result, "records": records, "content": content}

    def verify(self, on_done=None, background: bool = True) -> threading.Thread | None:
        """Run `tkbox verify` on the bundle (in a thread unless `background` is False)."""
        def work():
            from tkbox_nb.bundle.verify_report import EXIT_UNREADABLE, VerifyReport
            try:
                report = self.run.verify(self.trust)
            except Exception as e:  # a thread that died would leave the button disabled and the rows unchecked
                report = VerifyReport(path=str(self.run.path), exit_code=EXIT_UNREADABLE)
                report.add("verify", False, f"{type(e).__name__}: {str(e)[:200]}")
            self.apply_report(report)
            if on_done is not None:
                on_done(report)
        self.verifying = True
        if not background:
            work()
            return None
        t = threading.Thread(target=work, daemon=True, name="tkbox-verify")
        t.start()
        return t

    def apply_report(self, report) -> None:
        """Each row valid, or the check that failed for its decision or its result record. When Tracekit's own
        verification of the records failed, or a check of the whole bundle (its manifest, its content items), no row
        can be called valid: each carries that failure."""
        self.report = report
        tracekit = next((c for c in report.checks if not c.ok and (c.name in ("tracekit", "bundle readable", "trust")
                                                                   or not c.detail.startswith("record "))), None)
        status = {}
        for seq, c in self._crossings.items():
            if tracekit is not None:
                status[seq] = f"{tracekit.name}: {tracekit.detail}"[:200]
                continue
            marks = [report.record_status.get(s) for s in (seq, c.result_seq) if s is not None]
            status[seq] = next((m for m in marks if m != "valid"), "valid") or "not checked"
        self.row_status = status
        self.verifying = False

    # -- widgets -------------------------------------------------------------------------------------------------
    def build(self):
        import ipywidgets as w
        present = [d for d in DOORS if (self.df["door"] == d).any()]
        self.w_summary = w.HTML(summary_html(summary(self.run)))
        self.w_timeline = w.HTML(timeline_svg(self.df))
        self.w_door = w.Dropdown(options=["all", *present], value="all", description="door")
        self.w_decision = w.Dropdown(options=["all", "allow", "deny"], value="all", description="decision")
        self.w_text = w.Text(placeholder="text in summary, rule or kind", description="filter")
        self.w_sort = w.Dropdown(options=["seq", "time", "door", "decision", "status"], value="seq",
                                 description="sort")
        self.w_desc = w.ToggleButton(value=False, description="descending")
        self.w_prev = w.Button(description="◀", layout=w.Layout(width="40px"))
        self.w_next = w.Button(description="▶", layout=w.Layout(width="40px"))
        self.w_page = w.Label()
        self.w_table = w.HTML()
        self.w_select = w.Dropdown(description="details", options=[])
        self.w_details = w.HTML()
        self.w_verify = w.Button(description="Verify", button_style="primary", icon="check")
        self.w_progress = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="160px", visibility="hidden"))
        self.w_verdict = w.HTML()
        for widget in (self.w_door, self.w_decision, self.w_text, self.w_sort, self.w_desc):
            widget.observe(self._on_filter, names="value")
        self.w_prev.on_click(lambda _: self._turn(-1))
        self.w_next.on_click(lambda _: self._turn(1))
        self.w_select.observe(self._on_select, names="value")
        self.w_verify.on_click(lambda _: self._on_verify())
        self.widget = _view_box([
            self.w_summary, self.w_timeline,
            w.HBox([self.w_door, self.w_decision, self.w_text]),
            w.HBox([self.w_sort, self.w_desc, self.w_prev, self.w_page, self.w_next]),
            self.w_table, w.HBox([self.w_verify, self.w_progress, self.w_verdict]), self.w_select, self.w_details])
        self.widget.static = static_html(self.run)
        self.widget.view = self
        self.render()
        return self.widget

    def render(self) -> None:
        if self.widget is None:
            return
        rows = self.page_rows()
        self.w_table.value = table_html(rows, self.row_status)
        self.w_page.value = f"page {self.page + 1} of {self.pages} ({len(self.filtered())} rows)"
        options = [(f"{r.seq} · {r.door} · {r.decision} · {str(r.summary)[:60]}", int(r.seq))
                   for r in rows.itertuples(index=False)]
        self.w_select.options = options
        if self.report is not None:
            color = "#2e7d32" if self.report.valid else "#c62828"
            self.w_verdict.value = (f"<span class='tkbox-verdict' style='color:{color}'>"
                                    f"<b>{_esc(self.report.summary())}</b></span>")

    def _on_filter(self, change) -> None:
        self.door, self.decision, self.text = self.w_door.value, self.w_decision.value, self.w_text.value.strip()
        self.sort_by, self.ascending = self.w_sort.value, not self.w_desc.value
        self.page = 0
        self.render()

    def _turn(self, step: int) -> None:
        self.page += step
        self.render()

    def _on_select(self, change) -> None:
        if change["new"] is None:
            self.w_details.value = ""
            return
        d = self.details(change["new"])
        blocks = [f"<b>crossing {d['seq']}</b>: {_esc(d['tool'])} → {_esc(d['decision'])} "
                  f"{_esc(', '.join(d['rule_ids']))}"]
        for key, text in d["content"].items():
            blocks.append(f"<div><b>{_esc(key)}</b><pre>{_esc(text[:20000])}</pre></div>")
        blocks.append(f"<details><summary>disclosed arguments and result</summary><pre>"
                      f"{_esc(json.dumps({'args': d['args'], 'result': d['result']}, indent=1))}</pre></details>")
        blocks.append(f"<details><summary>signed records</summary><pre>"
                      f"{_esc(json.dumps(d['records'], indent=1))}</pre></details>")
        self.w_details.value = "".join(blocks)

    def _on_verify(self) -> None:
        self.w_verify.disabled = True
        self.w_progress.layout.visibility = "visible"
        self.w_progress.bar_style, self.w_progress.value = "info", 0
        self.w_verdict.value = "verifying…"

        def done(report):
            self.w_progress.value = 1
            self.w_progress.bar_style = "success" if report.valid else "danger"
            self.w_verify.disabled = False
            self.render()
        self.verify(on_done=done)


_view_box_cls = None


def _view_box(children):
    """The view's VBox (a class made on first use, so that ipywidgets is imported only where a view is built);
    its display also carries the static HTML, for places without widgets."""
    global _view_box_cls
    if _view_box_cls is None:
        import ipywidgets as w

        class ViewBox(w.VBox):
            static = ""
            view = None

            def _repr_mimebundle_(self, **kwargs):
                bundle = super()._repr_mimebundle_(**kwargs)
                if isinstance(bundle, tuple):
                    bundle = bundle[0]
                return {**(bundle or {}), "text/html": self.static}
        _view_box_cls = ViewBox
    return _view_box_cls(children)


def view(run_or_path: Run | str | Path, trust: str | Path | None = None, page_size: int = PAGE_SIZE):
    """The widget view of one run (display it, or leave it last in a cell)."""
    return RunView(run_or_path, page_size=page_size, trust=trust).build()


def display_run(run: Run) -> None:
    """How a Run left last in a cell shows (`Run._ipython_display_`, handed in by tkbox_nb/__init__.py): in a kernel
    with widgets, the interactive view; elsewhere the static HTML."""
    from IPython.display import HTML, display
    try:
        display(view(run))
    except ImportError:
        display(HTML(static_html(run)))
