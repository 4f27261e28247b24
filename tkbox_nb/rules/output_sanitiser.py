"""What of a box's rich output the frontend may render: an allowlist of MIME types, HTML and Markdown sanitised.

JupyterLab and Notebook treat a live output as trusted: HTML in it runs its `<script>` and `onerror=` handlers, SVG
its scripts, and a link or a MathJax `\\href` to `javascript:` runs on a click, all in the notebook's origin, where
script could type a looser `%%box_policy` into the kernel (docs/threat-model.md, I14). So, of a mimebundle from the
box, only inert types pass (`INERT`), `text/html` and `text/markdown` only after sanitising with nh3 (ammonia):
scripts, event handlers, style, iframes, objects, embeds, forms and SVG go, only http, https and mailto URLs stay,
an image only from a relative URL (a remote one would carry data out past the egress door), tables stay (pandas).
Everything else (SVG images, JavaScript, PDF, third-party renderers' JSON) is dropped. Each removal, and each text
that sanitising changed, is named in `dropped`, which the cell's signed result carries.

Widget state carries markup too: rules/widget_state.py checks it, with `outputs` (an Output widget's) and `clean_html`
from here. Pure functions of their input.
"""

from __future__ import annotations

import html as _html
import re
from typing import Any

import nh3

from tkbox_nb.core.visible import visible

INERT = frozenset({"text/plain", "text/latex", "image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp",
                   "application/json", "application/vnd.jupyter.widget-view+json"})
SANITISED = frozenset({"text/html", "text/markdown"})
ALLOWED = INERT | SANITISED
BOX_PROMPT = "[box] "  # every prompt from the box starts with it, each line; no host one does (jupyter/kernel/stdin.py)

_TAGS = set(nh3.ALLOWED_TAGS) | {"tfoot"}
_ATTRIBUTES = {tag: set(attrs) for tag, attrs in nh3.ALLOWED_ATTRIBUTES.items()}
_ATTRIBUTES["table"] = _ATTRIBUTES.get("table", set()) | {"class", "border"}  # pandas: <table border="1" class=...>
_URL_SCHEMES = {"http", "https", "mailto"}
# a URL scheme that runs or smuggles script, as a browser, marked or MathJax would read it (entities decoded,
# whitespace and control characters gone); data: only where a URL starts, so prose such as "data: 5 rows" passes
_SCRIPT_URL = re.compile(r"(?:javascript|vbscript|livescript):|[(<\[{:=\"'`]data:")
_REMOTE = re.compile(r"[a-z][a-z0-9+.\-]*:|[/\\]{2}")  # a scheme, or a network path (//host, \\host)
_TEXT_OUTPUT_KEYS = frozenset({"output_type", "name", "text", "ename", "evalue", "traceback"})
_LINE_BREAKS = re.compile(r"\r\n|[\r\n\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")
_ESCAPED = re.compile(r"\\([!-/:-@\[-`{-~])")  # a CommonMark backslash escape of ASCII punctuation


def _flat(text: str) -> str:
    """`text` as a browser, marked or MathJax could read a URL in it: HTML entities and Markdown backslash escapes
    undone (nested ones too), lower case, whitespace and invisible characters gone."""
    for _ in range(4):
        undone = _ESCAPED.sub(r"\1", _html.unescape(text))
        if undone == text:
            break
        text = undone
    return "".join(ch for ch in text.lower() if ch > " " and ch not in "\x7f\u00ad\u200b\u200c\u200d\ufeff")


def _names_script_url(text: str) -> bool:
    return bool(_SCRIPT_URL.search(_flat(text)))


def _local_images_only(tag: str, attr: str, value: str) -> str | None:
    """An image the browser would fetch by itself may name only a relative URL: a remote one would carry what the
    box knows out of the page, past the egress door (a link needs the user's click, and keeps its URL)."""
    if tag == "img" and attr == "src" and _REMOTE.match("".join(ch for ch in value.lower() if ch > " ")):
        return None
    return value


