"""The audit's report a researcher reads (`tkbox audit`'s terminal table and `--html`), and what explains it.

Why: the report showed a changed cell as two whole cells prefixed `allow:`, outputs as JSON lists, a DataFrame as
a diff of `<td>` lines and a plot as two digests. Now each difference is shown by what it is:
- a cell's code as a unified diff (and its decision, when that differs);
- text outputs (streams, `text/plain`, JSON, a command's stdout and stderr) as line diffs;
- an HTML table (a DataFrame) by the cells that changed: row, column, A, B;
- an image by its pixels (size, pixels that differ, the largest channel difference; Pillow, when it is there);
- a patched file by its path.
And where a cell's code is equal but its results differ, what else differed between the runs comes first, each as one
line, from what the bundles carry: the backend, the isolation, the image digest, the starting policy, the
starting workspace and which physical GPUs (by UUID) the boxes were given (`explain`). A difference in the GPUs'
models, count, driver or CUDA driver version is a difference of its own (`GPUs`, rules/gpu_record.py).

Everything rendered came from a box: each value is cut to MAX_RENDER characters (and MAX_LINES lines) before it is
diffed or parsed, a diff to DIFF_LINES lines, a table to MAX_CELLS cells; the HTML report escapes all of it.
"""

from __future__ import annotations

import difflib
import html
import json
from html.parser import HTMLParser
from typing import Any

from tkbox_nb.audit.door_items import SECTION
from tkbox_nb.rules.door_table import BOX, PACKAGES, PATCH

MAX_RENDER = 200_000
DIFF_LINES = 40
MAX_LINES = 2000
MAX_CELLS = 20_000
MAX_CHANGED = 20
CONTEXT = ("backend", "isolation", "image_digest", "tkbox_version")


def _diff(a: str, b: str, name: str = "") -> list[str]:
    """A unified diff of the first MAX_LINES lines of each (difflib is quadratic in lines at worst), cut short."""
    la, lb = a[:MAX_RENDER].splitlines(), b[:MAX_RENDER].splitlines()
    more = len(la) > MAX_LINES or len(lb) > MAX_LINES
    lines = list(difflib.unified_diff(la[:MAX_LINES], lb[:MAX_LINES], f"A {name}".strip(), f"B {name}".strip(), n=1,
                                      lineterm=""))
    cut = [line[:200] for line in lines[:DIFF_LINES]]
    return cut + ([f"... ({len(lines) - DIFF_LINES} more diff lines)"] if len(lines) > DIFF_LINES else []) + \
        ([f"(the first {MAX_LINES} lines of each diffed)"] if more else [])


