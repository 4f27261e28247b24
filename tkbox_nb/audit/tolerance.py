"""Tolerances for `tkbox audit --rtol R --atol A --image-tolerance T`: when two honest runs differ only in numbers'
last digits or in how a plot was encoded, they are not called different.

Why: a printed duration or a float summed in another order made every ML notebook's audit DIFFERENT, and a plot
re-rendered with other PNG metadata differed by digest. What a tolerance loosens, and nothing else:
- a number with a fraction or an exponent (`0.30000000000000004`, `1e-3`) in a text output, a `text/plain` or
  `text/html` table (a DataFrame: each cell's number by value) or a JSON output compares as
  `math.isclose(a, b, rel_tol=rtol, abs_tol=atol)`; integers, strings and structure (the text between numbers, the
  number of lines, outputs, MIME keys) still compare exactly, except that a run of spaces compares as one (a table's
  column widths follow its numbers' widths);
- an `image/png` or `image/jpeg` compares by its decoded pixels (both as RGBA, the same size): equal when no channel
  of any pixel differs by more than T (0..255; 0: the same pixels, whatever the encoding).
Defaults stay exact (0, 0, and images by the digest of their bytes).

Everything compared came from a box, so it is hostile: `numbers_equal` is a pure function, linear in its inputs (one
scan with a regular expression that cannot backtrack past a digit run, of the lines that differ only, compared
lazily, stopping at the first difference; a number over MAX_NUMBER chars compares as text, and after MAX_NUMBERS
numbers in one value the rest compares exactly), and an image is decoded only under MAX_PIXELS.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, Iterator

from tkbox_nb.core.errors import TkboxError

# a decimal number standing alone (not in a word, a digest or a dotted version): sign, digits, fraction, exponent
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)(?![\w.])")
SPACES = re.compile(r"[ \t][ \t]+|\t")  # a run of spaces (only those that are not already one space)
CUT = re.compile(r"\s(?=\S)")  # where a value may be cut: after a white space, before a character that is not
CUT_END = re.compile(r"\S(?=\s)")  # ... and its end: after a character that is not white space, before one
MAX_NUMBER = 400  # a longer "number" is compared as text
MAX_NUMBERS = 1_000_000  # numbers compared within the tolerance in one value: the rest of it compares exactly
CHUNK = 1 << 16  # characters compared at a time, finding where two values start and stop differing
MAX_PIXELS = 1 << 26  # an image larger than this (64 Mpx) is not decoded: refused
IMAGES = ("image/png", "image/jpeg")
TOLERANT = ("cell outputs", "cell user_expressions", "command stdout", "command stderr")


def check(name: str, value: float | None, upper: float | None = None) -> float | None:
    """One tolerance from the user: a finite number >= 0 (and <= upper), else one line naming it."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or math.isinf(value) \
            or value < 0 or (upper is not None and value > upper):
        bound = f" and at most {upper:g}" if upper is not None else ""
        raise TkboxError(f"{name} {value}: a tolerance is a finite number, 0 or more{bound}")
    return float(value)


def _tokens(text: str) -> Iterator[tuple[bool, str]]:
    """(is_number, text) pieces of `text`, alternately the text between numbers and a number, lazily; after
    MAX_NUMBERS numbers the rest is one piece of text (compared exactly, but for runs of spaces)."""
    pos = 0
    for count, m in enumerate(NUMBER.finditer(text)):
        if count == MAX_NUMBERS:
            break
        yield False, text[pos:m.start()]
        yield True, m.group()
        pos = m.end()
    yield False, text[pos:]


def _common(a: str, b: str, backward: bool) -> int:
    """The length of a's and b's common prefix (or suffix), compared a chunk at a time (no copy over CHUNK)."""
    n = min(len(a), len(b))

    def same(i: int, j: int) -> bool:  # a[i:j] == b[i:j], counted from the end when backward
        return a[len(a) - j:len(a) - i] == b[len(b) - j:len(b) - i] if backward else a[i:j] == b[i:j]
    done = 0
    while done < n and same(done, min(n, done + CHUNK)):
        done = min(n, done + CHUNK)
    lo, hi = done, min(n, done + CHUNK)
    while lo < hi:  # the common length is in [lo, hi]: same(done, lo) holds
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if same(done, mid) else (lo, mid - 1)
    return lo


