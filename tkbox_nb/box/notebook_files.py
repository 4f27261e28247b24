"""`%box_pull PATH...` and `%box_push PATH...`: files between the notebook's folder and its box while it runs.

Before, results came back only when the box stopped (or with `%box_patch`, all at once). `%box_pull` brings the named
files now, each decided by the `[patch]` rules and signed as a patch file is (doors/patch.py, with `only`), and
written by the same writer (doors/workspace_writer.py): never outside the folder, never through a symlink, never over a
file the user changed on the host since the box started, nothing half-written. `%box_push` copies host files of the
notebook's folder into the box's workspace through the exec door (a command whose stdin is the file, signed by its
digest): only regular files (a FIFO is refused, never opened for a blocking read), within `[workspace] max_mib`.

Every name is checked before anything moves (patch_rules.path_problem: relative, no `..`, no control characters);
a bad one stops the whole magic with one line. Each file's outcome is one line, a refusal naming its rule and the
setting that would allow it.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path
from typing import Any

from tkbox_nb.rules.patch_rules import path_problem
from tkbox_nb.core.errors import DoorRefused, TkboxError

# what to change for a refusal by a [patch] rule (doors/patch.py's rule ids, up to their index)
SETTING = {"patch.allow": "add it to [patch] allow", "patch.deny": "remove the [patch] deny entry",
           "patch.max_file_bytes": "raise [patch] max_file_bytes", "patch.max_total_bytes":
           "raise [patch] max_total_bytes", "patch.max_files": "raise [patch] max_files",
           "patch.binary": "set [patch] binary = true",
           "patch.deny_default": "none: such a path (secrets, keys) never comes back",
           "patch.type": "none: only regular files come back", "patch.git": "none: .git is never written",
           "patch.overwrite": "none: the box added a file the host already had"}

WRITE_IN_BOX = ("import os, sys\np = sys.argv[1]\nd = os.path.dirname(p)\nif d: os.makedirs(d, exist_ok=True)\n"
                "t = p + '.tkbox-push'\nwith open(t, 'wb') as f: f.write(sys.stdin.buffer.read())\n"
                "os.chmod(t, int(sys.argv[2], 8))\nos.replace(t, p)\n")


def _paths(magic: str, line: str) -> list[str]:
    try:
        paths = shlex.split(line)
    except ValueError as e:
        raise TkboxError(f"%{magic}: {e}") from None
    if not paths:
        raise TkboxError(f"%{magic}: name the files, relative to the notebook's folder (%{magic} PATH...)")
    for path in paths:
        why = path_problem(path)
        if why:
            raise TkboxError(f"%{magic}: {path[:200]!r}: {why}: name a file inside the notebook's folder, relative "
                             "to it; nothing moved")
    return paths


def _live_box(nb: Any, magic: str) -> Any:
    if not nb.live:
        raise TkboxError(f"%{magic}: no box is running (run a cell first)")
    return nb.box


def pull(nb: Any, line: str) -> str:
    """`%box_pull PATH...`: the box's changes to those files, decided, signed and written into the folder now."""
    paths = _paths("box_pull", line)
    box = _live_box(nb, "box_pull")
    if box.workspace is None:
        raise TkboxError("%box_pull: this box was started with no host folder (TKBOX_WORKSPACE or [workspace] path "
                         "= none): there is nowhere to pull into")
    patch = box.patch("auto", only=frozenset(paths))
    out = []
    for f in patch.files:
        rule = f.rule.split("[", 1)[0]
        if f.decision != "allow":
            out.append(f"{f.path}: refused by {f.rule}: {f.reason} (to allow it: {SETTING.get(rule, 'see [patch]')})")
        elif f.applied:
            out.append(f"{f.path}: pulled ({'deleted' if f.op == 'delete' else f'{f.size} bytes'}), signed")
        else:
            out.append(f"{f.path}: not written: {f.apply_reason}")
    decided = {f.path for f in patch.files}
    out += [f"{p}: not changed in the box since it started (nothing to pull)" for p in paths if p not in decided]
    return "\n".join(out)


def push(nb: Any, line: str) -> str:
    """`%box_push PATH...`: host files of the notebook's folder copied into the box's workspace, each signed."""
    paths = _paths("box_push", line)
    box = _live_box(nb, "box_push")
    folder = box.workspace or nb.folder or Path(os.getcwd())
    cap = box.policy.get("workspace", "max_mib") << 20
    files = []
    for path in paths:  # every file read before any is sent: a bad one sends none
        try:
            fd = os.open(folder / path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            why = "a symbolic link (never followed)" if e.errno == 40 else e.strerror or str(e)
            raise TkboxError(f"%box_push: {path[:200]!r}: {why}; nothing pushed") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise TkboxError(f"%box_push: {path[:200]!r} is not a regular file (only files are pushed); nothing "
                                 "pushed")
            if st.st_size > cap:
                raise TkboxError(f"%box_push: {path[:200]!r} is {st.st_size} bytes, over [workspace] max_mib; "
                                 "nothing pushed (give data as a dataset mount, [mounts.NAME])")
            files.append((path, f.read(cap + 1)[:cap], st.st_mode & 0o755 | 0o644))
    out = []
    for path, data, mode in files:
        try:
            r = box.run(["python3", "-c", WRITE_IN_BOX, path, oct(mode)], stdin=data, cwd="/workspace")
        except DoorRefused as e:
            out.append(f"{path}: refused: {e}")
            continue
        out.append(f"{path}: pushed ({len(data)} bytes), signed" if r.exit_code == 0 else
                   f"{path}: the box could not write it: {r.stderr.decode('utf-8', 'replace').strip()[-200:]}")
    return "\n".join(out)
