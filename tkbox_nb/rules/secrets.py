"""The secrets door: placeholders in the box, real values in one header of requests to bound hosts.

A binding names a secret, the hosts it may go to, the one header it goes in and the header's format. Its value is
read on the host (`env:VAR`, `file:PATH`, or given by a notebook's `%box_secret`) and held in this process only; the
box gets an environment variable holding a random placeholder. The egress door terminates TLS to a bound host with the
box's CA (box_ca.py) and, per request, calls `rewrite_request`: the placeholder becomes the value in the bound header
and nowhere else; a placeholder anywhere else (path, another header, the body, a request to another host) is a
misuse, flagged or refused as the binding says. Responses from a bound host go through `Scrubber` before the box
sees them. The functions here are pure; no value is ever put in a record, a log or an error message.
"""

from __future__ import annotations

import hashlib
import os
import secrets as _random
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkbox_nb.core.errors import PolicyError, TkboxError
from tkbox_nb.rules.hostnames import host_pattern_matches
from tkbox_nb.rules.scrubber import MIN_ENCODED_FORM, Scrubber, encoded_forms  # noqa: F401 (the door's scrubber, re-exported)

PLACEHOLDER_PREFIX = "tkbox-ph-"
MAX_VALUE = 16 * 1024
# the fewest UTF-8 bytes a value may have: a shorter one's base64 at some alignment (where the box puts it in a Basic
# header) is under scrubber.MIN_ENCODED_FORM characters, too common in unrelated bytes to be starred
MIN_VALUE_BYTES = 7


@dataclass
class Binding:
    name: str
    hosts: list[str]
    header: str
    format: str
    source: str
    misuse: str = "flag"   # or "refuse"
    value: str = field(default="", repr=False)
    placeholder: str = field(default_factory=lambda: PLACEHOLDER_PREFIX + _random.token_hex(16))

    @property
    def placeholder_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.placeholder.encode()).hexdigest()

    def header_value(self, sent: bytes) -> bytes:
        """The bound header as the upstream gets it: the formatted value when the box sent only the placeholder,
        else the box's header with the placeholder replaced by the value (UTF-8); the box's other bytes unchanged."""
        value, placeholder = self.value.encode("utf-8"), self.placeholder.encode("ascii")
        if sent.strip() == placeholder:
            return self.format.encode("utf-8").replace(b"{value}", value)
        return sent.replace(placeholder, value)

    def formatted(self) -> str:
        """The bound header's value when the box sends the bare placeholder."""
        return self.format.replace("{value}", self.value)


def value_problem(value: str) -> str:
    """Why `value` cannot be (part of) an HTTP header field value as it is, "" when it can: empty, over MAX_VALUE
    characters or under MIN_VALUE_BYTES bytes, whitespace at either end, a control character (tab, line break,
    NUL, DEL, C0 or C1) or a lone surrogate. The answer never quotes the value: h11 and httpx name an illegal header
    value in their errors, so a value that reached them would be in the error the box and the record get."""
    if not value:
        return "is empty"
    if len(value.encode("utf-8", "surrogatepass")) < MIN_VALUE_BYTES:
        return (f"is under {MIN_VALUE_BYTES} bytes (its base64, as an echo at an offset the box chooses spells it, "
                "would be too short to scrub)")
    if len(value) > MAX_VALUE:
        return f"is over {MAX_VALUE} characters"
    if value != value.strip():
        return "has whitespace at its start or end"
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in value):
        return "holds a control character (a tab, line break, NUL, DEL, ...) or a lone surrogate"
    return ""


def check_binding(b: Binding) -> None:
    """PolicyError unless the binding's value, and its bound header as `format` makes it, are legal HTTP field
    values (checked when the box binds it, before anything is sent). The error names the binding and its source."""
    for what, text in (("value", b.value), (f"{b.header} header it makes (format)", b.formatted())):
        problem = value_problem(text)
        if problem:
            raise PolicyError(f"secrets.{b.name}: the {what} from {b.source} {problem}; it must be a legal HTTP "
                              "header value")


def error_text(e: BaseException, values: list[str]) -> str:
    """What an exception raised on a path that held secret `values` may say to the box or in a record: its type
    name and its message with every value starred, in each spelling the scrubber knows and as Python's reprs write
    it (`b'...'` escapes and all), cut at 200 characters."""
    try:
        reprs = [r for v in values if v for r in (repr(v)[1:-1], repr(v.encode("utf-8"))[2:-1])]
        text = Scrubber(list(values) + reprs).scrub(str(e).encode("utf-8", "backslashreplace"))
    except (UnicodeError, ValueError):  # a value no binding could hold (checked when bound): say only what failed
        return type(e).__name__
    return f"{type(e).__name__}: {text.decode('utf-8', 'replace')}"[:200]