def clean_html(text: str) -> str | None:
    """`text` as HTML the frontend may render, or None when it must be dropped whole (a script URL in its text,
    which MathJax or a renderer could still make live)."""
    cleaned = nh3.clean(text, tags=_TAGS, attributes=_ATTRIBUTES, url_schemes=_URL_SCHEMES,
                        clean_content_tags={"script", "style"}, strip_comments=True,
                        attribute_filter=_local_images_only)
    return None if _names_script_url(cleaned) else cleaned


def clean_markdown(text: str) -> str | None:
    """Markdown whose raw HTML is sanitised as `clean_html`; None when a link, image or formula names a script
    URL, or an image may be remote: with `![` or `<img` in it, any `scheme:` or `//` anywhere (a browser fetches
    `http:host/x` from host, with no slashes), escapes and entities undone first. `&gt;` is given back as `>`
    (blockquotes): a lone `>` opens no tag."""
    flat = _flat(text)
    if _SCRIPT_URL.search(flat) or (("![" in flat or "<img" in flat) and _REMOTE.search(flat)):
        return None
    cleaned = clean_html(text)
    return None if cleaned is None else cleaned.replace("&gt;", ">")


def mimebundle(data: dict, what: str, dropped: list[str]) -> dict:
    """The part of a mimebundle the frontend may see: allowlisted types (matched case-insensitively, given under
    their lower-case name), text sanitised. Everything removed or changed is named in `dropped`."""
    out: dict[str, Any] = {}
    for mime, value in data.items():
        key = mime.strip().lower()
        if key not in ALLOWED or key in out:
            dropped.append(f"{what}:{mime}")
            continue
        if key in SANITISED or key in ("text/plain", "text/latex"):
            if not isinstance(value, str):
                dropped.append(f"{what}:{mime} (not text)")
                continue
            cleaned = value if key == "text/plain" else \
                {"text/html": clean_html, "text/markdown": clean_markdown}.get(key, _latex)(value)
            if cleaned is None:
                dropped.append(f"{what}:{mime} (a script URL or a remote image)")
                continue
            if cleaned != value:
                dropped.append(f"{what}:{mime} (sanitised)")
            value = cleaned
        out[key] = value
    return out


def _latex(text: str) -> str | None:
    return None if _names_script_url(text) else text


def outputs(items: Any, what: str, dropped: list[str]) -> list:
    """An Output widget's outputs (nbformat outputs): rich data filtered as `mimebundle`; streams and errors pass;
    anything else is dropped."""
    if not isinstance(items, list):
        dropped.append(f"{what}: not a list")
        return []
    kept = []
    for item in items:
        kind = item.get("output_type") if isinstance(item, dict) else None
        if kind in ("display_data", "execute_result") and isinstance(item.get("data"), dict):
            out = {"output_type": kind, "data": mimebundle(item["data"], f"{what}.data", dropped),
                   "metadata": item["metadata"] if isinstance(item.get("metadata"), dict) else {}}
            if kind == "execute_result":
                out["execution_count"] = item.get("execution_count")
            kept.append(out)
        elif kind in ("stream", "error"):  # shown as text; only their own fields pass
            kept.append({k: v for k, v in item.items() if k in _TEXT_OUTPUT_KEYS})
        else:
            dropped.append(f"{what}:{str(kind)[:40]}")
    return kept


def box_display_id(box_id: str, display_id: str) -> str:
    """A box's display id as the frontend sees it, in that box's own namespace: a box's `update_display_data`
    updates only its own displays, never the host's nor another box's (the kernel, and the extension's `%%box`)."""
    return f"tkbox-{box_id}-{display_id}"


def box_prompt(prompt: str) -> str:
    """A prompt from the box as the frontend shows it: every line starts with `BOX_PROMPT`, so no prompt of the
    box can pass for the host's own (%box_secret's password prompt); every other control character (C0, C1: a
    backspace or an ANSI escape would hide the mark in a terminal) and format character (bidi overrides, zero-width
    ones) is shown as its escape, `\\x08`, `\\u202e`."""
    return "\n".join(BOX_PROMPT + visible(line) for line in _LINE_BREAKS.split(prompt))
