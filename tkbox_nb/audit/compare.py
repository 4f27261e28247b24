"""Two runs compared (`tkbox audit`), door by door, after sanitizing volatile values.

What is compared, each in run order and each difference naming the crossing's record number (seq) in both runs:
- the box: the policy it started with (by hash) and the workspace it started from (by digest, when it had one);
- the exec door, cells and commands interleaved as they were decided: a cell's code, its outputs (its late outputs,
  signed after its end, appended; consecutive chunks of one stream merged, every MIME value of a display or result:
  text sanitized, binary data by digest) and its user_expressions (each name, expression and result); a
  command's argv, working directory, the names of the environment it set (never values), its stdin (by digest),
  timeout, exit status (or the kill, or the end of the box under it), stdout and stderr (sanitized like cell outputs;
  by digest with a short diff when large);
- egress destinations and decisions, secrets used (names only), host magics, model calls (request and response by
  digest), and the patch (each file's last decision and content digest, by path).

Counted and named in the coverage line but not compared (NOT_COMPARED): the host magics a rerun does not make again
(replay.RERUN_SKIPS: %box_bundle, %box_view, %box_restart, %box_secret), and the exec door's comm messages (widget
messages from a frontend, and the faults refused among them): a rerun has no frontend to send them, so comparing them
would call every honest rerun of a notebook that used a widget different; and the counts of refusals a door signed
past `[box] max_refusals` (signing/refusal_caps.py): how a flood's refusals split between counts depends on timing.

The verdict is `equivalent`, `different`, or `incomparable` when neither run has any crossing of these doors (only
the box's own start and stop): such a pair is not called equivalent (exit 3, see EXIT_*).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tkbox_nb.audit.conventions import IGNORE, SKIP, marks
from tkbox_nb.audit.conventions import describe as describe_marks
from tkbox_nb.audit.tolerance import Tolerance, image_lookup
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.audit.replay import RERUN_SKIPS, _outputs, late_outputs, user_expressions
from tkbox_nb.bundle.read_back import Crossing, Run, open_run

EXIT_EQUIVALENT, EXIT_DIFFERENT, EXIT_INCOMPARABLE = 0, 1, 3
LARGE = 400  # a sanitized stdout, stderr or outputs longer than this is shown by digest with a short diff
MAX_SANITIZER_BYTES = 1 << 20  # a sanitizer file is a few patterns: a larger one (or no regular file) is refused
DIFF_LINES = 12
# volatile values, replaced before outputs are compared (nbval-style); a sanitizer file adds (regex, replacement)
SANITIZERS: list[tuple[str, str]] = [
    (r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?\b", "<TIMESTAMP>"),
    (r"\b0x[0-9a-fA-F]{6,16}\b", "<ADDRESS>"),
    (r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<UUID>"),
    (r"\b[0-9a-f]{32}\b", "<ID>"),
    (r"tkbox-ph-[0-9a-f]{32}", "<PLACEHOLDER>"),
]
# the doors compared, as (label, what one crossing of it is called): the coverage line counts these
DOORS = ("exec cells", "exec commands", "egress", "secrets", "host magics", "model calls", "patch files",
         "package files")
# crossings counted but not compared (see the module's docstring), each named by what it is
NOT_COMPARED = ("host magics a rerun skips (" + ", ".join("%" + m for m in RERUN_SKIPS) + ")",
                "comm messages (widgets, from a frontend)", "refusal counts (past [box] max_refusals)")


@dataclass
class Difference:
    what: str  # the field and its position in its door, e.g. "command stdout #2"
    a: str
    b: str
    kind: str = ""  # the field alone, e.g. "command stdout"
    seq_a: int | None = None  # the crossing's decision record in each run (None: the run has no such crossing)
    seq_b: int | None = None
    diff: str = ""  # a short unified diff, for large texts
    detail: list[str] = field(default_factory=list)  # how they differ, where measured (an image's pixels)
    value_a: str = field(default="", repr=False)  # the compared values whole, for the readable report
    value_b: str = field(default="", repr=False)


@dataclass
class Audit:
    a: str
    b: str
    differences: list[Difference] = field(default_factory=list)
    coverage: dict[str, tuple[int, int]] = field(default_factory=dict)
    not_compared: dict[str, tuple[int, int]] = field(default_factory=dict)
    tolerance: Tolerance = field(default_factory=Tolerance)
    marks: dict[str, tuple[int, int]] = field(default_factory=dict)  # nbval marks: cells per mark in A/B
    explained: list[str] = field(default_factory=list)  # what else differed between the runs (audit_report.explain)

    @property
    def status(self) -> str:
        if self.differences:
            return "different"
        return "equivalent" if any(na or nb for na, nb in self.coverage.values()) else "incomparable"

    @property
    def equivalent(self) -> bool:
        return self.status == "equivalent"

    @property
    def exit_code(self) -> int:
        return {"equivalent": EXIT_EQUIVALENT, "different": EXIT_DIFFERENT}.get(self.status, EXIT_INCOMPARABLE)

    def covered(self) -> str:
        doors = ", ".join(f"{d} {na}/{nb}" for d, (na, nb) in self.coverage.items())
        left = ", ".join(f"{d} {na}/{nb}" for d, (na, nb) in self.not_compared.items())
        nbval = describe_marks(self.marks)
        return f"compared (crossings in A/B): {doors}; the starting policy, workspace and mounts" + \
            (f"; not compared: {left}" if left else "") + (f"; {nbval}" if nbval else "") + \
            f"; tolerance: {self.tolerance.describe()}"

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "status": self.status, "equivalent": self.equivalent,
                "coverage": {d: {"a": na, "b": nb} for d, (na, nb) in self.coverage.items()},
                "not_compared": {d: {"a": na, "b": nb} for d, (na, nb) in self.not_compared.items()},
                "tolerance": self.tolerance.as_dict(), "nbval_marks": {m: {"a": na, "b": nb} for m, (na, nb)
                                                                       in self.marks.items()},
                "explained": self.explained, "differences": [self._shown(d) for d in self.differences]}

    @staticmethod
    def _shown(d: Difference) -> dict:
        from tkbox_nb.audit.report import readable
        out = {k: v for k, v in asdict(d).items() if k not in ("value_a", "value_b")}
        return dict(out, readable=readable(d))

    def table(self) -> str:
        from tkbox_nb.audit.report import table
        return table(self)

    def html(self) -> str:
        from tkbox_nb.audit.report import page
        return page(self)


def _seq(seq: int | None) -> str:
    return "-" if seq is None else str(seq)


def parse_sanitizers(text: str) -> list[tuple[str, str]]:
    """(regex, replacement) pairs from a sanitizer file: one `REGEX<TAB>REPLACEMENT` a line, `#` comments. Pure."""
    extra = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            pattern, _, repl = line.partition("\t")
            repl = repl or "<SANITIZED>"
            try:
                re.compile(pattern).sub(repl, "")  # the replacement's escapes and group references are read here
            except (re.error, IndexError) as e:
                raise TkboxError(f"{line[:80]!r}: {e}") from None
            extra.append((pattern, repl))
    return extra


def _sanitize(text: str, extra: list[tuple[str, str]]) -> str:
    for pattern, repl in SANITIZERS + extra:
        text = re.sub(pattern, repl, text)
    return text


@dataclass
class Item:
    """One compared crossing: its seq and its fields in order, label -> (compared value, shown value)."""

    seq: int | None
    kind: str  # cell | command | egress | ...
    fields: dict[str, tuple[str, str]]
    marks: frozenset[str] = frozenset()  # a cell's nbval marks (audit_conventions): its outputs not compared


def _field(value: str, large: bool = False) -> tuple[str, str]:
    if not large or len(value) <= LARGE:
        return value, value
    return value, f"sha256:{hashlib.sha256(value.encode('utf-8', 'replace')).hexdigest()[:16]} ({len(value)} chars)"


def _workspace(digest: Any) -> tuple[str, str]:
    """The starting workspace's digest, compared whole; one of version 1 (before tree2) is named as such, since it
    never equals a version-2 digest of the same tree."""
    if not digest:
        return _field("none (the box started with an empty workspace)")
    from tkbox_nb.core.tree_digest import digest_version
    return str(digest), f"{digest} (tree digest version 1)" if digest_version(digest) == 1 else str(digest)


def _mounts(run: Run, start: Crossing | None) -> dict[str, tuple[str, str]]:
    """The dataset mounts, compared by digest (each name, target and digest), and the mounts whose files changed
    while the box ran (signed by its stop); "none" for a run without mounts."""
    signed = ((start.args if start else None) or {}).get("mounts")
    stop = next((c for c in run.crossings() if c.door == "box" and (c.args or {}).get("kind") == "stop"), None)
    changed = ((stop.args if stop else None) or {}).get("mounts_changed")
    signed = signed if isinstance(signed, dict) else {}
    shown = "; ".join(f"{n} at {f.get('target')}: {f.get('digest')}" for n, f in sorted(signed.items())
                      if isinstance(f, dict)) or "none"
    return {"mounts": _field(shown), "mounts changed while the box ran": _field(
        "; ".join(f"{n}: {', '.join(map(str, p))}" for n, p in sorted(changed.items()) if isinstance(p, list))
        if isinstance(changed, dict) and changed else "none")}


def _text(run: Run, digest: Any) -> str:
    return (run.content(digest) or b"").decode("utf-8", "replace") if isinstance(digest, str) else ""


def _expressions(run: Run, c: Crossing, extra: list[tuple[str, str]]) -> str:
    """A cell's user_expressions as compared: each name, its expression and its result (data as cell outputs are
    compared, an error by name and value), in name order."""
    asked, results = user_expressions(run, c)
    if not asked:
        return "(none)"
    out = {}
    for name in sorted(asked):
        r = results.get(name) if isinstance(results.get(name), dict) else {}
        if r.get("status") == "ok":
            data = r.get("data") if isinstance(r.get("data"), dict) else {}
            got: Any = {str(m): _mime_value(str(m), v, extra) for m, v in sorted(data.items())}
        else:
            got = ["error", str(r.get("ename")), _sanitize(str(r.get("evalue")), extra)]
        out[str(name)] = [str(asked[name]), got]
    return json.dumps(out, sort_keys=True)


def _exec_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item | None:
    a, r = c.args or {}, c.result or {}
    if a.get("kind") == "cell":  # its late outputs (signed after its end) compared as outputs of the cell
        outs = _output_items(_outputs(run, r.get("outputs"), late.get(c.seq, [])), extra)
        # compared one text line to a line (so a large one gets a line diff), shown on one line or by digest
        value, shown = json.dumps(outs, indent=0), json.dumps(outs)
        code = _text(run, a.get("code"))
        return Item(c.seq, "cell", {
            "cell code": _field(f"{c.decision}: " + code),
            "cell outputs": (value, shown if len(shown) <= LARGE else _field(shown, large=True)[1]),
            "cell user_expressions": _field(_expressions(run, c, extra), large=True)}, marks(code, a.get("tags")))
    if a.get("kind") != "command":
        return None
    argv = a.get("argv") if isinstance(a.get("argv"), list) else []
    env = a.get("env_names") if isinstance(a.get("env_names"), list) else []
    if c.decision != "allow":
        status = "refused"
    elif c.result is None:  # allowed but never ended: the box ended under it (a timeout, a kill, a lost door)
        status = "no result: the box ended (" + _sanitize(str(run.box.get("end_reason", "")), extra)[:300] + ")"
    else:
        code = r.get("exit_code")
        status = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit {code}"
    stdin = a.get("stdin")
    return Item(c.seq, "command", {
        "command argv": _field(f"{c.decision}: {shlex.join(str(x) for x in argv)}"),
        "command cwd": _field(str(a.get("cwd") or "/workspace (default)")),
        "command environment names": _field(", ".join(str(x) for x in env) or "(none set)"),
        "command stdin": _field(f"{stdin} ({a.get('stdin_size')} bytes)" if stdin else "(none)"),
        "command timeout": _field(f"{a['timeout_s']} s" if "timeout_s" in a else "(the policy's)"),
        "command exit status": _field(status),
        "command stdout": _field(_sanitize(_text(run, r.get("stdout")), extra), large=True),
        "command stderr": _field(_sanitize(_text(run, r.get("stderr")), extra), large=True)})


def _one(seq: int, kind: str, value: str) -> Item:
    return Item(seq, kind, {kind: _field(value)})


def _two(seq: int, kind: str, value: str) -> Item:
    """Compared whole (every digest in full); shown with each digest cut to 12 hex digits."""
    return Item(seq, kind, {kind: (value, re.sub(r"sha256:([0-9a-f]{12})[0-9a-f]{52}", r"\1", value))})


def facts(run: Run, extra: list[tuple[str, str]]) -> dict[str, list[Item]]:
    """What audit compares, per section, each a list of items in run order."""
    out: dict[str, list[Item]] = {k: [] for k in ("box", "exec", "egress", "secrets (names only)", "host magics",
                                                  "model calls", "patch", "packages", *NOT_COMPARED)}
    last_patch: dict[str, Item] = {}
    start = next((c for c in run.crossings() if c.door == "box" and (c.args or {}).get("kind") == "start"), None)
    pol = run.box.get("policy") if isinstance(run.box.get("policy"), dict) else {}
    seq0 = start.seq if start else None
    out["box"] = [Item(seq0, "box", {
        "starting policy": (str(pol.get("hash")), f"{pol.get('hash')} ({pol.get('name')})"),
        "workspace": _workspace(((start.args if start else None) or {}).get("workspace_digest")),
        **_mounts(run, start)})]
    late = late_outputs(run)
    for c in run.crossings():
        a = c.args or {}
        if a.get("kind") == "refused_count":  # how many refusals were counted, not each signed: never compared
            out[NOT_COMPARED[2]].append(_one(c.seq, "refusals", f"{c.door} {a.get('count')}"))
        elif c.door == "exec":
            item = _exec_item(run, c, extra, late)
            if item is not None:
                out["exec"].append(item)
            elif a.get("kind") in ("comm", "comm_fault"):
                out[NOT_COMPARED[1]].append(_one(c.seq, "comm", f"{a.get('kind')} {a.get('msg_type')}"))
        elif c.door == "host" and a.get("magic") in RERUN_SKIPS:
            out[NOT_COMPARED[0]].append(_one(c.seq, "host", f"%{a.get('magic')}"))
        elif c.door == "egress":
            out["egress"].append(_one(c.seq, "egress", f"{a.get('method', '')} {a.get('host')}:{a.get('port')} "
                                                       f"{c.decision} ({a.get('rule')})"))
        elif c.door == "secrets":
            out["secrets (names only)"].append(_one(c.seq, "secrets (names only)",
                                                    f"{a.get('kind')} {a.get('name')} {a.get('host', '')}".strip()))
        elif c.door == "host":  # a %box_policy by the policy it set: its body's digest, the policy then in force
            line = f"%{a.get('magic')} {a.get('line', '')}".strip()
            if a.get("magic") == "box_policy":
                line += f" body {a.get('body') or '(none)'} policy {a.get('policy')}"
            out["host magics"].append(_two(c.seq, "host magics", line))
        elif c.door == "model":  # the call and what came back, by digest (not the mode: a rerun replays)
            r = c.result or {}
            out["model calls"].append(_two(c.seq, "model calls", (
                f"{a.get('provider')}:{a.get('model')} {a.get('endpoint')} {c.decision} ({a.get('rule')}) request "
                f"{a.get('request', '')} response {r.get('response') or r.get('response_digest') or ''}")))
        elif c.door == "packages":  # each project page and file, by name and the sha256 the index gave
            out["packages"].append(_two(c.seq, "packages", " ".join(str(a.get(k, "")) for k in (
                "kind", "project", "filename", "sha256")).strip() + f" {c.decision} ({a.get('rule')})"))
        elif c.door == "patch" and a.get("kind") == "file":  # the last decision per path, order-free
            last_patch[str(a.get("path"))] = _two(c.seq, "patch", " ".join(
                [f"{a.get('op')} {a.get('path')}"] + [f"{k} {a[k]}" for k in ("from", "type", "target") if k in a]
                + ([f"mode {oct(a['mode'])}"] if isinstance(a.get("mode"), int) else [])
                + [f"{c.decision} ({a.get('rule')}) {a.get('content', '')}"]))
    out["patch"] = [last_patch[p] for p in sorted(last_patch)]
    return out


def _facts(run: Run, extra: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The compared values only, per field label (for the fuzz target: reading any bundle never raises)."""
    flat: dict[str, list[str]] = {}
    for items in facts(run, extra).values():
        for item in items:
            for label, (value, _) in item.fields.items():
                flat.setdefault(label, []).append(value)
    return flat


