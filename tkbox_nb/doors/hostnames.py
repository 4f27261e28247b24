"""Host names from the box, validated before anything resolves them. Pure functions.

A name passes only in the one spelling a resolver will not rewrite: ASCII after IDNA 2008 (the `idna` package, no
UTS 46 mapping, so fullwidth and other compatibility forms are refused rather than folded), lower case, labels of
letters, digits, hyphens and underscores, no NUL or control characters, no percent escapes, and a last label that is
not all digits (so `1.2.3.4.5` is neither an address nor a name). IP literals are recognised in every spelling the C
library accepts (addresses.parse_ip_literal) and judged as addresses.
"""

from __future__ import annotations

import re
import unicodedata

import idna

from .addresses import Address, parse_ip_literal

MAX_NAME = 253
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


class HostError(ValueError):
    """A host the door will not resolve or dial; the message says why."""


def check_host(raw: str) -> tuple[str, Address | str]:
    """("ip", address) or ("name", ascii lower-case name), or HostError."""
    if not isinstance(raw, str) or not raw:
        raise HostError("an empty host")
    if len(raw) > MAX_NAME + 2:
        raise HostError(f"a host of {len(raw)} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in raw) or "%" in raw and not raw.startswith("["):
        raise HostError(f"{raw[:80]!r} holds control characters, spaces or percent escapes")
    try:
        address = parse_ip_literal(raw)
    except ValueError as e:  # an almost-address, such as 1.2.3.256
        raise HostError(str(e)) from None
    if address is not None:
        return "ip", address
    if raw.startswith("["):
        raise HostError(f"{raw[:80]!r} is not an IPv6 address")
    name = raw[:-1] if raw.endswith(".") else raw
    if name != raw:  # the name is resolved without its trailing dot, where "0x7f." is the C library's 0.0.0.127
        try:
            address = parse_ip_literal(name)
        except ValueError as e:
            raise HostError(str(e)) from None
        if address is not None:
            return "ip", address
    if not name.isascii():
        if unicodedata.normalize("NFKC", name) != name:
            raise HostError(f"{raw[:80]!r} is in a form resolvers rewrite (fullwidth or other compatibility "
                            "characters)")
        try:
            name = idna.encode(name, uts46=False).decode("ascii")
        except idna.IDNAError as e:
            raise HostError(f"{raw[:80]!r} is not a valid internationalized name: {e}") from None
    name = name.lower()
    labels = name.split(".")
    if len(name) > MAX_NAME or not all(_LABEL.fullmatch(label) for label in labels):
        raise HostError(f"{raw[:80]!r} is not a valid host name")
    for label in labels:
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except idna.IDNAError:
                raise HostError(f"{raw[:80]!r} has an invalid punycode label") from None
    if labels[-1].isdigit():
        raise HostError(f"{raw[:80]!r} ends in a numeric label: neither an address nor a name")
    return "name", name
