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


def mixed(text: str, picks: bytes) -> bytes:
    """One echo mixing spellings character by character (an escaper that escapes some characters one way, some
    another): character i spelled by the echo `picks[i]` chooses, of those that spell one character on its own; the
    escape characters `\\ % & +` are always escaped, as an escaper escapes its own."""
    per_char = ("raw", "go-json", "dotnet-json", "python-json", "html-template", "html-numeric", "html-hex",
                "percent", "percent-lower")
    out = []
    for i, c in enumerate(text):
        name = per_char[picks[i % len(picks)] % len(per_char)] if picks else "raw"
        if c in "\\%&+" and name in ("raw", "html-template", "html-numeric", "html-hex"):
            name = "dotnet-json"
        out.append(ECHOES[name](c))
    return b"".join(out)