def coverage(f: dict[str, list[Item]]) -> dict[str, int]:
    """Crossings per compared door (DOORS), then per kind counted but not compared (NOT_COMPARED)."""
    exec_kinds = [i.kind for i in f["exec"]]
    return dict(zip(DOORS + NOT_COMPARED, (
        exec_kinds.count("cell"), exec_kinds.count("command"), len(f["egress"]), len(f["secrets (names only)"]),
        len(f["host magics"]), len(f["model calls"]), len(f["patch"]), len(f["packages"]),
        *(len(f[k]) for k in NOT_COMPARED))))


def _is_text(mime: str) -> bool:
    return mime.startswith("text/") or mime.endswith(("json", "xml")) or mime == "application/javascript"


def _mime_value(mime: str, value: Any, extra: list[tuple[str, str]]) -> Any:
    """One MIME value as compared: text sanitized, line by line; anything else (PNG, PDF...) by the digest of its
    bytes (base64, as nbformat holds it), which no sanitizer touches."""
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        value = "".join(value)  # nbformat's multi-line strings
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    if _is_text(mime):
        return _sanitize(text, extra).splitlines(keepends=True)
    try:  # strictly: a lenient decode drops what is not base64, so two different values could compare equal
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (ValueError, TypeError):
        raw = text.encode("utf-8", "surrogatepass")
        return f"not base64, sha256:{hashlib.sha256(raw).hexdigest()} ({len(raw)} bytes)"
    return f"sha256:{hashlib.sha256(raw).hexdigest()} ({len(raw)} bytes)"


