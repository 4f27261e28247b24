"""The patch as a `git apply`-compatible diff, so a reviewer can read a bundle's patch with ordinary tools.

Text files get unified hunks (with git's "\\ No newline at end of file" marks); a binary file is named with git's
"Binary files ... differ" line (its bytes are in the bundle's content, by digest, not in the diff).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from tkbox_nb.rules.patch_rules import is_binary


@dataclass
class DiffFile:
    path: str
    op: str                   # add, modify, delete, rename
    old: bytes | None         # the content the box started from (None: absent)
    new: bytes | None         # the content it ends with (None: deleted)
    mode: int = 0o644         # as written (patch_rules.planned_mode), shown as it is: any change of mode shows
    old_mode: int = 0o644     # as the box started with it
    source: str | None = None


def _lines(data: bytes) -> list[str]:
    return data.decode("utf-8").splitlines(keepends=True)


def _hunks(old: bytes, new: bytes, a: str, b: str) -> list[str]:
    out = []
    for line in difflib.unified_diff(_lines(old), _lines(new), a, b, n=3):
        if line.startswith(("---", "+++")):
            out.append(line if line.endswith("\n") else line + "\n")
            continue
        if line.endswith("\n"):
            out.append(line)
        else:  # the last line of a file without a final newline
            out.append(line + "\n\\ No newline at end of file\n")
    return out


def render(files: list[DiffFile]) -> bytes:
    out: list[str] = []
    for f in sorted(files, key=lambda f: f.path):
        src = f.source if f.op == "rename" else f.path
        out.append(f"diff --git a/{src} b/{f.path}\n")
        mode, old_mode = (f"{0o100000 | m & 0o777:o}" for m in (f.mode, f.old_mode))
        if f.op == "add":
            out.append(f"new file mode {mode}\n")
        elif f.op == "delete":
            out.append(f"deleted file mode {old_mode}\n")
        else:
            if mode != old_mode:
                out.append(f"old mode {old_mode}\nnew mode {mode}\n")
            if f.op == "rename":
                out.append(f"similarity index {100 if f.old == f.new else 50}%\n"
                           f"rename from {src}\nrename to {f.path}\n")
        old, new = f.old or b"", f.new or b""
        if old == new:
            continue
        a = "/dev/null" if f.op == "add" else f"a/{src}"
        b = "/dev/null" if f.op == "delete" else f"b/{f.path}"
        if is_binary(old) or is_binary(new):
            out.append(f"Binary files {a} and {b} differ\n")
            continue
        out += _hunks(old, new, a, b)
    return "".join(out).encode("utf-8")
