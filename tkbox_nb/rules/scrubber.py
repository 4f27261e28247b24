"""The response scrubber of the secrets door: finds a secret value however a server spells it back, sans-IO.

A bound host echoing a value writes it in its own escaping: Python's json (`\\u00e9`), Go's encoding/json
(`\\u0026 \\u003c \\u003e`), .NET's System.Text.Json (`\\u002B`, upper-case hex), an HTML template (`&amp; &#43;
&#x2b;`), a form or URL encoder (`%2B`, `%2b`, `+` for a space), a latin-1 WSGI server (the value's UTF-8 read as
latin-1 and written again as UTF-8). Listing every spelling does not scale: escapers differ in which characters they
escape and how, and one echo may mix two, so the combinations of a value's characters multiply. So the scrubber
normalises instead: it decodes the response's escapes into a canonical text, keeping where each canonical byte came
from, searches that text for the value's canonical spellings (its bytes, its latin-1 or cp1252 mojibake, its base64
at any alignment and its hex), and stars the original bytes each match came from.

It decodes once per escape family (none; JSON and backslash escapes; percent-encoding; HTML character references;
each two of these mixed, as JSON in an HTML page writes both), each from its own position in the stream: a box that
puts an escape character in front of the value (it writes the rest of the bound header) desyncs one family's reading
only, and an escaper escapes its own escape character, so the family the server used reads the echo exactly. Every
family reads the bytes as they came; the stars go on as the bytes go out. Not found: a value escaped twice over (HTML
of JSON of it), compressed, encrypted or split by the server (threat model I24, I65). Each family's pass is a
regular-expression scan and `bytes.find` over the new bytes only, skipped where none of its escape characters is, and
a stream holds back only what could still begin a match.
"""

from __future__ import annotations

import base64
import bisect
import functools
import html.entities
import re

MIN_ENCODED_FORM = 8   # a derived spelling (base64, hex) shorter than this is not scrubbed: too likely in other bytes
MAX_TOKEN = 40         # the longest escape read as one character (a named HTML reference is at most 33 bytes)

_JSON = (rb"\\u(?P<hi>[dD][89abAB][0-9a-fA-F]{2})\\u(?P<lo>[dD][c-fC-F][0-9a-fA-F]{2})"  # a surrogate pair
         rb"|\\u(?P<u>[0-9a-fA-F]{4})|\\U(?P<U>[0-9a-fA-F]{8})|\\x(?P<x>[0-9a-fA-F]{2})"
         rb"|\\(?P<simple>[\\/\"'bfnrt])")