class _Tables(HTMLParser):
    """The cells' text of every <table>: a list of tables, each a list of rows, each a list of cell texts."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[list[list[str]]] = []
        self.cell: list[str] | None = None
        self.count = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1] and self.count < MAX_CELLS:
            self.cell, self.count = [], self.count + 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.cell is not None and self.tables and self.tables[-1]:
            self.tables[-1][-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)


def tables(text: str) -> list[list[list[str]]]:
    p = _Tables()
    p.feed(text[:MAX_RENDER])
    p.close()
    return p.tables


def table_changes(a: str, b: str) -> list[str] | None:
    """An HTML table's changed cells, as `row R, column C: A -> B` lines; None when either is no table or their
    shapes differ (then a line diff shows it)."""
    ta, tb = tables(a), tables(b)
    if not ta or len(ta) != len(tb) or any(len(x) != len(y) for x, y in zip(ta, tb)):
        return None
    out = []
    for xa, xb in zip(ta, tb):
        header = xa[0] if xa else []
        for r, (ra, rb) in enumerate(zip(xa, xb)):
            if len(ra) != len(rb):
                return None
            for c, (ca, cb) in enumerate(zip(ra, rb)):
                if ca != cb:
                    row = ra[0] if ra and c else str(r)
                    col = header[c] if c < len(header) and header[c] else f"#{c}"
                    out.append(f"row {row}, column {col}: A {ca!r}, B {cb!r}")
    return out[:MAX_CHANGED] + ([f"... ({len(out) - MAX_CHANGED} more changed cells)"] if len(out) > MAX_CHANGED
                                else [])


def _text(v: Any) -> str:
    return "".join(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else json.dumps(v)


def _outputs(a: list, b: list) -> list[str]:
    """The differing outputs of one cell, output by output, each MIME value by what it is."""
    lines = []
    if len(a) != len(b):
        lines.append(f"{len(a)} output(s) in A, {len(b)} in B")
    for i in range(max(len(a), len(b))):
        oa, ob = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if oa == ob:
            continue
        if oa is None or ob is None or not isinstance(oa, list) or not isinstance(ob, list) or oa[:1] != ob[:1]:
            lines.append(f"output {i + 1}: A {json.dumps(oa)[:200]}, B {json.dumps(ob)[:200]}")
            continue
        kind = str(oa[0])
        if kind == "error" or len(oa) < 2:
            lines.append(f"output {i + 1} ({kind}): A {json.dumps(oa[1:])[:200]}, B {json.dumps(ob[1:])[:200]}")
        elif isinstance(oa[1], dict) and isinstance(ob[1], dict):
            for mime in sorted(set(oa[1]) | set(ob[1])):
                va, vb = oa[1].get(mime), ob[1].get(mime)
                if va == vb:
                    continue
                where = f"output {i + 1} ({kind}) {mime}"
                if va is None or vb is None:
                    lines.append(f"{where}: only in {'B' if va is None else 'A'}")
                elif isinstance(va, str) or isinstance(vb, str):  # binary, by digest (pixels in the detail)
                    lines.append(f"{where}: A {str(va)[:90]}, B {str(vb)[:90]}")
                else:
                    changed = table_changes(_text(va), _text(vb)) if mime == "text/html" else None
                    if changed is not None and changed:
                        lines += [f"{where}, table cells that changed:"] + [f"  {c}" for c in changed]
                    elif not (mime == "text/plain" and "text/html" in oa[1] and "text/html" in ob[1] and
                              table_changes(_text(oa[1]["text/html"]), _text(ob[1]["text/html"]))):
                        lines += [f"{where}:"] + _diff(_text(va), _text(vb))
        else:  # a stream: its lines
            lines += [f"output {i + 1} ({kind}):"] + _diff(_text(oa[1]), _text(ob[1]))
    return lines


def readable(d) -> list[str]:
    """One difference (audit.Difference) as lines a person reads; [] when its A and B lines say it best."""
    va, vb = d.value_a or d.a, d.value_b or d.b
    if d.kind == "cell code":
        da, _, ca = va.partition(": ")
        db, _, cb = vb.partition(": ")
        return ([f"decision: A {da}, B {db}"] if da != db else []) + _diff(ca, cb, "code")
    if d.kind == "cell outputs":
        try:
            return _outputs(json.loads(va), json.loads(vb))
        except ValueError:
            return _diff(va, vb)
    if d.kind in ("command stdout", "command stderr", "cell user_expressions"):
        return _diff(va, vb)
    if d.kind == "environment":
        from tkbox_nb.audit.packages import environment_changes
        return environment_changes(va, vb)
    if d.kind == "GPUs":
        from tkbox_nb.rules.gpu_record import changes
        return changes(va, vb)
    if d.kind == SECTION[PACKAGES]:
        from tkbox_nb.audit.packages import package_changes
        return package_changes(d.value_a, d.value_b)
    if d.kind == SECTION[PATCH]:
        return [f"file {_path(va) or _path(vb)}: A {d.a[:160]}, B {d.b[:160]}"]
    return []


def _path(value: str) -> str:
    parts = value.split(" ")
    return parts[1] if len(parts) > 1 else ""


def explain(ra, rb) -> list[str]:
    """What else differed between the two runs, one line each, from what their bundles carry: the backend, the
    isolation, the image, the tkbox version, the starting policy, the starting workspace, the GPUs' UUIDs."""
    lines = []
    for key in CONTEXT:
        xa, xb = str(ra.box.get(key, "?")), str(rb.box.get(key, "?"))
        if xa != xb:
            lines.append(f"{key.replace('_', ' ')}: {xa[:100]} in A, {xb[:100]} in B")
    pa = ra.box.get("policy") if isinstance(ra.box.get("policy"), dict) else {}
    pb = rb.box.get("policy") if isinstance(rb.box.get("policy"), dict) else {}
    if pa.get("hash") != pb.get("hash"):
        lines.append(f"starting policy: {str(pa.get('name'))[:60]} ({str(pa.get('hash'))[:19]}) in A, "
                     f"{str(pb.get('name'))[:60]} ({str(pb.get('hash'))[:19]}) in B")
    wa, wb = _workspace(ra), _workspace(rb)
    if wa != wb:
        lines.append(f"starting workspace: {wa[:80]} in A, {wb[:80]} in B")
    from tkbox_nb.rules.gpu_record import uuid_change
    other_gpus = uuid_change(ra.box.get("gpus"), rb.box.get("gpus"))  # other physical GPUs: context, not compared
    return lines + ([other_gpus[:400]] if other_gpus else [])


