"""A signed run back as a notebook (replay), executed again in a fresh box (rerun), and two runs compared (audit).

`to_notebook` reads only what the bundle discloses: each cell's code and recorded outputs, in the order the run
decided them, with the run id, record sequence numbers and digests in each cell's metadata; host-side magics come back
as the host events they were (tagged `tkbox-host`), refused cells as refused (tagged `tkbox-refused`), commands as
markdown. `rerun` executes a replayed notebook in a fresh box under the original policy (or a given one) and names the
original run (`replay_of`, when the signer holds it). `audit` compares two runs after sanitizing volatile values.
"""

from __future__ import annotations

import html
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from .errors import TkboxError
from .run import Run, open_run

KERNELSPEC = {"name": "tkbox", "display_name": "Python 3 (Tracekit Box)", "language": "python"}
# volatile values, replaced before outputs are compared (nbval-style); a sanitizer file adds (regex, replacement)
SANITIZERS: list[tuple[str, str]] = [
    (r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?\b", "<TIMESTAMP>"),
    (r"\b0x[0-9a-fA-F]{6,16}\b", "<ADDRESS>"),
    (r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<UUID>"),
    (r"\b[0-9a-f]{32}\b", "<ID>"),
    (r"tkbox-ph-[0-9a-f]{32}", "<PLACEHOLDER>"),
]


def _outputs(run: Run, ref: Any) -> list[dict]:
    """The recorded outputs of a cell, as nbformat outputs (display updates and clears applied in order)."""
    raw = run.content(ref) if isinstance(ref, str) else None
    if raw is None:
        return []
    try:
        items = json.loads(raw)
    except ValueError:
        return []
    out: list[dict] = []
    for o in items if isinstance(items, list) else []:
        t = o.get("output_type") if isinstance(o, dict) else None
        if t == "clear_output":
            out = []
        elif t == "update_display_data":
            for prev in out:
                if prev.get("_display_id") == o.get("display_id"):
                    prev["data"], prev["metadata"] = o.get("data", {}), o.get("metadata", {})
        elif t in ("stream", "display_data", "execute_result", "error"):
            item = {k: v for k, v in o.items() if k != "display_id"}
            if o.get("display_id"):
                item["_display_id"] = o["display_id"]
            out.append(item)
    return [nbformat.from_dict({k: v for k, v in o.items() if k != "_display_id"}) for o in out]


def to_notebook(run: Run) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["tkbox"] = {"replay_of": run.run_id, "bundle": str(run.path), "box": {
        k: run.box.get(k) for k in ("box_id", "backend", "isolation", "image_digest", "boot", "policy")}}
    nb.cells.append(nbformat.v4.new_markdown_cell(
        f"Replay of run `{run.run_id}` ({run.box.get('backend', '?')}, {run.box.get('isolation', '?')}) from "
        f"`{run.path.name}`: cells and outputs as recorded. Verify the bundle (`tkbox verify`) before trusting them."))
    for c in run.crossings():
        a = c.args or {}
        meta = {"run_id": run.run_id, "decision_seq": c.seq, "result_seq": c.result_seq, "decision": c.decision,
                "rule_ids": c.rule_ids}
        if c.door == "exec" and a.get("kind") == "cell":
            code = (run.content(a.get("code", "")) or b"").decode("utf-8", "replace")
            cell = nbformat.v4.new_code_cell(code)
            cell.metadata["tkbox"] = dict(meta, code_digest=a.get("code"),
                                          outputs_digest=(c.result or {}).get("outputs"))
            if c.decision == "allow":
                cell.outputs = _outputs(run, (c.result or {}).get("outputs"))
                cell.execution_count = (c.result or {}).get("execution_count")
            else:
                cell.metadata["tags"] = ["tkbox-refused"]
            nb.cells.append(cell)
        elif c.door == "host":
            body = run.content(a.get("body", "")) if a.get("body") else None
            magic = a.get("magic", "")
            source = f"%%{magic} {a.get('line', '')}".rstrip() + "\n" + body.decode("utf-8", "replace") if body else \
                f"%{magic} {a.get('line', '')}".rstrip()
            cell = nbformat.v4.new_code_cell(source)
            cell.metadata["tkbox"] = dict(meta, host_event=True)
            cell.metadata["tags"] = ["tkbox-host"]
            nb.cells.append(cell)
        elif c.door == "exec" and a.get("kind") == "command" and isinstance(a.get("argv"), list):
            stdout = run.content((c.result or {}).get("stdout", "")) or b""
            text = f"Command `{shlex.join(str(x) for x in a['argv'])}` ({c.decision}, exit " \
                   f"{(c.result or {}).get('exit_code')})\n\n```\n{stdout.decode('utf-8', 'replace')[:5000]}\n```"
            cell = nbformat.v4.new_markdown_cell(text)
            cell.metadata["tkbox"] = meta
            nb.cells.append(cell)
    return nb


def replay(bundle: str | Path, out: str | Path) -> Path:
    nb = to_notebook(open_run(bundle))
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(out)
    return out


def rerun(bundle: str | Path, out: str | Path, policy: str | Path | None = None, home: str | Path | None = None,
          backend: str = "auto") -> tuple[Path, str | None]:
    """Execute the replayed notebook's cells (refused and host-only cells as host magics) in a fresh box, under the
    run's own policy or `policy`; returns (bundle, the run it names as replay_of or None)."""
    from .notebook_box import HostMagics, NotebookBox, split_host_magics
    from .policy import Policy
    run = open_run(bundle)
    if policy is None:
        source = run._b.policies.get((run.box.get("policy") or {}).get("hash", ""))
        if source is None:
            raise TkboxError("the bundle does not disclose the policy its box started with; pass --policy")
        policy = Policy.from_toml(source, f"the policy of run {run.run_id}")
    nb = NotebookBox(policy=policy, backend=backend, home=home)
    nb.replay_of = run.run_id
    if any(c.door == "model" for c in run.crossings()):  # model calls are answered from the run's recordings
        from .doors.model_replay import recordings_from_run
        nb.model_replay = recordings_from_run(run)
    magics = HostMagics(nb, lambda prompt: (_ for _ in ()).throw(TkboxError("a rerun cannot answer a prompt")))
    for cell in to_notebook(run).cells:
        if cell.cell_type != "code" or "tkbox-refused" in cell.metadata.get("tags", []):
            continue
        host, code = split_host_magics(cell.source)
        for name, line, body in host:
            if name not in ("box_bundle", "box_restart", "box_view", "box_secret"):
                magics.run(name, line, body)
        if code.strip():
            nb.ensure_box().execute(code)
    box = nb.box
    if box is None:
        raise TkboxError("the run has no cell to execute")
    box.bundle_path = Path(out)
    named = box.recorder.replay_of if box.recorder else None
    nb.stop("rerun done")
    return Path(out), named


# -- audit -------------------------------------------------------------------------------------------------------
@dataclass
class Difference:
    what: str
    a: str
    b: str


@dataclass
class Audit:
    a: str
    b: str
    differences: list[Difference] = field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return not self.differences

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "equivalent": self.equivalent,
                "differences": [d.__dict__ for d in self.differences]}

    def table(self) -> str:
        if self.equivalent:
            return f"EQUIVALENT: {self.a} and {self.b}"
        lines = [f"DIFFERENT: {len(self.differences)} difference(s) between {self.a} and {self.b}"]
        for d in self.differences:
            lines.append(f"  {d.what}\n    A: {d.a[:200]}\n    B: {d.b[:200]}")
        return "\n".join(lines)

    def html(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(d.what)}</td><td><pre>{html.escape(d.a)}</pre></td>"
                       f"<td><pre>{html.escape(d.b)}</pre></td></tr>" for d in self.differences)
        verdict = "equivalent" if self.equivalent else f"{len(self.differences)} difference(s)"
        return (f"<!doctype html><meta charset='utf-8'><title>tkbox audit</title><style>body{{font-family:sans-serif}}"
                f"td,th{{border:1px solid #ccc;padding:4px;vertical-align:top}}table{{border-collapse:collapse}}"
                f"</style><h1>tkbox audit: {html.escape(verdict)}</h1><p>A: {html.escape(self.a)}<br>"
                f"B: {html.escape(self.b)}</p><table><tr><th>what</th><th>A</th><th>B</th></tr>{rows}</table>")


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