def _output_items(outs: list[dict], extra: list[tuple[str, str]]) -> list:
    """What audit compares of a cell's recorded outputs (read leniently: the content is not checked for form):
    consecutive chunks of one stream merged (how output is cut into messages is not the cell's doing), then each
    output's type and every MIME value (_mime_value), or its error's name and value."""
    merged: list[dict] = []
    for o in outs:
        if o.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and str(merged[-1].get("name")) == str(o.get("name")):
            merged[-1] = {**merged[-1], "text": str(merged[-1].get("text")) + str(o.get("text"))}
        else:
            merged.append(o)
    items: list = []
    for o in merged:
        t = o.get("output_type")
        if t == "stream":
            items.append([str(o.get("name")), _sanitize(str(o.get("text")), extra).splitlines(keepends=True)])
        elif t == "error":
            items.append(["error", str(o.get("ename")), _sanitize(str(o.get("evalue")), extra)])
        else:
            data = o.get("data") if isinstance(o.get("data"), dict) else {}
            items.append([t, {str(m): _mime_value(str(m), v, extra) for m, v in sorted(data.items())}])
    return items


def _short_diff(a: str, b: str) -> str:
    lines = list(difflib.unified_diff(a.splitlines(), b.splitlines(), "A", "B", n=1, lineterm=""))
    cut = [line[:160] for line in lines[:DIFF_LINES]]
    return "\n".join(cut + ([f"... ({len(lines) - DIFF_LINES} more diff lines)"] if len(lines) > DIFF_LINES else []))


