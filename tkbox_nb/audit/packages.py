"""The audit's view of what a run had installed: its environment (the manifest its box.start signed) and the files the
package door served during it, compared and named package by package.

Why: two runs of one notebook, one with pandas 3.1.1 and one with 1.5.3, differ in their results for a reason the
bundles carry, but a digest of the whole manifest would only say "the environment differs". So the compared value is
one line per item (the interpreter, each distribution by name, version and files digest, each Debian package), and a
difference is named item by item: `distribution pandas: 3.1.1 in A, 1.5.3 in B`, `only in B: distribution polars
1.0`, `distribution numpy 2.0.0: other files (...)`. Where each item lives (its location) is not compared: the same
distribution bound at another path is the same code. A file the package door served is compared by its project:
its version, file name, sha256 and decision.

Everything here comes from a bundle (hostile): lines are cut, lists capped (MAX_LINES), nothing is parsed twice.
"""

from __future__ import annotations

import json
from typing import Any

from tkbox_nb.core.errors import TkboxError

MAX_LINES = 40
NOT_RECORDED = "not recorded"


def _c(v: Any, limit: int = 200) -> str:
    """One word of a compared line: text, cut, with no space or newline (a line's fields are split on spaces)."""
    return "".join("_" if ch.isspace() else ch for ch in str(v)[:limit]) or "-"


def environment_lines(m: dict[str, Any] | None) -> list[str]:
    """A parsed manifest (bundle/environment.parse) as the lines the audit compares: `python IMPL VERSION
    PLATFORM`, `distribution NAME VERSION FILES_DIGEST`, `debian NAME VERSION ARCH`, sorted."""
    if m is None:
        return [f"{NOT_RECORDED} (a run made before tkbox recorded environments)"]
    if "unavailable" in m:
        return [f"{NOT_RECORDED} ({str(m['unavailable'])[:200]})"]
    e = m["environment"]
    i = e["interpreter"]
    out = [f"python {_c(i['implementation'])} {_c(i['version'])} {_c(i['platform'])}"]
    out += sorted(f"distribution {_c(d['name'].lower())} {_c(d['version'])} {_c(d.get('files_digest') or 'no-RECORD')}"
                  for d in e["distributions"])
    out += sorted(f"debian {_c(p['name'])} {_c(p['version'])} {_c(p['architecture'])}"
                  for p in e["debian"].get("packages", []))
    return out


def environment_field(run) -> tuple[str, str]:
    """(compared value, shown value) of a run's environment: its lines, and the summary with the manifest's
    digest."""
    from tkbox_nb.bundle.environment import summary
    try:
        m = run.environment_manifest()
    except TkboxError as e:
        line = f"unreadable: {str(e)[:200]}"
        return line, line
    lines = environment_lines(m)
    if m is None or "unavailable" in m:
        return lines[0], lines[0]
    return "\n".join(lines), f"{summary(m)} ({str(run.box.get('environment', ''))[:19]}...)"


