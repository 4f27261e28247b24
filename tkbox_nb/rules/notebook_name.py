"""The notebook a kernel's frontend names (`JPY_SESSION_NAME`), as a run signs it: so a bundle names its notebook
and a notebook's bundles are named after it (`.tkbox/runs/NOTEBOOK-TIME-N.tkb`).

The name is the frontend's input (JupyterLab, Notebook 7 and VS Code set it for the kernel they start), never the
box's: the box cannot change the kernel's environment, and nothing here opens or follows the path. Still it is text
from outside that `tkbox show`, `%box_status` and a file name will carry, so it is recorded only when it is a plain
name of bounded length; otherwise nothing of it is kept and the reason is recorded in its place. Nothing is guessed
when the frontend says nothing (nbclient and papermill do not): the run then names no notebook. Pure functions.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from tkbox_nb.core.visible import visible_char

MAX_CHARS = 1024  # a notebook's path as a frontend names it (PATH_MAX is 4096; a longer name is not recorded)
MAX_STEM = 80
SOURCE = "JPY_SESSION_NAME"


def notebook_facts(raw: str | None) -> dict[str, str]:
    """What box.start signs of the name the frontend gave: `{"notebook": name}`, or `{"notebook_dropped": why}`
    when it is not recorded (not valid UTF-8, over MAX_CHARS, a control or format character), or `{}` for none."""
    if not raw:
        return {}
    try:
        raw.encode("utf-8")  # os.environ keeps bytes that are not UTF-8 as lone surrogates
    except UnicodeEncodeError:
        return {"notebook_dropped": f"{SOURCE} is not valid UTF-8"}
    if len(raw) > MAX_CHARS:
        return {"notebook_dropped": f"{SOURCE} is {len(raw)} characters, over {MAX_CHARS}"}
    bad = next((c for c in raw if visible_char(c) != c), None)
    if bad is not None:
        return {"notebook_dropped": f"{SOURCE} holds a control or format character ({visible_char(bad)})"}
    return {"notebook": raw}


def bundle_stem(facts: dict[str, str]) -> str:
    """The file-name stem of the notebook's bundles: the notebook's own stem in letters, digits, `.`, `_` and `-`
    (anything else `_`), at most MAX_STEM characters, never starting with a dot; `box` when no notebook is named."""
    name = PurePosixPath(facts.get("notebook") or "box").stem
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:MAX_STEM].lstrip(".")
    return stem or "box"


def bundle_name(facts: dict[str, str], when: str, n: int) -> str:
    """A kernel's n-th bundle, its box started at `when`: `NOTEBOOK-WHEN-N.tkb` (docs/jupyter.md)."""
    return f"{bundle_stem(facts)}-{when}-{n}.tkb"


def describe(box: dict) -> str:
    """What a run's signed facts (its box manifest, or the recorder's) say of its notebook, in words (unescaped)."""
    if isinstance(box.get("notebook"), str):
        return box["notebook"]
    if isinstance(box.get("notebook_dropped"), str):
        return f"not recorded: {box['notebook_dropped']}"
    return "none named by the frontend"