def _facts(run: Run, extra: list[tuple[str, str]]) -> dict[str, list[str]]:
    """What audit compares, each as a list of sanitized strings in run order."""
    cells, outputs, egress, secrets, host, models = [], [], [], [], [], []
    for c in run.crossings():
        a = c.args or {}
        if c.door == "exec" and a.get("kind") == "cell":
            cells.append(f"{c.decision}: " + (run.content(a.get("code", "")) or b"").decode("utf-8", "replace"))
            outs = _outputs(run, (c.result or {}).get("outputs"))
            outputs.append(_sanitize(json.dumps([_output_text(o) for o in outs]), extra))
        elif c.door == "egress":
            egress.append(f"{a.get('method', '')} {a.get('host')}:{a.get('port')} {c.decision} ({a.get('rule')})")
        elif c.door == "secrets":
            secrets.append(f"{a.get('kind')} {a.get('name')} {a.get('host', '')}".strip())
        elif c.door == "host":
            host.append(f"%{a.get('magic')} {a.get('line', '')}".strip())
        elif c.door == "model":  # the call and what came back, by digest (not the mode: a rerun replays)
            r = c.result or {}
            models.append(f"{a.get('provider')}:{a.get('model')} {a.get('endpoint')} {c.decision} ({a.get('rule')}) "
                          f"request {str(a.get('request', ''))[7:19]} response "
                          f"{str(r.get('response') or r.get('response_digest') or '')[7:19]}")
    return {"cell code": cells, "cell outputs": outputs, "egress": egress, "secrets (names only)": secrets,
            "host magics": host, "model calls": models, "patch": _patch_facts(run)}


