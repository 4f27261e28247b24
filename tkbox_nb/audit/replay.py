"""A signed run back as a notebook (replay) and executed again in a fresh box (rerun); audit/compare.py compares two
runs.

`to_notebook` reads only what the bundle discloses: each cell's code and recorded outputs (its late outputs, signed
after its end, appended), in the order the run decided them, with the run id, record sequence numbers, digests and
user_expressions (asked and answered) in each cell's metadata; host-side magics come back as the host events they
were (tagged `tkbox-host`), refused cells as refused (tagged `tkbox-refused`), commands as markdown, and what the
package door let in (or refused) as a markdown cell (tagged `tkbox-installs`) right after the cell or command during
which pip asked for it, or at the end for what no cell or command was running for. `rerun`
executes a replayed notebook (each cell with its user_expressions) in a fresh box under the original policy (or a
given one) and names the original run (`rerun_of` in its box manifest). `audit` compares two runs after sanitizing
volatile values.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.bundle.installs import rows as install_rows
from tkbox_nb.bundle.read_back import Run, open_run
from tkbox_nb.core.visible import visible
from tkbox_nb.rules.door_table import BOX, EXEC, HOST, MODEL, PACKAGES

# host magics a rerun does not make again (they write or show the run, restart its box, or prompt for a secret); the
# audit leaves them out of its comparison, and says how many it left out
RERUN_SKIPS = ("box_bundle", "box_restart", "box_view", "box_secret", "box_push")  # a push reads a host file
KERNELSPEC = {"name": "tkbox", "display_name": "Python 3 (Tracekit Box)", "language": "python"}


MAX_DEPTH = 64  # deeper JSON in an output is elided: nbformat, a notebook's writer and the audit all recurse


def bounded(value: Any, depth: int = 0) -> Any:
    """`value` with every list or object nested past MAX_DEPTH replaced by a short placeholder naming the digest of
    what was elided (so two outputs that differ only down there still differ)."""
    if not isinstance(value, (list, dict)):
        return value
    if depth >= MAX_DEPTH:
        try:
            digest = "sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
        except (RecursionError, ValueError, TypeError):
            digest = "too deep to digest"
        return f"[tkbox: elided, nested past {MAX_DEPTH} levels; {digest}]"
    if isinstance(value, list):
        return [bounded(v, depth + 1) for v in value]
    return {k: bounded(v, depth + 1) for k, v in value.items()}


def _items(run: Run, ref: Any) -> list:
    raw = run.content(ref) if isinstance(ref, str) else None
    if raw is None:
        return []
    try:
        items = bounded(json.loads(raw))
    except (ValueError, RecursionError):
        return []
    return items if isinstance(items, list) else []


def late_outputs(run: Run) -> dict[int, list[str]]:
    """The signed late outputs of each cell (what its threads sent after its end was signed), by the cell's decision
    seq: the digests of their batches, in run order."""
    out: dict[int, list[str]] = {}
    for c in run.crossings():
        a = c.args or {}
        if c.door == EXEC and a.get("kind") == "late_output" and c.decision == "allow" \
                and isinstance(a.get("cell_seq"), int) and isinstance(a.get("outputs"), str):
            out.setdefault(a["cell_seq"], []).append(a["outputs"])
    return out


def user_expressions(run: Run, c) -> tuple[dict, dict]:
    """A cell's user_expressions as decided (name -> expression) and their signed results (name -> result); {} for
    none, or for what the bundle does not disclose as a JSON object."""
    def obj(ref: Any) -> dict:
        try:
            value = bounded(json.loads(run.content(ref) or b"null")) if isinstance(ref, str) else None
        except (ValueError, RecursionError):  # a disclosed item is hostile until verified
            return {}
        return value if isinstance(value, dict) else {}
    return obj((c.args or {}).get("user_expressions")), obj((c.result or {}).get("user_expressions"))


def _outputs(run: Run, ref: Any, late: list[str] = ()) -> list[dict]:
    """The recorded outputs of a cell, then its late outputs (`late`: their batches' digests), as nbformat outputs
    (display updates and clears applied in order)."""
    out: list[dict] = []
    for o in [x for r in [ref, *late] for x in _items(run, r)]:
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


def _fenced(text: str) -> str:
    """`text` as a Markdown code block it cannot close: a fence of more backticks than any run of them in it (a
    closing fence needs at least as many), so nothing in it becomes a heading, a link or an image."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def _code(value: Any) -> str:
    """A bundle's value as inline code on one line (control characters escaped), delimited by more backticks than
    any run of them in it, so it cannot close its span."""
    text = visible(str(value))[:200]
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{ticks} {text} {ticks}" if "`" in text else f"{ticks}{text}{ticks}"


def _shown(items: list) -> tuple[list, list[str]]:
    """Replayed outputs as the notebook shows them: through the sanitiser live outputs pass (output_sanitiser), since a
    notebook opened in JupyterLab renders them the same way; what it removed or changed is named (`dropped`). The
    audit compares the recorded outputs, unsanitised."""
    from tkbox_nb.rules.output_sanitiser import outputs
    dropped: list[str] = []
    kept = outputs([dict(o) for o in items], "outputs", dropped)
    return [nbformat.from_dict(o) for o in kept], dropped


def to_notebook(run: Run) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["tkbox"] = {"replay_of": run.run_id, "bundle": str(run.path), "box": {
        k: run.box.get(k) for k in ("box_id", "backend", "isolation", "image_digest", "boot", "policy")}}
    nb.cells.append(nbformat.v4.new_markdown_cell(
        f"Replay of run {_code(run.run_id)} ({_code(run.box.get('backend', '?'))}, "
        f"{_code(run.box.get('isolation', '?'))}) from {_code(run.path.name)}: cells and outputs as recorded. "
        "Verify the bundle (`tkbox verify`) before trusting them."))
    late = late_outputs(run)
    installs = install_rows(run.crossings())
    for c in run.crossings():
        a = c.args or {}
        meta = {"run_id": run.run_id, "decision_seq": c.seq, "result_seq": c.result_seq, "decision": c.decision,
                "rule_ids": c.rule_ids}
        if c.door == EXEC and a.get("kind") == "cell":
            code = (run.content(a.get("code", "")) or b"").decode("utf-8", "replace")
            cell = nbformat.v4.new_code_cell(code)
            cell.metadata["tkbox"] = dict(meta, code_digest=a.get("code"),
                                          outputs_digest=(c.result or {}).get("outputs"))
            asked, results = user_expressions(run, c)
            if asked:  # not part of a notebook cell: kept in its metadata, as decided and as answered
                cell.metadata["tkbox"].update(user_expressions=asked, user_expression_results=results)
            if late.get(c.seq):
                cell.metadata["tkbox"]["late_outputs_digests"] = late[c.seq]
            if c.decision == "allow":
                cell.outputs, dropped = _shown(_outputs(run, (c.result or {}).get("outputs"), late.get(c.seq, [])))
                if dropped:
                    cell.metadata["tkbox"]["dropped"] = dropped[:100]
                cell.execution_count = (c.result or {}).get("execution_count")
            else:
                cell.metadata["tags"] = ["tkbox-refused"]
            nb.cells.append(cell)
        elif c.door == HOST:
            cell = nbformat.v4.new_code_cell(_host_source(run, c))
            cell.metadata["tkbox"] = dict(meta, host_event=True)
            cell.metadata["tags"] = ["tkbox-host"]
            nb.cells.append(cell)
        elif c.door == EXEC and a.get("kind") == "command" and isinstance(a.get("argv"), list):
            stdout = run.content((c.result or {}).get("stdout", "")) or b""
            cell = nbformat.v4.new_markdown_cell(
                "Command, as recorded (its argv, decision, exit status and stdout):\n\n" + _fenced(
                    f"$ {shlex.join(str(x) for x in a['argv'])}\n({c.decision}, exit "
                    f"{(c.result or {}).get('exit_code')})\n\n{stdout.decode('utf-8', 'replace')[:5000]}"))
            cell.metadata["tkbox"] = meta
            nb.cells.append(cell)
        if c.door == EXEC and a.get("kind") in ("cell", "command") and isinstance(c.result_seq, int):
            during = [r for r in installs if c.seq < r["seq"] < c.result_seq]
            installs = [r for r in installs if r not in during]
            if during:
                nb.cells.append(_installs_cell(during, f"during the {a['kind']} above"))
    if installs:
        nb.cells.append(_installs_cell(installs, "while no cell or command ran"))
    return nb


def _installs_cell(rows: list[dict], when: str):
    """A markdown cell naming what the package door decided `when` (bundle/installs.rows: each file with its
    version, sha256 and index, and each project refused before any file), tagged `tkbox-installs`, the rows in its
    metadata. A refusal names the box policy's rule, or, when the box policy allowed it and the signer's own pack
    refused it (a host no box may reach), the signer's rules (the record's rule_ids)."""
    lines = []
    for r in rows:
        what = f"{_code(r['project'])} {_code(r['version'])}: {_code(r['filename'])}, sha256 {_code(r['sha256'])}" \
            if r["kind"] == "file" else f"{_code(r['project'])} (its index page)"
        where = f" from {_code(r['index'])} ({_code(r['source'])})" if r["index"] else ""
        verdict = "installed" if r["decision"] == "allow" else \
            f"refused by the signer ({_code(r['rule_ids'].replace(',', ', ') or 'no rule named')})" \
            if r["verdict"] == "allow" else f"refused ({_code(r['rule'])})"  # the signer refused what the box allowed
        lines.append(f"- {what}{where}: {verdict}")
    cell = nbformat.v4.new_markdown_cell(f"Package door, {when} (signed; `Run.installs` has every row):\n\n"
                                         + "\n".join(lines))
    cell.metadata["tags"] = ["tkbox-installs"]
    keys = ("seq", "kind", "project", "version", "filename", "sha256", "index", "source", "decision", "rule",
            "rule_ids")
    cell.metadata["tkbox"] = {"installs": [{k: r[k] for k in keys} for r in rows]}
    return cell


def _host_source(run: Run, c) -> str:
    """A host event as the magic that made it (`%%magic line` and its body, or `%magic line`)."""
    a = c.args or {}
    body = run.content(a.get("body", "")) if a.get("body") else None
    magic = a.get("magic", "")
    return f"%%{magic} {a.get('line', '')}".rstrip() + "\n" + body.decode("utf-8", "replace") if body else \
        f"%{magic} {a.get('line', '')}".rstrip()


def replay(bundle: str | Path | Run, out: str | Path) -> Path:
    nb = to_notebook(open_run(bundle))
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise TkboxError(f"cannot write {out}: not a file name")
    from tkbox_nb.core.atomic_file import write_atomic
    text = nbformat.writes(nb)  # a notebook that cannot be written is refused before anything is
    try:
        write_atomic(out, text.encode("utf-8"))
    except OSError as e:
        raise TkboxError(f"cannot write {out}: {e.strerror or e}") from None
    return out


@dataclass
class Rerun:
    path: Path  # the new bundle
    named: str  # the original run, named as rerun_of in the new run's box manifest
    notes: list[str]  # what the rerun could not make the same (a different starting workspace)


def package_pins(run: Run) -> dict[str, dict[str, str]]:
    """The package files the run installed, as its records signed them: project -> file name -> sha256."""
    pins: dict[str, dict[str, str]] = {}
    for c in run.crossings():
        a = c.args or {}
        project, name, got = a.get("project"), a.get("filename"), a.get("got_sha256")
        if c.door == PACKAGES and a.get("kind") == "file" and c.decision == "allow" and isinstance(project, str) \
                and isinstance(name, str) and isinstance(got, str) and re.fullmatch(r"[0-9a-f]{64}", got):
            pins.setdefault(project, {})[name] = got
    return pins


def _from_bundle(policy, what: str, models_replayed: bool = False) -> None:
    """A policy a bundle's author chose never reads this host's secrets or keys nor sends its signer token: refused
    (one line, naming the section) unless the user passes the policy themselves (--policy). A model key is no read
    when the rerun serves model calls from the run's recordings (doors/model.py reads keys only live)."""
    section = policy.host_reads(models_replayed)
    if section is not None:
        raise TkboxError(f"{what} names {section}: a rerun does not read this host's secrets, keys or signer token "
                         "for a policy a bundle chose; pass --policy FILE to rerun under a policy you trust")


def _rerun_magics(nb):
    """Host magics as a rerun makes them again. No prompt is answered. `%box_policy PATH` never reads PATH (a host
    file the bundle names, maybe a FIFO or a key): it sets the policy the bundle discloses for that event, the one its
    host record was decided under (`disclosed`, set per event), or is refused in one line when there is none."""
    from tkbox_nb.box.notebook_box import HostMagics
    from tkbox_nb.policy import Policy

    class RerunMagics(HostMagics):
        disclosed: str | None = None

        def _box_policy(self, line: str, body: str | None) -> str:
            if body is not None or not line:
                return super()._box_policy(line, body)
            if self.disclosed is None:
                raise TkboxError("the run's %box_policy names a host file and the bundle does not disclose the "
                                 "policy it set: a rerun reads no host file a bundle names; pass --policy")
            return self.nb.set_policy(Policy.from_toml(self.disclosed, "the policy the run's %box_policy set"))

    return RerunMagics(nb, lambda prompt: (_ for _ in ()).throw(TkboxError("a rerun cannot answer a prompt")))


def _steps(run: Run) -> list:
    """The crossings a rerun makes again, in order: host magics, cells and commands (refused ones too: under the
    same policy they are refused again, and the audit compares the decisions)."""
    out = []
    for c in run.crossings():
        a = c.args or {}
        if c.door == HOST or c.door == EXEC and (a.get("kind") == "cell" or a.get("kind") == "command"
                                                     and isinstance(a.get("argv"), list) and a["argv"]):
            out.append(c)
    return out


def rerun_counts(steps: list) -> dict[int, int | None]:
    """Each cell's number in the rerun's box (its In/Out/_n), by seq: the number the original's box gave it, read
    from its signed result, a value the original box returned and so hostile. Only an int that is positive, below
    2**31 and above every number taken before it is taken; any other cell gets None (its box's own next number).
    The box's setter moves its count by at most guest/kernel.COUNT_MAX_JUMP as well."""
    out, last = {}, 0
    for c in steps:
        if c.door == EXEC and (c.args or {}).get("kind") == "cell":
            n = c.result.get("execution_count") if isinstance(c.result, dict) else None
            out[c.seq] = n if type(n) is int and last < n < 2 ** 31 else None
            last = out[c.seq] or last
    return out


def _data_differences(run: Run, policy: Any, home: str | Path | None) -> dict[str, str]:
    """mounts.rerun_differences for the run's signed box.start and disclosed mount lists."""
    from tkbox_nb.backends.mounts import rerun_differences
    from tkbox_nb.core.home import default_home
    start = next((c for c in run.crossings() if c.door == BOX and (c.args or {}).get("kind") == "start"), None)
    signed = (start.args or {}).get("mounts") if start else None
    if not signed and not policy.data.get("mounts"):
        return {}
    lists = {n: b for n, b in run._b.files.items() if n.startswith("box/mounts/")}
    return rerun_differences(signed, lists, policy, Path(home) if home else default_home())


def rerun(bundle: str | Path | Run, out: str | Path, policy: str | Path | None = None, home: str | Path | None = None,
          backend: str = "auto", workspace: str | Path | None = None, env: dict[str, str] | None = None,
          allow_changed_data: bool = False) -> Rerun:
    """Make the run's cells, commands and host magics again, in order, in a fresh box under the run's own starting
    policy (or `policy`), from `workspace`; model calls are answered from the run's recordings. `env` gives the values
    of the environment variables its commands set (a bundle holds their names only). Each dataset mount's data is
    digested first: data that differs from the original's is refused in one line naming the first differing file,
    unless `allow_changed_data` (the difference is then signed in the rerun's box.start)."""
    from tkbox_nb.box.box import BoxEnded
    from tkbox_nb.core.errors import DoorRefused
    from tkbox_nb.box.notebook_box import NotebookBox, split_host_magics
    from tkbox_nb.policy import Policy
    from tkbox_nb.core.tree_digest import digest_version, tree_digest
    run = open_run(bundle)
    models_replayed = any(c.door == MODEL for c in run.crossings())  # then served from recordings, as below
    if policy is None:
        source = run._b.policies.get((run.box.get("policy") or {}).get("hash", ""))
        if source is None:
            raise TkboxError("the bundle does not disclose the policy its box started with; pass --policy")
        policy = Policy.from_toml(source, f"the policy of run {run.run_id}")
        _from_bundle(policy, "the bundle's starting policy", models_replayed)
    steps = _steps(run)
    if not any(c.door == EXEC for c in steps):
        raise TkboxError("the run has no cell or command to execute")
    env = dict(env or {})
    names = sorted({str(n) for c in steps if isinstance((c.args or {}).get("env_names"), list)
                    for n in c.args["env_names"]})
    if [n for n in names if n not in env]:
        raise TkboxError(f"the run's commands set {', '.join(n for n in names if n not in env)[:300]}: a bundle "
                         "holds only the names of a command's environment; give the values (--env NAME)")
    if workspace is not None and not Path(workspace).is_dir():
        raise TkboxError(f"workspace {workspace} is not a directory")
    notes = []
    was = run.box.get("workspace_digest")  # compared in the version the original stated (core/tree_digest.py)
    policy = Policy.coerce(policy)  # its [workspace] exclude leaves out what the box will not be given
    now = tree_digest(workspace, digest_version(was) or 2, policy.get("workspace", "exclude")) \
        if workspace is not None else None
    if was != now:
        notes.append(f"the original started from workspace {was or 'none'}, this rerun from {now or 'none'}"
                     f"{f' ({workspace})' if workspace is not None else ''}: the audit reports it as different")
    elif digest_version(was) == 1:
        notes.append("the original stated its workspace as a version-1 tree digest, which this rerun's workspace has "
                     "too; the rerun states version 2 (docs/bundle-format.md), so the audit reports the workspace as "
                     "different")
    data_diffs = _data_differences(run, policy, home)
    if data_diffs and not allow_changed_data:
        name, first = next(iter(data_diffs.items()))
        source = policy.data.get("mounts", {}).get(name, {}).get("source", "none")  # the host path it would show
        raise TkboxError(f"mount {name} ({source}): its data differs from the original run's, first at {first} "
                         "(--allow-changed-data to rerun with it; the difference is then signed in the rerun's start)")
    notes += [f"mount {n}: its data differs from the original run's, first at {f}; signed in the rerun's box.start "
              "(differs_from_original), and the audit reports it" for n, f in data_diffs.items()]
    nb = NotebookBox(policy=policy, backend=backend, home=home, workspace=workspace)
    nb.mounts_original = data_diffs or None
    nb.policy_guard = lambda p: _from_bundle(p, f"the policy {p.name} the run's %box_policy sets", models_replayed)
    nb.replay_of = run.run_id
    if any(c.door == MODEL for c in run.crossings()):  # model calls are answered from the run's recordings
        from tkbox_nb.doors.model_replay import recordings_from_run
        nb.model_replay = recordings_from_run(run)
    nb.package_pins = package_pins(run) or None  # the package door serves the same bytes, or refuses naming the file
    magics, counts = _rerun_magics(nb), rerun_counts(steps)
    for c in steps:
        a = c.args or {}
        if c.door == HOST:
            magics.disclosed = run._b.policies.get(a.get("policy")) if isinstance(a.get("policy"), str) else None
            for name, line, body in split_host_magics(_host_source(run, c))[0]:
                if name not in RERUN_SKIPS:
                    try:
                        magics.run(name, line, body)
                    except TkboxError:  # e.g. a %box_policy the rerun refuses: no box is left running
                        nb.stop("rerun refused")
                        raise
            continue
        try:
            if a.get("kind") == "cell":  # with the user_expressions it was decided with
                asked = user_expressions(run, c)[0]
                if a.get("user_expressions") and not asked:
                    raise TkboxError(f"cell {c.seq}: its user_expressions are not disclosed in the bundle")
                nb.ensure_box().execute((run.content(a.get("code", "")) or b"").decode("utf-8", "replace"),
                                        user_expressions={str(k): str(v) for k, v in asked.items()} or None,
                                        execution_count=counts.get(c.seq))
                continue
            stdin = run.content(a["stdin"]) if a.get("stdin") else None
            if a.get("stdin") and stdin is None:
                raise TkboxError(f"command {c.seq}: its stdin is not disclosed in the bundle")
            timeout = a.get("timeout_s") if isinstance(a.get("timeout_s"), (int, float)) else None
            nb.ensure_box().run([str(x) for x in a["argv"]], stdin=stdin, timeout=timeout,
                                cwd=a.get("cwd") if isinstance(a.get("cwd"), str) else None,
                                env={str(n): env[str(n)] for n in a.get("env_names") or []})
        except DoorRefused:
            if nb.box is not None and nb.box.ended:
                break
        except BoxEnded:  # the box ended under this crossing (a timeout, a kill): the run ends here, as it may have
            break
    box = nb.box
    if box is None:
        raise TkboxError("the run's box did not start")
    box.bundle_path = Path(out)
    named = run.run_id
    nb.stop("rerun done")
    return Rerun(Path(out), named, notes)