def _workspace(run) -> str:
    start = next((c for c in run.crossings() if c.door == BOX and (c.args or {}).get("kind") == "start"), None)
    return str(((start.args if start else None) or {}).get("workspace_digest") or "none (empty)")


def results_differ_with_equal_code(differences: list) -> bool:
    """Some cell's or command's results differ while no code or argv does: then what else differed comes first."""
    kinds = {d.kind for d in differences}
    return bool(kinds & {"cell outputs", "cell user_expressions", "command stdout", "command stderr",
                         "command exit status"}) and not kinds & {"cell code", "command argv", "exec"}


def _seq(seq: int | None) -> str:
    return "-" if seq is None else str(seq)


def table(report) -> str:
    """The terminal report of an audit.Audit."""
    if report.status == "incomparable":
        return (f"INCOMPARABLE: {report.a} and {report.b} have no cell, command, egress, secret, host magic, model "
                f"call or patch file to compare (only the box's own start and stop): not called equivalent\n"
                f"  {report.covered()}")
    if report.equivalent:
        return f"EQUIVALENT: {report.a} and {report.b}\n  {report.covered()}"
    lines = [f"DIFFERENT: {len(report.differences)} difference(s) between {report.a} and {report.b}",
             f"  {report.covered()}"]
    if report.explained:
        lines.append("  the code is the same; what else differed:" if results_differ_with_equal_code(
            report.differences) else "  what else differed:")
        lines += [f"    {line}" for line in report.explained]
    for d in report.differences:
        lines.append(f"  {d.what} (seq {_seq(d.seq_a)} in A, {_seq(d.seq_b)} in B)")
        shown = readable(d)
        if shown:
            lines += [f"    {line}" for line in shown]
        else:
            show = (lambda t: json.dumps(t[:200])) if d.kind in ("command stdout", "command stderr") else \
                (lambda t: t[:200])  # output as a quoted string: a newline or trailing space is seen
            lines.append(f"    A: {show(d.a)}\n    B: {show(d.b)}")
            if d.diff:
                lines.append("    " + d.diff.replace("\n", "\n    "))
        lines.extend(f"    {note}" for note in d.detail)
    return "\n".join(lines)


def page(report) -> str:
    """The self-contained HTML report of an audit.Audit (every value escaped)."""
    e = html.escape
    rows = []
    for d in report.differences:
        shown = readable(d) or [f"A: {d.a}", f"B: {d.b}"] + ([d.diff] if d.diff else [])
        body = "\n".join(shown + d.detail)
        body = "\n".join(f"<span class='{'add' if x.startswith('+') else 'del' if x.startswith('-') else ''}'>"
                         f"{e(x)}</span>" for x in body.splitlines())
        rows.append(f"<tr><td>{e(d.what)}</td><td>{_seq(d.seq_a)}</td><td>{_seq(d.seq_b)}</td>"
                    f"<td><pre>{body}</pre></td></tr>")
    verdict = report.status if not report.differences else f"{len(report.differences)} difference(s)"
    context = "".join(f"<li>{e(x)}</li>" for x in report.explained)
    return (f"<!doctype html><meta charset='utf-8'><title>tkbox audit</title><style>body{{font-family:sans-serif}}"
            f"td,th{{border:1px solid #ccc;padding:4px;vertical-align:top}}table{{border-collapse:collapse}}"
            f".add{{color:#070}}.del{{color:#a00}}</style><h1>tkbox audit: {e(verdict)}</h1>"
            f"<p>A: {e(report.a)}<br>B: {e(report.b)}</p><p>{e(report.covered())}</p>"
            + (f"<h2>What else differed</h2><ul>{context}</ul>" if context else "")
            + f"<table><tr><th>what</th><th>seq A</th><th>seq B</th><th>difference</th></tr>{''.join(rows)}</table>")


def mount_files(ra: Any, rb: Any) -> str:
    """The files that differ between two runs' mounts of one name (their disclosed lists), for the audit."""
    from tkbox_nb.bundle.mount_digest import differing, parse_list
    out = []
    for name in sorted({n for r in (ra, rb) for n in r._b.files if n.startswith("box/mounts/")}):
        try:
            la, lb = (parse_list(r._b.files.get(name, b"")) for r in (ra, rb))
        except (ValueError, UnicodeError, RecursionError):
            continue
        files = differing(la, lb)
        if files:
            out.append(f"{name[len('box/mounts/'):-len('.jsonl')]}: files that differ: {', '.join(files)}")
    return "\n".join(out)