def _patch_facts(run: Run) -> list[str]:
    """Each file of the run's patch, last decision per path, with its content digest: order-free."""
    last = {}
    for c in run.crossings():
        a = c.args or {}
        if c.door == "patch" and a.get("kind") == "file":
            last[str(a.get("path"))] = (f"{a.get('op')} {a.get('path')} {c.decision} ({a.get('rule')}) "
                                        f"{str(a.get('content', ''))[7:19]}")
    return [last[p] for p in sorted(last)]


def _output_text(o: dict) -> Any:
    """What audit compares of one recorded output (read leniently: the bundle's content is not checked for form)."""
    t = o.get("output_type")
    if t == "stream":
        return [str(o.get("name")), str(o.get("text"))]
    if t == "error":
        return ["error", str(o.get("ename")), str(o.get("evalue"))]
    data = o.get("data") if isinstance(o.get("data"), dict) else {}
    return [t, str(data.get("text/plain", "")), sorted(data)]


def audit(a: str | Path, b: str | Path, sanitizer_file: str | Path | None = None) -> Audit:
    extra: list[tuple[str, str]] = []
    if sanitizer_file:
        try:
            extra = parse_sanitizers(Path(sanitizer_file).read_text())
        except (OSError, UnicodeDecodeError, TkboxError) as e:
            raise TkboxError(f"sanitizer file {sanitizer_file}: {e}") from None
    fa, fb = _facts(open_run(a), extra), _facts(open_run(b), extra)
    report = Audit(str(a), str(b))
    for key in fa:
        xa, xb = fa[key], fb[key]
        for i in range(max(len(xa), len(xb))):
            va = xa[i] if i < len(xa) else "(none)"
            vb = xb[i] if i < len(xb) else "(none)"
            if va != vb:
                report.differences.append(Difference(f"{key} #{i + 1}", va, vb))
    return report
