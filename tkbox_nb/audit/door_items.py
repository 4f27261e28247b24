"""What `tkbox audit` compares of one crossing of each door: an `Item` of labelled fields, each (compared value,
shown value), after sanitizing volatile values.

The doors and their audit sections are the door table's (rules/door_table.py); `ITEMS` holds the doors whose
crossings are read by a function of their own here (a cell's outputs, a command's streams, a model call's digests,
a package's version and sha256, compared by project: its items carry a `key`),
and a door of the table without one is compared by the facts the table names for it (`table_item`), so a new door is
compared, one line per crossing, from the moment it is in the table. `compare.py` walks a run's crossings with them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tkbox_nb.audit.conventions import marks
from tkbox_nb.audit.replay import _outputs, user_expressions
from tkbox_nb.bundle.read_back import Crossing, Run
from tkbox_nb.audit.packages import package_shown, package_value
from tkbox_nb.rules.door_table import EGRESS, EXEC, HOST, MODEL, PACKAGES, PATCH, SECRETS, TABLE, Door

SECTION = {d.name: str(d.audit) for d in TABLE}  # each door's section of the audit's facts, and its items' kind
LARGE = 400  # a sanitized stdout, stderr or outputs longer than this is shown by digest with a short diff
# volatile values, replaced before outputs are compared (nbval-style); a sanitizer file adds (regex, replacement)
SANITIZERS: list[tuple[str, str]] = [
    (r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?\b", "<TIMESTAMP>"),
    (r"\b0x[0-9a-fA-F]{6,16}\b", "<ADDRESS>"),
    (r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<UUID>"),
    (r"\b[0-9a-f]{32}\b", "<ID>"),
    (r"tkbox-ph-[0-9a-f]{32}", "<PLACEHOLDER>"),
]


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
    marks: frozenset[str] = frozenset()  # a cell's nbval marks (conventions): its outputs not compared
    key: str | None = None  # set: compared with the other run's items of the same key (a project), not by position


def _field(value: str, large: bool = False) -> tuple[str, str]:
    if not large or len(value) <= LARGE:
        return value, value
    return value, f"sha256:{hashlib.sha256(value.encode('utf-8', 'replace')).hexdigest()[:16]} ({len(value)} chars)"


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


def _egress_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item:
    a = c.args or {}
    return _one(c.seq, SECTION[EGRESS],
                f"{a.get('method', '')} {a.get('host')}:{a.get('port')} {c.decision} ({a.get('rule')})")


def _secrets_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item:
    a = c.args or {}
    return _one(c.seq, SECTION[SECRETS], f"{a.get('kind')} {a.get('name')} {a.get('host', '')}".strip())


def _host_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item:
    """A %box_policy by the policy it set: its body's digest, the policy then in force."""
    a = c.args or {}
    line = f"%{a.get('magic')} {a.get('line', '')}".strip()
    if a.get("magic") == "box_policy":
        line += f" body {a.get('body') or '(none)'} policy {a.get('policy')}"
    return _two(c.seq, SECTION[HOST], line)


def _model_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item:
    """The call and what came back, by digest (not the mode: a rerun replays)."""
    a, r = c.args or {}, c.result or {}
    return _two(c.seq, SECTION[MODEL], (
        f"{a.get('provider')}:{a.get('model')} {a.get('endpoint')} {c.decision} ({a.get('rule')}) request "
        f"{a.get('request', '')} response {r.get('response') or r.get('response_digest') or ''}"))


def _patch_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item | None:
    """A patch file (compared by its last decision per path: the door table's `by`); its summary is not compared."""
    a = c.args or {}
    if a.get("kind") != "file":
        return None
    return _two(c.seq, SECTION[PATCH], " ".join(
        [f"{a.get('op')} {a.get('path')}"] + [f"{k} {a[k]}" for k in ("from", "type", "target") if k in a]
        + ([f"mode {oct(a['mode'])}"] if isinstance(a.get("mode"), int) else [])
        + [f"{c.decision} ({a.get('rule')}) {a.get('content', '')}"]))


def _packages_item(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]]) -> Item | None:
    """A project's index page or one of its files, compared by project (audit/packages.py names how they differ)."""
    a = c.args or {}
    if a.get("kind") not in ("project", "file"):
        return None
    value = package_value(str(a.get("kind")), a, c.decision)
    return Item(c.seq, SECTION[PACKAGES], {SECTION[PACKAGES]: (value, package_shown(value))},
                key=str(a.get("project", ""))[:200])


def table_item(door: Door, c: Crossing) -> Item:
    """A crossing of a door with no reader of its own here: its kind, the facts the table names, its decision."""
    a = c.args or {}
    facts = " ".join(f"{k} {json.dumps(a[k], sort_keys=True, default=str)}" for k in door.compares if k in a)
    return _two(c.seq, str(door.audit), f"{a.get('kind', '')} {facts} {c.decision} ({a.get('rule')})".strip())


Reader = Callable[[Run, Crossing, list[tuple[str, str]], dict[int, list[str]]], "Item | None"]
ITEMS: dict[str, Reader] = {EXEC: _exec_item, EGRESS: _egress_item, SECRETS: _secrets_item, HOST: _host_item,
                            MODEL: _model_item, PATCH: _patch_item, PACKAGES: _packages_item}
if set(ITEMS) - {d.name for d in TABLE}:  # a reader of a door the table no longer has
    raise RuntimeError(f"audit/door_items.py reads doors not in the door table: {sorted(set(ITEMS) - set(SECTION))}")


def item_of(run: Run, c: Crossing, extra: list[tuple[str, str]], late: dict[int, list[str]],
            table: tuple[Door, ...] = TABLE) -> Item | None:
    """What the audit compares of crossing `c` (None: nothing, or its door is not compared one by one)."""
    door = next((d for d in table if d.name == c.door), None)
    if door is None or door.audit is None or not door.counted:
        return None
    reader = ITEMS.get(door.name)
    return reader(run, c, extra, late) if reader is not None else table_item(door, c)
