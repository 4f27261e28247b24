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
  digest), and the patch (each file's last decision and content digest, by path);
- the GPUs the box was given, from its signed box.start (how many, each one's name, memory and compute capability,
  the driver and CUDA driver versions; which physical GPU, by UUID, only as context: rules/gpu_record.py);
- the environment the box started with (its signed manifest: the interpreter, each distribution by name, version and
  files digest, each Debian package) and what the package door let in during the run (each project's page and
  files: version, file, sha256, decision, paired by project), each difference named package by package
  (audit/packages.py).

Counted and named in the coverage line but not compared (NOT_COMPARED): the host magics a rerun does not make again
(replay.RERUN_SKIPS: %box_bundle, %box_view, %box_restart, %box_secret), and the exec door's comm messages (widget
messages from a frontend, and the faults refused among them): a rerun has no frontend to send them, so comparing them
would call every honest rerun of a notebook that used a widget different; and the counts of refusals a door signed
past `[box] max_refusals` (signing/refusal_caps.py): how a flood's refusals split between counts depends on timing.

The verdict is `equivalent`, `different`, or `incomparable` when neither run has any crossing of these doors (only
the box's own start and stop): such a pair is not called equivalent (exit 3, see EXIT_*).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tkbox_nb.audit.conventions import IGNORE, SKIP
from tkbox_nb.audit.conventions import describe as describe_marks
from tkbox_nb.audit.tolerance import Tolerance, image_lookup
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.audit.door_items import Item, _field, _one, item_of
from tkbox_nb.audit.packages import environment_field
from tkbox_nb.audit.replay import RERUN_SKIPS, _outputs, late_outputs
from tkbox_nb.bundle.read_back import Crossing, Run, open_run
from tkbox_nb.rules.door_table import BOX, EXEC, HOST, TABLE, Door
from tkbox_nb.rules.gpu_record import compared as gpu_compared

EXIT_EQUIVALENT, EXIT_DIFFERENT, EXIT_INCOMPARABLE = 0, 1, 3
MAX_SANITIZER_BYTES = 1 << 20  # a sanitizer file is a few patterns: a larger one (or no regular file) is refused
DIFF_LINES = 12
# the doors compared, as the coverage line counts them (the categories of rules/door_table.py)
DOORS = tuple(c.label for d in TABLE for c in d.counted)
CELLS = next(d.audit for d in TABLE if d.name == EXEC)  # the section of cells and commands
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
    explained: list[str] = field(default_factory=list)  # what else differed between the runs (report.explain)

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
        return f"compared (crossings in A/B): {doors}; the starting policy, workspace, mounts, environment and GPUs" + \
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
    stop = next((c for c in run.crossings() if c.door == BOX and (c.args or {}).get("kind") == "stop"), None)
    changed = ((stop.args if stop else None) or {}).get("mounts_changed")
    signed = signed if isinstance(signed, dict) else {}
    shown = "; ".join(f"{n} at {f.get('target')}: {f.get('digest')}" for n, f in sorted(signed.items())
                      if isinstance(f, dict)) or "none"
    return {"mounts": _field(shown), "mounts changed while the box ran": _field(
        "; ".join(f"{n}: {', '.join(map(str, p))}" for n, p in sorted(changed.items()) if isinstance(p, list))
        if isinstance(changed, dict) and changed else "none")}


def facts(run: Run, extra: list[tuple[str, str]], table: tuple[Door, ...] = TABLE) -> dict[str, list[Item]]:
    """What audit compares, per section (the box's, then each door's of `table`, then NOT_COMPARED), each a list of
    items in run order; a door compared `by` a fact keeps its last item per value of it, in that order."""
    doors = [d for d in table if d.audit is not None and d.counted]
    out: dict[str, list[Item]] = {k: [] for k in (BOX, *(d.audit for d in doors), *NOT_COMPARED)}
    last: dict[str, dict[str, Item]] = {d.name: {} for d in doors if d.by}
    start = next((c for c in run.crossings() if c.door == BOX and (c.args or {}).get("kind") == "start"), None)
    pol = run.box.get("policy") if isinstance(run.box.get("policy"), dict) else {}
    seq0 = start.seq if start else None
    out[BOX] = [Item(seq0, BOX, {
        "starting policy": (str(pol.get("hash")), f"{pol.get('hash')} ({pol.get('name')})"),
        "workspace": _workspace(((start.args if start else None) or {}).get("workspace_digest")),
        **_mounts(run, start), "environment": environment_field(run),
        "GPUs": gpu_compared(((start.args if start else None) or {}).get("gpus"))})]
    late = late_outputs(run)
    for c in run.crossings():
        a, door = c.args or {}, next((d for d in doors if d.name == c.door), None)
        if a.get("kind") == "refused_count":  # how many refusals were counted, not each signed: never compared
            out[NOT_COMPARED[2]].append(_one(c.seq, "refusals", f"{c.door} {a.get('count')}"))
        elif c.door == EXEC and a.get("kind") in ("comm", "comm_fault"):
            out[NOT_COMPARED[1]].append(_one(c.seq, "comm", f"{a.get('kind')} {a.get('msg_type')}"))
        elif c.door == HOST and a.get("magic") in RERUN_SKIPS:
            out[NOT_COMPARED[0]].append(_one(c.seq, HOST, f"%{a.get('magic')}"))
        elif door is not None and (it := item_of(run, c, extra, late, table)) is not None:
            if door.by:
                last[door.name][str(a.get(door.by))] = it
            else:
                out[str(door.audit)].append(it)
    for d in doors:
        if d.by:
            out[str(d.audit)] = [last[d.name][k] for k in sorted(last[d.name])]
    return out


def _facts(run: Run, extra: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The compared values only, per field label (for the fuzz target: reading any bundle never raises)."""
    flat: dict[str, list[str]] = {}
    for items in facts(run, extra).values():
        for item in items:
            for label, (value, _) in item.fields.items():
                flat.setdefault(label, []).append(value)
    return flat


def coverage(f: dict[str, list[Item]], table: tuple[Door, ...] = TABLE) -> dict[str, int]:
    """Crossings per compared category of each door (its items, or those of the category's kind), then per kind
    counted but not compared (NOT_COMPARED)."""
    out = {c.label: sum(c.kind is None or i.kind == c.kind for i in f.get(str(d.audit), []))
           for d in table for c in d.counted}
    return out | {k: len(f[k]) for k in NOT_COMPARED}


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
        if any(it.key is not None for it in xa + xb):  # compared key by key (a project), each key's in order
            diffs += _by_key(section, xa, xb)
            continue
        pos = (lambda i: "") if section == BOX else (lambda i: f" #{i + 1}")
        for i in range(max(len(xa), len(xb))):
            ia = xa[i] if i < len(xa) else None
            ib = xb[i] if i < len(xb) else None
            sa, sb = (ia.seq if ia else None), (ib.seq if ib else None)
            if ia is None or ib is None or ia.kind != ib.kind:  # one run has no crossing here, or another kind
                label = section
                shown = [(f"{it.kind}: " if section == CELLS else "") + next(iter(it.fields.values()))[1]
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


def _by_key(section: str, xa: list[Item], xb: list[Item]) -> list[Difference]:
    """The differences of a section whose items have keys (the package door's, by project): the keys in name order,
    each key's items paired in run order; one run's item with no partner is a difference of its own. Each is named
    `SECTION KEY` (and `#n` past a key's first item), its whole values kept for the readable report."""
    keys: dict[str, tuple[list[Item], list[Item]]] = {}
    for which, items in ((0, xa), (1, xb)):
        for it in items:
            keys.setdefault(str(it.key), ([], []))[which].append(it)
    diffs = []
    for key in sorted(keys):
        ka, kb = keys[key]
        for i in range(max(len(ka), len(kb))):
            ia, ib = (ka[i] if i < len(ka) else None), (kb[i] if i < len(kb) else None)
            va, sa_ = next(iter(ia.fields.values())) if ia else ("", "(none)")
            vb, sb_ = next(iter(ib.fields.values())) if ib else ("", "(none)")
            if va != vb:
                diffs.append(Difference(f"{section} {key}" + (f" #{i + 1}" if i else ""), sa_, sb_, section,
                                        ia.seq if ia else None, ib.seq if ib else None, value_a=va, value_b=vb))
    return diffs


def _images(run: Run) -> dict[str, bytes]:
    """Every PNG and JPEG among the run's cells' outputs (late ones too), by digest: what --image-tolerance decodes."""
    late = late_outputs(run)
    return image_lookup(_outputs(run, (c.result or {}).get("outputs"), late.get(c.seq, []))
                        for c in run.crossings() if c.door == EXEC and (c.args or {}).get("kind") == "cell")


def audit(a: str | Path | Run, b: str | Path | Run, sanitizer_file: str | Path | None = None, *,
          rtol: float | None = None, atol: float | None = None, image_tolerance: float | None = None) -> Audit:
    """Compare two runs (tolerance says what rtol, atol and image_tolerance loosen; the defaults: exact)."""
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
    marked = {m: tuple(sum(m in i.marks for i in f[CELLS]) for f in (fa, fb)) for m in (IGNORE, SKIP)}
    diffs = compare({k: fa[k] for k in fa if k not in NOT_COMPARED}, fb, tolerance)
    from tkbox_nb.audit.report import explain, mount_files
    for d in diffs:
        if d.kind == "mounts":  # which files: from the two runs' disclosed lists, each opened by its signed digest
            d.diff = mount_files(ra, rb)
    from tkbox_nb.audit.tolerance import image_notes
    image_notes(diffs, lambda: tolerance.images or (_images(ra), _images(rb)))  # images by their pixels
    return Audit(str(a), str(b), diffs, {d: (ca[d], cb[d]) for d in DOORS}, {d: (ca[d], cb[d]) for d in NOT_COMPARED},
                 tolerance, marked, explain(ra, rb) if diffs else [])