def compare(fa: dict[str, list[Item]], fb: dict[str, list[Item]], tolerance: Tolerance | None = None) \
        -> list[Difference]:
    """The differences of two runs' facts, section by section, item by item in order, within the tolerance (which
    notes how images differed); a cell with an nbval mark in either run has only its code compared. Pure but for
    the images the tolerance decodes."""
    diffs = []
    for section in fa:
        xa, xb = fa[section], fb[section]
        pos = (lambda i: "") if section == "box" else (lambda i: f" #{i + 1}")
        for i in range(max(len(xa), len(xb))):
            ia = xa[i] if i < len(xa) else None
            ib = xb[i] if i < len(xb) else None
            sa, sb = (ia.seq if ia else None), (ib.seq if ib else None)
            if ia is None or ib is None or ia.kind != ib.kind:  # one run has no crossing here, or another kind
                label = section
                shown = [(f"{it.kind}: " if section == "exec" else "") + next(iter(it.fields.values()))[1]
                         if it else "(none)" for it in (ia, ib)]
                diffs.append(Difference(f"{label}{pos(i)}", shown[0], shown[1], label, sa, sb))
                continue
            for label, (va, shown_a) in ia.fields.items():
                vb, shown_b = ib.fields[label]
                if (ia.marks | ib.marks) and label != "cell code":
                    continue
                if va != vb and not (tolerance and tolerance.equal(label, va, vb, sa, sb)):
                    diff = _short_diff(va, vb) if (shown_a != va or shown_b != vb) else ""
                    notes = tolerance.notes.get((sa, sb, label), []) if tolerance else []
                    diffs.append(Difference(f"{label}{pos(i)}", shown_a, shown_b, label, sa, sb, diff, notes, va, vb))
    return diffs