def _by_name(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for line in lines:
        parts = line.split(" ")
        if len(parts) == 4:
            out.setdefault((parts[0], parts[1] if parts[0] != "python" else ""), []).append(line)
    return out


def _whole(lines: list[str]) -> str:
    if lines[:1] and lines[0].startswith("python "):
        return f"{lines[0][len('python '):]} with {sum(x.startswith('distribution ') for x in lines)} distributions"
    return lines[0][:200] if lines else "-"


def _cut(lines: list[str]) -> list[str]:
    return lines[:MAX_LINES] + ([f"... ({len(lines) - MAX_LINES} more)"] if len(lines) > MAX_LINES else [])


def environment_changes(va: str, vb: str) -> list[str]:
    """Two compared environments' differences, one line per item that differs, in name order."""
    la, lb = va.splitlines(), vb.splitlines()
    if not (la[:1] and la[0].startswith("python ")) or not (lb[:1] and lb[0].startswith("python ")):
        return [f"environment: {_whole(la)} in A, {_whole(lb)} in B"]  # one or both not recorded, or unreadable
    a, b = _by_name(la), _by_name(lb)
    out = []
    for key in sorted(set(a) | set(b), key=lambda k: ({"python": 0, "distribution": 1}.get(k[0], 2), k[1], k[0])):
        xa, xb = sorted(a.get(key, [])), sorted(b.get(key, []))
        if xa == xb:
            continue
        kind, name = key
        label = f"{kind} {name}".strip()
        if not xa or not xb:
            out.append(f"only in {'B' if not xa else 'A'}: " + "; ".join(" ".join(x.split(" ")[:3])
                                                                           for x in (xa or xb)))
            continue
        va_, vb_ = ([x.split(" ")[2] if kind != "python" else " ".join(x.split(" ")[1:]) for x in xs]
                    for xs in (xa, xb))
        if va_ != vb_:
            out.append(f"{label}: {', '.join(va_)} in A, {', '.join(vb_)} in B")
        else:  # same version, other files (a distribution) or architecture (a Debian package)
            what = "other files" if kind == "distribution" else "other architecture"
            out.append(f"{label} {', '.join(va_)}: {what} ({', '.join(x.split(' ')[3][:19] for x in xa)} in A, "
                       f"{', '.join(x.split(' ')[3][:19] for x in xb)} in B)")
    return _cut(out)


# -- the files the package door served, by project ---------------------------------------------------------------------
def package_value(kind: str, a: dict[str, Any], decision: str) -> str:
    """A package door crossing as the audit compares it: JSON of what it is (kind, project, version, file, sha256,
    decision and rule), so a difference can be named field by field."""
    return json.dumps({"kind": str(kind)[:20], "project": str(a.get("project", ""))[:200],
                       "version": str(a.get("version", ""))[:100], "filename": str(a.get("filename", ""))[:300],
                       "sha256": str(a.get("sha256", ""))[:64], "decision": str(decision)[:40],
                       "rule": str(a.get("rule", ""))[:200]}, sort_keys=True)


def package_shown(value: str) -> str:
    p = _load(value)
    if p is None:
        return value[:200]
    if p["kind"] == "project":
        return f"{p['project']} (index page) {p['decision']} ({p['rule']})"
    return (f"{p['project']} {p['version']} {p['filename']} sha256 {p['sha256'][:12]} {p['decision']} "
            f"({p['rule']})")


def _load(value: str) -> dict[str, str] | None:
    try:
        p = json.loads(value)
    except ValueError:
        return None
    return p if isinstance(p, dict) and all(isinstance(p.get(k), str) for k in (
        "kind", "project", "version", "filename", "sha256", "decision", "rule")) else None


def package_changes(va: str, vb: str) -> list[str]:
    """How one project's crossing differs between two runs: its version, its file's bytes, its decision, or that
    only one run has it."""
    pa, pb = _load(va), _load(vb)
    if pa is None and pb is None:
        return []
    if pa is None or pb is None:
        p = pa or pb
        return [f"{p['project']}: only in {'A' if pb is None else 'B'} ({package_shown(va if pb is None else vb)})"]
    name, out = pa["project"] or pb["project"], []
    if pa["kind"] != pb["kind"]:
        return [f"{name}: {package_shown(va)} in A, {package_shown(vb)} in B"]
    if pa["version"] != pb["version"]:
        out.append(f"{name}: {pa['version'] or '-'} in A, {pb['version'] or '-'} in B")
    if pa["filename"] != pb["filename"]:
        out.append(f"{name}: file {pa['filename'] or '-'} in A, {pb['filename'] or '-'} in B")
    elif pa["sha256"] != pb["sha256"]:
        out.append(f"{name} {pa['version']}: other bytes ({pa['filename']}: sha256 {pa['sha256'][:16]} in A, "
                   f"{pb['sha256'][:16]} in B)")
    if (pa["decision"], pa["rule"]) != (pb["decision"], pb["rule"]):
        out.append(f"{name}: {pa['decision']} ({pa['rule']}) in A, {pb['decision']} ({pb['rule']}) in B")
    return out
