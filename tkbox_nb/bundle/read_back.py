"""A signed run read back from its `.tkb`: records, crossings, a DataFrame, verification.

`open_run` only parses (through the bundle module's strict reader); it does not vouch for anything. Call `verify()`
before trusting what the run shows. Its views (the widget view, the static HTML, the notebook) are made above it, by
widgets and replay, and handed in by the package (`RunViews`).
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tkbox_nb.bundle.archive import BundleContents, parse, read_bundle_bytes, read_entries
from tkbox_nb.core.errors import BundleError, TkboxError
from tkbox_nb.rules.door_table import BOX, EXEC, MODEL, PATCH, door_of_tool, tool_of
from tkbox_nb.rules.gpu_record import names

DOOR_OF_TOOL = door_of_tool()  # a crossing whose statement names no door: its tool's (rules/door_table.py)
START_TOOL = tool_of(BOX, "start")  # what a box's start is signed as: its crossing commits to the environment
COLUMNS = ["seq", "time", "door", "tool", "kind", "decision", "rule_ids", "box_rule", "status", "summary", "content"]


@dataclass
class Crossing:
    """One decided crossing: its decision record, its disclosed arguments and, if it ran, its result."""

    seq: int
    time: str
    tool: str
    decision: str
    rule_ids: list[str]
    args: dict[str, Any] | None
    result: dict[str, Any] | None
    result_seq: int | None

    @property
    def door(self) -> str:
        door = (self.args or {}).get("door")
        return door if isinstance(door, str) and door else DOOR_OF_TOOL.get(self.tool, self.tool)


@dataclass(frozen=True)
class RunViews:
    """How a run is shown in a notebook and turned into one. The widgets and replay modules do that, and they read
    runs, so they sit above this module and are not imported from it (docs/layers.md): the top of the package,
    tkbox_nb/__init__.py, which any import of a tkbox_nb module runs first, hands them in as `Run.views`."""

    display: Callable[[Run], None]
    html: Callable[[Run], str]
    notebook: Callable[[Run], Any]


class Run:
    """One box's run, as its bundle holds it."""

    views: ClassVar[RunViews | None] = None

    def __init__(self, path: str | Path, contents: BundleContents, data: bytes | None = None):
        self.path = Path(path)
        self._b = contents
        self._data = data  # the bytes it was read from: `verify` checks these, not the file as it is later
        # only records of the v2 shape (the bundle is unverified here: anything else is left to `verify`)
        self.records: list[dict[str, Any]] = [
            r["event"] for r in contents.records if isinstance(r, dict) and isinstance(r.get("event"), dict)
            and _is_seq(r["event"].get("run_seq")) and isinstance(r["event"].get("data"), dict)]
        self.box: dict[str, Any] = contents.box or {}
        self.run_id = contents.run_id

    @property
    def sealed(self) -> bool:
        """Whether the run was closed (its run.final record is in the bundle), not a snapshot of an open run."""
        return any(e.get("type") == "run.final" for e in self.records)

    @property
    def notebook(self) -> str | None:
        """The notebook the run's kernel ran, as its frontend named it (`JPY_SESSION_NAME`, signed in box.start;
        `verify()` checks the manifest says what was signed), or None: not named, or not recorded
        (`box["notebook_dropped"]` says why). The frontend's text: escape it to show it (core/visible.py)."""
        name = self.box.get("notebook")
        return name if isinstance(name, str) else None

    @property
    def origin(self) -> str:
        """The signing log's origin, from the bundle's checkpoint note (first line)."""
        for name, body in sorted(self._b.files.items()):
            if name.startswith("checkpoints/") and name.endswith(".note"):
                return body.split(b"\n", 1)[0].decode("utf-8", "replace")[:200]
        return ""

    @property
    def key_id(self) -> str:
        """The record-signing key's id (sha256 of its public key), from the signer's epoch record in the bundle."""
        from tkbox_nb.bundle.archive import loads_jsonl
        try:
            for r in loads_jsonl(self._b.files.get("keys/records.jsonl", b""), "keys/records.jsonl"):
                keys = ((r.get("event") or {}).get("data") or {}).get("keys") if isinstance(r, dict) else None
                if isinstance(keys, list) and keys and isinstance(keys[0], dict):
                    return str(keys[0].get("kid", ""))[:80]
        except BundleError:
            pass
        return ""

    def _ipython_display_(self) -> None:
        """In a kernel with widgets, the interactive view (tkbox_nb.view); elsewhere the static HTML."""
        self._views().display(self)

    def _repr_html_(self) -> str:
        """A static view (summary and the first rows), for nbconvert and GitHub, where widgets do not run."""
        return self._views().html(self)

    def __repr__(self) -> str:
        return f"<Run {self.run_id} {self.box.get('backend', '?')} {len(self.crossings())} crossings>"

    def content(self, digest: str) -> bytes | None:
        """Disclosed content by its digest (`sha256:...`), or None."""
        blob = self._b.content.get(digest) if isinstance(digest, str) else None
        if blob is None or "sha256:" + hashlib.sha256(blob).hexdigest() != digest:
            return None  # never bytes other than the ones the digest names, verified or not
        return blob

    def disclosure(self, seq: int) -> dict[str, Any] | None:
        return next((d for d in self._b.disclosures if isinstance(d, dict) and d.get("run_seq") == seq), None)

    def crossings(self) -> list[Crossing]:
        disclosed = {(d["run_seq"], d.get("type")): d for d in self._b.disclosures
                     if isinstance(d, dict) and _is_seq(d.get("run_seq")) and isinstance(d.get("type"), str)}
        results = {str(e["data"].get("decision_id")): e for e in self.records if e.get("type") == "tool.result"}
        out = []
        for e in self.records:
            if e.get("type") != "policy.decision":
                continue
            data = e["data"]
            res = results.get(str(data.get("decision_id")))
            rd = disclosed.get((res["run_seq"], "tool.result")) if res else None
            args = (disclosed.get((e["run_seq"], "policy.decision")) or {}).get("args")
            result = (rd or {}).get("result")
            rules = data.get("rule_ids")
            out.append(Crossing(
                seq=e["run_seq"], time=str(e.get("ts", "")), tool=str(data.get("tool", "")),
                decision=str(data.get("decision", "")),
                rule_ids=[str(r) for r in rules] if isinstance(rules, list) else [],
                args=args if isinstance(args, dict) else None, result=result if isinstance(result, dict) else None,
                result_seq=res["run_seq"] if res else None))
        return out

    def summary_of(self, c: Crossing) -> str:
        a = c.args or {}
        if c.door == EXEC and a.get("kind") == "cell":
            code = (self.content(a.get("code", "")) or b"").decode("utf-8", "replace").strip()
            return (code.splitlines() or [""])[0][:120]
        if c.door == EXEC and a.get("kind") == "command" and isinstance(a.get("argv"), list):
            return shlex.join(str(x) for x in a["argv"])[:120]
        if c.door == EXEC and a.get("kind") == "late_output":  # a cell's thread, after the cell's end was signed
            dropped = f", {a.get('dropped')} dropped past the cap" if a.get("dropped") else ""
            return f"late output of cell #{a.get('cell_seq')}: {a.get('messages')} messages{dropped}"[:120]
        if c.door == MODEL and a.get("kind") == "call":
            usage = (c.result or {}).get("usage") or {}
            tokens = f" {usage.get('input_tokens', '?')}+{usage.get('output_tokens', '?')} tokens" if usage else ""
            return (f"{a.get('provider')}:{a.get('model', '?')} {a.get('endpoint', '')}"
                    f"{' stream' if a.get('stream') else ''} ({a.get('mode', '')}){tokens}")[:120]
        if c.door == PATCH and a.get("kind") == "file":
            src = f"{a.get('from')} -> " if a.get("op") == "rename" else ""
            return f"{a.get('op')} {src}{a.get('path')} ({a.get('size')} bytes, mode {a.get('mode', 0):o})"[:120]
        if c.door == PATCH and a.get("kind") == "summary":
            return f"patch: {a.get('allowed')} allowed, {a.get('refused')} refused, apply = {a.get('apply')}"[:120]
        if a.get("kind") == "refused_count":  # refusals past [box] max_refusals, counted (signing/refusal_caps.py)
            rules = ", ".join(f"{k} {v}" for k, v in (a.get("rules") or {}).items()) if isinstance(a.get("rules"),
                                                                                                dict) else ""
            return f"{a.get('count')} more refused, counted, not each signed ({rules})"[:120]
        if c.door == BOX:
            if a.get("kind") == "start":
                return box_summary(a)
            return f"stop: {a.get('reason', '')}"[:120]
        return ", ".join(f"{k}={v}" for k, v in a.items() if k not in ("door", "kind", "policy", "verdict"))[:120]

    def to_dataframe(self):
        """One row per crossing, with proper dtypes (time as UTC datetimes, door and decision as categories)."""
        import pandas as pd
        rows = []
        for c in self.crossings():
            a = c.args or {}
            main = a.get("code") or a.get("stdin") or (a.get("outputs") if a.get("kind") == "late_output" else "") or ""
            rows.append({
                "seq": c.seq, "time": c.time, "door": c.door, "tool": c.tool, "kind": str(a.get("kind", "")),
                "decision": c.decision, "rule_ids": ",".join(c.rule_ids), "box_rule": str(a.get("rule", "")),
                "status": str((c.result or {}).get("status", "" if c.decision == "allow" else
                                                   "counted" if a.get("kind") == "refused_count" else "refused")),
                "summary": self.summary_of(c), "content": main if isinstance(main, str) else ""})
        df = pd.DataFrame(rows, columns=COLUMNS)
        df["seq"] = df["seq"].astype("int64")
        df["time"] = pd.to_datetime(df["time"], utc=True, format="ISO8601", errors="coerce")
        for col in ("door", "decision"):
            df[col] = df[col].astype("category")
        for col in ("tool", "kind", "rule_ids", "box_rule", "status", "summary", "content"):
            df[col] = df[col].astype("string")
        return df

    def environment_manifest(self) -> dict[str, Any] | None:
        """The environment manifest the box.start committed to (bundle/environment.py), read strictly; None for a run
        made before tkbox recorded environments. BundleError when the bundle lacks the bytes or they are not a
        manifest."""
        from tkbox_nb.bundle.environment import parse as parse_environment
        start = next((c for c in self.crossings() if c.tool == START_TOOL and c.args), None)
        digest = (start.args if start else {}).get("environment")
        if digest is None:
            return None
        blob = self.content(digest)
        if blob is None:
            raise BundleError(f"the environment manifest {str(digest)[:19]}... the box.start names is not in the "
                              "bundle")
        try:
            return parse_environment(blob)
        except ValueError as e:
            raise BundleError(str(e)) from None

    @property
    def environment(self):
        """What the box ran, one row per item (kind python, distribution, debian: name, version, location, digest),
        then one per file installed during the run (kind installed: the project, its version, the file and its
        sha256; `installs` has them all, refused ones too); empty for a run that recorded none.
        `environment_manifest()` has the whole manifest."""
        import pandas as pd

        from tkbox_nb.bundle.environment import COLUMNS as ENV_COLUMNS, rows
        from tkbox_nb.bundle.installs import environment_rows, rows as install_rows
        m = self.environment_manifest()
        got = (rows(m) if m else []) + environment_rows(install_rows(self.crossings()))
        return pd.DataFrame(got, columns=ENV_COLUMNS).astype("string")

    @property
    def installs(self):
        """What came into the box through the package door during the run (bundle/installs.py): one row per file
        decided (project, version, filename, sha256 as the index stated it, got_sha256 of the bytes, size, source
        `index` or `cache`, the index whose page offered it, decision, the box policy's rule and verdict, the
        signer's rule_ids) and per project refused before any
        file, from the signed crossings."""
        import pandas as pd

        from tkbox_nb.bundle.installs import COLUMNS as INSTALL_COLUMNS, rows as install_rows
        df = pd.DataFrame(install_rows(self.crossings()), columns=INSTALL_COLUMNS)
        df["seq"] = df["seq"].astype("int64")
        df["size"] = df["size"].astype("int64")
        for col in INSTALL_COLUMNS[1:]:
            if col != "size":
                df[col] = df[col].astype("string")
        return df

    def to_notebook(self):
        """The run as a notebook: each cell's code and recorded outputs, host magics as host events
        (audit/replay.py)."""
        return self._views().notebook(self)

    def _views(self) -> RunViews:
        if self.views is None:
            raise TkboxError("a Run's views are handed in by tkbox_nb/__init__.py, which has not run to its end")
        return self.views

    def verify(self, trust: str | Path | None = None):
        """`tkbox verify` of the very bytes this run was read from."""
        from tkbox_nb.bundle.verify import verify_bundle
        return verify_bundle(self.path, trust, data=self._data)


def gpu_names(gpus: Any) -> str:
    """The signed `gpus` of a box.start as "N GPU(s): name UUID, ..."; any other shape "GPUs unreadable"."""
    return names(gpus)


def box_summary(a: dict) -> str:
    """A box.start in a line: backend, isolation, what held memory_mib, and its GPUs."""
    extra = [f"memory: {a['memory_limit']}"] if isinstance(a.get("memory_limit"), str) else []
    extra += [gpu_names(a["gpus"])] if "gpus" in a else []
    return f"box {a.get('backend')} ({a.get('isolation')})" + (f", {', '.join(extra)}" if extra else "")


def open_run(path: str | Path | Run) -> Run:
    """Read a `.tkb` (strictly; BundleError if it is unsafe or unreadable); a Run already read is itself."""
    if isinstance(path, Run):
        return path
    data = read_bundle_bytes(path)
    return Run(path, parse(read_entries(data)), data)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seq(v: Any) -> bool:
    """A run_seq as Tracekit writes one (its verifier refuses others): what a DataFrame's int64 column holds."""
    return _is_int(v) and 0 <= v < 1 << 53