def _middle(a: str, b: str) -> tuple[str, str]:
    """a and b less what they begin and end with alike: what is left to tokenize. Each cut is between a white space
    and a character that is not, inside the common part (so neither a number nor a run of spaces spans it, and what
    a number's lookaround sees at the cut is white space or the end either way): the answer is the whole texts'."""
    common = _common(a, b, False)
    window = max(0, common - CHUNK)
    start = max((m.end() for m in CUT.finditer(a, window, common)), default=0)
    if start == 0 and window:
        start = a.rfind("\n", 0, window) + 1  # a line end, when the last CHUNK has no white space
    a, b = a[start:], b[start:]
    tail = _common(a, b, True)
    m = CUT_END.search(a, len(a) - tail, len(a) - tail + CHUNK)  # the first such place of the common end
    cut = 0 if m is None else len(a) - m.end()
    return a[:len(a) - cut], b[:len(b) - cut]


def _is_float(token: str) -> bool:
    return len(token) <= MAX_NUMBER and any(ch in token for ch in ".eE")


def numbers_equal(a: str, b: str, rtol: float, atol: float) -> bool:
    """`a` and `b` the same but for floats within the tolerance (and runs of spaces). Pure; linear in time, and in
    memory no more than the lines that differ."""
    if a == b:
        return True
    a, b = _middle(a, b)
    for (na, ta), (nb, tb) in zip_longest(_tokens(a), _tokens(b), fillvalue=(None, None)):
        if na is None or nb is None or na != nb:
            return False
        if ta == tb:
            continue
        if not na:
            if SPACES.sub(" ", ta) != SPACES.sub(" ", tb):
                return False
        elif not (_is_float(ta) and _is_float(tb)
                  and math.isclose(float(ta), float(tb), rel_tol=rtol, abs_tol=atol)):
            return False
    return True