def read_value(name: str, source: str) -> str:
    """The value of a binding from its source, read on the host, checked as an HTTP field value (value_problem).
    Errors name the source, never a value."""
    kind, _, where = source.partition(":")
    if kind == "env":
        value = os.environ.get(where)
        if not value:
            raise PolicyError(f"secrets.{name}: the host environment has no {where}")
    elif kind == "file":
        try:
            value = Path(os.path.expanduser(where)).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__  # a decode error quotes the file's bytes
            raise PolicyError(f"secrets.{name}: cannot read {where}: {why}") from None
    else:
        raise PolicyError(f"secrets.{name}: source must be env:VAR or file:PATH (or a notebook's %box_secret)")
    problem = value_problem(value)
    if problem:
        raise PolicyError(f"secrets.{name}: the value from {source} {problem}; it must be a legal HTTP header value")
    return value


def host_matches(host: str, patterns: list[str]) -> bool:
    """Whether a host the door stated matches any of a binding's host patterns (an IP literal in any spelling is
    the one address it names: hostnames.host_pattern_matches). Used by the door and the policy."""
    return any(host_pattern_matches(host, p) for p in patterns)


def bound_for(host: str, bindings: list[Binding]) -> list[Binding]:
    return [b for b in bindings if host_matches(host, b.hosts)]


@dataclass
class Rewrite:
    headers: list[tuple[bytes, bytes]]
    swaps: list[tuple[str, str]] = field(default_factory=list)      # (binding name, header)
    misuses: list[tuple[str, str]] = field(default_factory=list)    # (binding name, where)


def rewrite_request(host: str, target: bytes, headers: list[tuple[bytes, bytes]], bindings: list[Binding],
                    tls: bool) -> Rewrite:
    """Swap placeholders in the bound header of a request to `host`; name every other placeholder a misuse."""
    out = Rewrite(headers=[])
    text_target = target.decode("latin-1")
    for b in bindings:
        if b.placeholder in text_target:
            out.misuses.append((b.name, "path or query"))
    for key, value in headers:  # bytes throughout: a header holding no placeholder passes byte for byte
        sent = value
        for b in bindings:
            if b.placeholder.encode("ascii") not in sent:
                continue
            if tls and key.decode("latin-1").lower() == b.header.lower() and host_matches(host, b.hosts):
                value = b.header_value(value)
                out.swaps.append((b.name, b.header))
            else:
                where = f"header {key.decode('latin-1')[:60]}" + ("" if tls else " (plain http)")
                out.misuses.append((b.name, where if host_matches(host, b.hosts) else f"{where} to {host}"))
        out.headers.append((key, value))
    return out


def misuses_in(data: bytes, bindings: list[Binding], where: str) -> list[tuple[str, str]]:
    return [(b.name, where) for b in bindings if b.placeholder.encode() in data]


class PlaceholderWatch:
    """Finds placeholders in bytes the box sends in pieces on plain HTTP (a request's body, and anything after it),
    across the pieces' boundaries: a small tail of each piece is kept for the next. Each binding is named once, the
    first time its placeholder is seen, as a misuse (never swapped: the value never goes out without TLS)."""

    def __init__(self, host: str, bindings: list[Binding]):
        self.host, self.bindings = host, bindings
        self.keep = max((len(b.placeholder) for b in bindings), default=1) - 1
        self._tail, self._named = b"", set()

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        """(binding name, where) for each placeholder first completed by `data`."""
        window = self._tail + bytes(data)
        self._tail = window[-self.keep:] if self.keep > 0 else b""
        found = []
        for b in self.bindings:
            if b.name not in self._named and b.placeholder.encode("ascii") in window:
                self._named.add(b.name)
                where = "body (plain http)"
                found.append((b.name, where if host_matches(self.host, b.hosts) else f"{where} to {self.host}"))
        return found


def bindings_for(policy: Any, given: dict[str, Any]) -> list:
    """The box's secret bindings: the policy's [secrets.NAME] (values read now, on the host) and those a notebook
    gave (`%box_secret`, value already read). A given binding of the same name wins."""
    out = {}
    for name, spec in policy.data.get("secrets", {}).items():
        if name in given:
            continue
        if spec["source"] == "prompt":
            raise TkboxError(f"secrets.{name}: source = \"prompt\" needs a notebook's %box_secret {name} ...")
        out[name] = Binding(name, list(spec["hosts"]), spec["header"], spec["format"], spec["source"],
                            spec["misuse"], read_value(name, spec["source"]))
    for name, g in given.items():
        out[name] = Binding(name, list(g.hosts), g.header, g.format, g.source, "flag", g.value)
    for b in out.values():  # the value and the header it makes are legal HTTP before anything is bound or sent
        check_binding(b)
    return list(out.values())
