"""How common servers write a string back (an echo of a secret value): each a function of text to bytes, as the
escaper of that server writes it. Used by the `secrets-echo` fuzz target, the scrubber's unit tests and the echo
server of the end-to-end tests, so all three check the same spellings."""

from __future__ import annotations

import html
import json
import re
from typing import Callable
from urllib.parse import quote, quote_plus


def go_json(text: str) -> bytes:
    """Go's encoding/json: UTF-8 kept, `< > &` and U+2028/U+2029 as lower-case `\\u` escapes."""
    out = json.dumps(text, ensure_ascii=False)[1:-1]
    for c in "<>&\u2028\u2029":
        out = out.replace(c, "\\u%04x" % ord(c))
    return out.encode("utf-8")


def dotnet_json(text: str) -> bytes:
    """.NET's System.Text.Json default encoder: every non-ASCII character and `+ < > & " ' \\`` as upper-case `\\u`
    escapes (UTF-16, so a surrogate pair beyond the BMP)."""
    out = []
    for c in text:
        if c in "\"\\":
            out.append("\\" + c if c == "\\" else "\\u0022")
        elif ord(c) < 0x20 or ord(c) > 0x7E or c in "+<>&'`":
            units = c.encode("utf-16-be")
            out += ["\\u%02X%02X" % (units[i], units[i + 1]) for i in range(0, len(units), 2)]
        else:
            out.append(c)
    return "".join(out).encode("ascii")


def python_json(text: str) -> bytes:
    return json.dumps(text)[1:-1].encode("ascii")


def html_template(text: str) -> bytes:
    """An HTML template's autoescape (Jinja2, Django, Go's html/template in text): `& < > " '` as references."""
    return html.escape(text, quote=True).encode("utf-8")


def html_numeric(text: str) -> bytes:
    return "".join(f"&#{ord(c)};" if not c.isalnum() or ord(c) > 0x7E else c for c in text).encode("ascii")


def html_hex(text: str) -> bytes:
    return "".join(f"&#X{ord(c):X};" if not c.isalnum() or ord(c) > 0x7E else c for c in text).encode("ascii")


def latin1_wsgi(text: str) -> bytes:
    """A WSGI server (PEP 3333) reads a header as latin-1; the app writes the str it got back as UTF-8."""
    return text.encode("utf-8").decode("latin-1").encode("utf-8")


def latin1_wsgi_json(text: str) -> bytes:
    return python_json(text.encode("utf-8").decode("latin-1"))


ECHOES: dict[str, Callable[[str], bytes]] = {
    "raw": lambda t: t.encode("utf-8"),
    "go-json": go_json, "dotnet-json": dotnet_json, "python-json": python_json,
    "python-json-utf8": lambda t: json.dumps(t, ensure_ascii=False)[1:-1].encode("utf-8"),
    "html-template": html_template, "html-numeric": html_numeric, "html-hex": html_hex,
    "latin1-wsgi": latin1_wsgi, "latin1-wsgi-json": latin1_wsgi_json,
    "percent": lambda t: quote(t, safe="").encode("ascii"),
    "percent-lower": lambda t: re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(t, safe="")).encode(),
    "form": lambda t: quote_plus(t, safe="").encode("ascii"),
    "percent-keep-slash": lambda t: quote(t).encode("ascii"),
}


SPELLERS = {"json": ("go-json", "dotnet-json", "python-json"), "html": ("html-template", "html-numeric", "html-hex"),
            "percent": ("percent", "percent-lower", "form")}
ESCAPE_CHARACTERS = {"json": "\\", "html": "&", "percent": "%"}
PAIRS = ("json+html", "json+percent", "html+percent")


def mixed(text: str, picks: bytes, pair: str = "json+html") -> bytes:
    """One echo mixing two escapings character by character (JSON in an HTML page, a form field in JSON): character i
    spelled as `picks[i]` chooses among the two families' spellers and the raw character; an escape character of
    either family is always escaped by a speller that changes it, as an escaper escapes its own."""
    names = pair.split("+")
    spellers = ["raw"] + [s for n in names for s in SPELLERS[n]]
    special = "".join(ESCAPE_CHARACTERS[n] for n in names)
    out = []
    for i, c in enumerate(text):
        usable = [s for s in spellers if c not in special or ECHOES[s](c) != c.encode("utf-8")]
        out.append(ECHOES[usable[picks[i % len(picks)] % len(usable)] if picks else usable[0]](c))
    return b"".join(out)