_PERCENT = rb"%u(?P<pu>[0-9a-fA-F]{4})|%(?P<byte>[0-9a-fA-F]{2})"
_HTML = rb"&#(?P<dec>[0-9]{1,8});?|&#[xX](?P<hex>[0-9a-fA-F]{1,7});?|&(?P<name>[A-Za-z][A-Za-z0-9]{1,31};)"
_SIMPLE = {b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t"}
_PARTS = {"json": (_JSON, b"\\"), "percent": (_PERCENT, b"%"), "html": (_HTML, b"&")}
# each family: the escapes it reads (none for "raw"; two for a pair, as JSON inside HTML writes both) and the bytes
# that begin them: a family reads only literal bytes where none of its escape characters is
FAMILIES: dict[str, tuple[re.Pattern | None, tuple[bytes, ...]]] = {"raw": (None, ())}
for _names in ("json", "percent", "html", "json+html", "json+percent", "html+percent"):
    FAMILIES[_names] = (re.compile(b"|".join(_PARTS[n][0] for n in _names.split("+"))),
                        tuple(_PARTS[n][1] for n in _names.split("+")))
_PLUS = bytes.maketrans(b" ", b"+")  # in form encoding `+` is a space: the families reading it read both as `+`
_FORMS = ("percent", "json+percent", "html+percent")


def _char(cp: int) -> bytes | None:
    if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
        return None
    return chr(cp).encode("utf-8")


_ANY = re.compile(b"|".join(p for p, _ in _PARTS.values()))


@functools.lru_cache(maxsize=4096)
def _decode(token: bytes) -> bytes | None:
    """The bytes one escape stands for (the same in every family that reads it), None when it stands for none (a
    lone surrogate, an unknown name). Cached: a page repeats a few escapes (`&amp;`, `\\u00e9`) many times."""
    m = _ANY.fullmatch(token)
    g = {k: v for k, v in m.groupdict().items() if v is not None}
    if "hi" in g:
        return _char(0x10000 + ((int(g["hi"], 16) - 0xD800) << 10) + (int(g["lo"], 16) - 0xDC00))
    for key in ("u", "U", "x", "pu", "hex"):  # `\xHH` is a code point, as JSON5 and JavaScript read it
        if key in g:
            return _char(int(g[key], 16))
    if "dec" in g:
        return _char(int(g["dec"]))
    if "simple" in g:
        return _SIMPLE.get(g["simple"], g["simple"])
    if "byte" in g:
        return bytes([int(g["byte"], 16)])
    text = html.entities.html5.get(g["name"].decode("ascii"))
    return text.encode("utf-8") if text is not None else None


def _escapes_in(data: bytes, family: str) -> bool:
    """Whether the family could read anything but literal bytes in `data`: one of its escape characters is there
    (form encoding's `+` counts for the percent families)."""
    starts = FAMILIES[family][1] + ((b"+",) if family in _FORMS else ())
    return any(c in data for c in starts)


def canonical(data: bytes, family: str, final: bool = True) -> tuple[bytes, list[tuple[int, int, int, bool]], int]:
    """(canonical text, segments, stop): `data[:stop]` with each escape of the family decoded. A segment is
    (canonical start, original start, original end, is_escape): literal bytes map one to one, an escape's decoded
    bytes all to its whole span. Unless `final`, the last MAX_TOKEN bytes are left for more data (an escape may be cut
    there) unless an escape starting before them runs into them."""
    pattern = FAMILIES[family][0]
    if pattern is None or not _escapes_in(data, family):
        return (data.translate(_PLUS) if family in _FORMS else data), [(0, 0, len(data), False)], len(data)
    limit = len(data) if final else max(0, len(data) - MAX_TOKEN)
    out, segs, at = bytearray(), [], 0
    for m in pattern.finditer(data):
        if m.start() >= limit:
            break
        decoded = _decode(m.group())
        if decoded is None:
            continue
        if m.start() > at:
            segs.append((len(out), at, m.start(), False))
            out += data[at:m.start()]
        segs.append((len(out), m.start(), m.end(), True))
        out += decoded
        at = m.end()
    stop = max(at, limit)
    if stop > at or not segs:
        segs.append((len(out), at, stop, False))
        out += data[at:stop]
    text = bytes(out)
    return (text.translate(_PLUS) if family in _FORMS else text), segs, stop


def _origin(segs: list[tuple[int, int, int, bool]], starts: list[int], i: int) -> tuple[int, int]:
    """The original span of canonical byte i."""
    k = bisect.bisect_right(starts, i) - 1
    c0, o0, o1, escape = segs[k]
    return (o0, o1) if escape else (o0 + i - c0, o0 + i - c0 + 1)


def _base64_cores(value: bytes, alphabet: str) -> list[bytes]:
    """The characters of `value`'s base64 that do not depend on what is around it, for each of the three places it
    can start in a longer encoded text (so `user:VALUE` in a Basic header or a JSON field's base64 is found too)."""
    encode = base64.b64encode if alphabet == "std" else base64.urlsafe_b64encode
    cores = []
    for k in range(3):
        text = encode(b"\0" * k + value).rstrip(b"=")
        first = -(-8 * k // 6)                       # the first character holding no bit of the bytes before it
        last = (8 * (k + len(value))) // 6           # characters wholly within the value's bits
        cores.append(text[first:last])
    return cores


def encoded_forms(value: str) -> list[bytes]:
    """The spellings of a value searched for in each canonical text: its UTF-8 bytes, its UTF-8 read as latin-1 or
    cp1252 and written as UTF-8 (mojibake), its latin-1 or cp1252 bytes, base64 and base64url (at any alignment, at
    least MIN_ENCODED_FORM characters) and hex (either case). Escaped spellings (JSON, percent, HTML) are not listed:
    the canonical texts decode them."""
    raw = value.encode("utf-8")
    forms = {raw}
    for codec in ("latin-1", "cp1252"):
        for make in (lambda: raw.decode(codec).encode("utf-8"), lambda: value.encode(codec)):
            try:
                forms.add(make())
            except UnicodeError:
                pass
    derived = {raw.hex().encode("ascii"), raw.hex().upper().encode("ascii")}
    for alphabet in ("std", "url"):
        derived |= set(_base64_cores(raw, alphabet))
    forms |= {f for f in derived if len(f) >= MIN_ENCODED_FORM}
    return sorted((f for f in forms if f), key=len, reverse=True)


class Scrubber:
    """Removes secret values from a byte stream (a response on its way into the box), across chunk boundaries:
    each match of a value's spelling in any family's canonical text stars the original bytes it came from, byte for
    byte (so lengths, and Content-Length, stay right)."""

    def __init__(self, values: list[str]):
        forms = {f for v in values if v for f in encoded_forms(v)}
        self.needles: dict[str, list[bytes]] = {}
        for family in FAMILIES:  # a form as written, and as the family reads it (a value holding `%41` or `&amp;`)
            found = {n for f in forms for n in (f, canonical(f, family)[0])}
            if family in _FORMS:
                found = {n.translate(_PLUS) for n in found}
            self.needles[family] = sorted((n for n in found if n), key=len, reverse=True)
        self.longest = max((len(n) for ns in self.needles.values() for n in ns), default=0)
        self._buf = bytearray()                  # what came in and has not gone out, as it came (never starred:
        self._stars: list[tuple[int, int]] = []  # each family reads the bytes as sent; stars go on as they go out)
        self._pos = dict.fromkeys(FAMILIES, 0)   # where each family's reading of _buf goes on (an escape boundary)

    def _pass(self, family: str, final: bool) -> int:
        """Star every match the family's reading of _buf[pos:] finds; the offset in _buf to read from next time."""
        pos = self._pos[family]
        data = bytes(self._buf[pos:])
        if family != "raw" and not _escapes_in(data, family):  # it reads the bytes as the raw family does
            return pos + (len(data) if final else max(0, len(data) - (self.longest - 1)))
        text, segs, stop = canonical(data, family, final)
        starts = [s[0] for s in segs]
        for needle in self.needles[family]:
            i = text.find(needle)
            while i >= 0:
                start, end = _origin(segs, starts, i)[0], _origin(segs, starts, i + len(needle) - 1)[1]
                self._stars.append((pos + start, pos + end))
                i = text.find(needle, i + 1)
        if final:
            return pos + len(data)
        keep = len(text) - (self.longest - 1)  # a match may still begin at canonical byte `keep` or later
        resume = stop if keep >= len(text) else (_origin(segs, starts, keep)[0] if keep > 0 else 0)
        return pos + min(resume, stop)

    def _out(self, done: int) -> bytes:
        """The first `done` bytes of _buf, starred, taken off it."""
        out, later = bytearray(self._buf[:done]), []
        for start, end in self._stars:
            if start < done:
                out[start:min(end, done)] = b"*" * (min(end, done) - start)
            if end > done:
                later.append((max(start, done) - done, end - done))
        self._stars = later
        del self._buf[:done]
        self._pos = {f: max(0, p - done) for f, p in self._pos.items()}
        return bytes(out)

    def scrub(self, data: bytes) -> bytes:
        """All of `data` scrubbed (a header value, a whole message); the stream state is not touched."""
        other = Scrubber.__new__(Scrubber)
        other.needles, other.longest = self.needles, self.longest
        other._buf, other._stars, other._pos = bytearray(data), [], dict.fromkeys(FAMILIES, 0)
        return other.flush()

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        if not self.longest:
            return self._out(len(self._buf))
        for family in FAMILIES:
            self._pos[family] = self._pass(family, final=False)
        return self._out(min(self._pos.values()))

    def flush(self) -> bytes:
        if self.longest:
            for family in FAMILIES:
                self._pass(family, final=True)
        return self._out(len(self._buf))