def _images(run: Run) -> dict[str, bytes]:
    """Every PNG and JPEG among the run's cells' outputs (late ones too), by digest: what --image-tolerance decodes."""
    late = late_outputs(run)
    return image_lookup(_outputs(run, (c.result or {}).get("outputs"), late.get(c.seq, []))
                        for c in run.crossings() if c.door == "exec" and (c.args or {}).get("kind") == "cell")


def audit(a: str | Path | Run, b: str | Path | Run, sanitizer_file: str | Path | None = None, *,
          rtol: float | None = None, atol: float | None = None, image_tolerance: float | None = None) -> Audit:
    """Compare two runs (audit_tolerance says what rtol, atol and image_tolerance loosen; the defaults: exact)."""
    from tkbox_nb.core.atomic_file import read_capped
    tolerance = Tolerance(rtol or 0.0, atol or 0.0, image_tolerance)  # checked before any bundle is read
    extra: list[tuple[str, str]] = []
    if sanitizer_file:
        try:
            extra = parse_sanitizers(read_capped(Path(sanitizer_file), MAX_SANITIZER_BYTES).decode("utf-8"))
        except OSError as e:
            raise TkboxError(f"sanitizer file {sanitizer_file}: {e.strerror or e}") from None
        except (ValueError, TkboxError) as e:  # not a regular file, too large, not UTF-8, a bad pattern
            raise TkboxError(f"sanitizer file {sanitizer_file}: {e}") from None
    ra, rb = open_run(a), open_run(b)
    a, b = ra.path, rb.path
    fa, fb = facts(ra, extra), facts(rb, extra)
    ca, cb = coverage(fa), coverage(fb)
    if tolerance.image is not None:
        tolerance.images = (_images(ra), _images(rb))
    marked = {m: tuple(sum(m in i.marks for i in f["exec"]) for f in (fa, fb)) for m in (IGNORE, SKIP)}
    diffs = compare({k: fa[k] for k in fa if k not in NOT_COMPARED}, fb, tolerance)
    from tkbox_nb.audit.report import explain, mount_files
    for d in diffs:
        if d.kind == "mounts":  # which files: from the two runs' disclosed lists, each opened by its signed digest
            d.diff = mount_files(ra, rb)
    from tkbox_nb.audit.tolerance import image_notes
    image_notes(diffs, lambda: tolerance.images or (_images(ra), _images(rb)))  # images by their pixels
    return Audit(str(a), str(b), diffs, {d: (ca[d], cb[d]) for d in DOORS}, {d: (ca[d], cb[d]) for d in NOT_COMPARED},
                 tolerance, marked, explain(ra, rb) if diffs else [])