@dataclass
class Tolerance:
    """How two compared values may differ (the defaults: not at all) and how each image difference measured."""

    rtol: float = 0.0
    atol: float = 0.0
    image: float | None = None  # None: images by the digest of their bytes
    images: Any = None  # (image lookup of run A, of run B): digest -> bytes, given by audit when image is set
    notes: dict = field(default_factory=dict)  # (seq_a, seq_b, label) -> lines saying how values differed

    def __post_init__(self) -> None:
        self.rtol = check("--rtol", self.rtol) or 0.0
        self.atol = check("--atol", self.atol) or 0.0
        self.image = check("--image-tolerance", self.image, 255)

    @property
    def exact(self) -> bool:
        return not self.rtol and not self.atol and self.image is None

    def describe(self) -> str:
        if self.exact:
            return "exact (no tolerance)"
        nums = f"numbers within rtol {self.rtol:g}, atol {self.atol:g}" if self.rtol or self.atol else \
            "numbers exactly"
        img = "images by digest" if self.image is None else \
            f"images by decoded pixels, each channel within {self.image:g} of 255"
        return f"{nums}; {img}"

    def as_dict(self) -> dict:
        return {"rtol": self.rtol, "atol": self.atol, "image_tolerance": self.image}

    def equal(self, label: str, va: str, vb: str, seq_a: int | None, seq_b: int | None) -> bool:
        """Whether two differing compared values of field `label` are equal within the tolerance."""
        if self.exact or label not in TOLERANT:
            return False
        if label.startswith("command"):
            return bool(self.rtol or self.atol) and numbers_equal(va, vb, self.rtol, self.atol)
        try:
            ja, jb = json.loads(va), json.loads(vb)
        except ValueError:
            return False
        return self._walk(ja, jb, "", (seq_a, seq_b, label))

    def _walk(self, a: Any, b: Any, mime: str, where: tuple) -> bool:
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(self._walk(a[k], b[k], str(k), where) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(self._walk(x, y, mime, where) for x, y in zip(a, b))
        if isinstance(a, str) and isinstance(b, str):
            if a == b:
                return True
            if mime in IMAGES and self.image is not None:
                return self._image_equal(a, b, mime, where)
            return bool(self.rtol or self.atol) and numbers_equal(a, b, self.rtol, self.atol)
        return a == b

    def _image_equal(self, a: str, b: str, mime: str, where: tuple) -> bool:
        pa, pb = (self._decode(look, v, mime, run) for look, v, run in zip(self.images or ({}, {}), (a, b), "AB"))
        if pa is None or pb is None:  # not among the cells' outputs (a user_expression's): by digest
            return False
        if pa.size != pb.size:
            self.notes.setdefault(where, []).append(f"{mime}: {pa.size[0]}x{pa.size[1]} px in A, "
                                                    f"{pb.size[0]}x{pb.size[1]} px in B")
            return False
        worst, changed = pixel_difference(pa, pb)
        if worst > (self.image or 0):
            self.notes.setdefault(where, []).append(
                f"{mime}: {changed} of {pa.size[0] * pa.size[1]} pixels differ (largest channel difference "
                f"{worst} of 255; tolerance {self.image:g})")
            return False
        return True

    @staticmethod
    def _decode(lookup: dict, value: str, mime: str, run: str):
        m = re.match(r"sha256:([0-9a-f]{64}) ", value)
        if m is None:
            raise TkboxError(f"an {mime} output of run {run} does not decode as an image: it is not base64 "
                             f"({value[:60]})")
        raw = lookup.get(m.group(1))
        if raw is None:
            return None
        return decode_image(raw, f"an {mime} output of run {run} (sha256:{m.group(1)[:12]})")


def decode_image(raw: bytes, what: str):
    """An image's pixels as RGBA, or one line saying why not (not an image, over MAX_PIXELS, truncated)."""
    try:
        from PIL import Image
    except ImportError:
        raise TkboxError("--image-tolerance needs Pillow in this environment (pip install pillow)") from None
    import io
    try:
        im = Image.open(io.BytesIO(raw))
        if im.size[0] * im.size[1] > MAX_PIXELS:
            raise TkboxError(f"{what} is {im.size[0]}x{im.size[1]} px, over {MAX_PIXELS} pixels: not decoded")
        return im.convert("RGBA")
    except TkboxError:
        raise
    except Exception as e:  # Pillow raises many kinds for a bad image: each is the same answer
        why = re.sub(r"\s*<[^>]*>", "", str(e))[:120]  # not the object's address Pillow names
        raise TkboxError(f"{what} does not decode as an image ({type(e).__name__}: {why})") from None


def pixel_difference(pa, pb) -> tuple[int, int]:
    """(the largest channel difference, the number of pixels with any) of two RGBA images of one size."""
    from PIL import ImageChops
    diff = ImageChops.difference(pa, pb)
    worst = max(hi for _, hi in diff.getextrema())
    if not worst:
        return 0, 0
    bands = diff.split()
    mask = bands[0]
    for band in bands[1:]:
        mask = ImageChops.lighter(mask, band)
    return worst, sum(mask.histogram()[1:])


def image_lookup(outputs_of_cells: Iterator[list]) -> dict[str, bytes]:
    """digest hex -> bytes of every PNG or JPEG in the given cells' recorded outputs (strictly base64)."""
    found: dict[str, bytes] = {}
    for outs in outputs_of_cells:
        for o in outs if isinstance(outs, list) else []:
            data = o.get("data") if isinstance(o, dict) and isinstance(o.get("data"), dict) else {}
            for mime in IMAGES:
                v = data.get(mime)
                v = "".join(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
                if isinstance(v, str):
                    try:
                        raw = base64.b64decode("".join(v.split()), validate=True)
                    except ValueError:
                        continue
                    found[hashlib.sha256(raw).hexdigest()] = raw
    return found


def image_notes(differences: list, lookups) -> None:
    """Each differing cell outputs' PNG or JPEG pairs described by their pixels (size, pixels that differ, largest
    channel difference) in the difference's detail, where no tolerance measured them already; `lookups()` gives
    (run A's, run B's) images by digest, asked for only when some image differs. Nothing when Pillow is absent;
    an image that does not decode is said so, in its line."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return
    looked = None
    for d in differences:
        if d.kind != "cell outputs" or d.detail:
            continue
        try:
            pairs = list(_image_pairs(json.loads(d.value_a), json.loads(d.value_b), ""))
        except ValueError:
            continue
        for mime, va, vb in pairs[:20]:
            looked = looked or lookups()
            try:
                pa, pb = (Tolerance._decode(look, v, mime, run) for look, v, run in zip(looked, (va, vb), "AB"))
            except TkboxError as e:
                d.detail.append(str(e))
                continue
            if pa is None or pb is None:
                continue
            if pa.size != pb.size:
                d.detail.append(f"{mime}: {pa.size[0]}x{pa.size[1]} px in A, {pb.size[0]}x{pb.size[1]} px in B")
                continue
            worst, changed = pixel_difference(pa, pb)
            d.detail.append(f"{mime}: {changed} of {pa.size[0] * pa.size[1]} pixels differ (largest channel "
                            f"difference {worst} of 255)" if worst else f"{mime}: the same pixels, other bytes "
                            f"(metadata or encoding: --image-tolerance 0 calls them equal)")


def _image_pairs(a: Any, b: Any, mime: str) -> Iterator[tuple[str, str, str]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() & b.keys():
            yield from _image_pairs(a[k], b[k], str(k))
    elif isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            yield from _image_pairs(x, y, mime)
    elif mime in IMAGES and isinstance(a, str) and isinstance(b, str) and a != b:
        yield mime, a, b
