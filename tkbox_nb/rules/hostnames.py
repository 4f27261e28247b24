"""Host names from the box, validated before anything resolves them. Pure functions.

A name passes only in the one spelling a resolver will not rewrite: ASCII after IDNA 2008 (the `idna` package, no
UTS 46 mapping, so fullwidth and other compatibility forms are refused rather than folded), lower case, labels of
letters, digits, hyphens and underscores, no NUL or control characters, no percent escapes, and a last label that is
not all digits (so `1.2.3.4.5` is neither an address nor a name). IP literals are recognised in every spelling the C
library accepts (addresses.parse_ip_literal) and judged as addresses.
"""

from __future__ import annotations

import fnmatch
import re
import unicodedata

import idna

from tkbox_nb.rules.addresses import Address, parse_ip_literal

MAX_NAME = 253
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


class HostError(ValueError):
    """A host the door will not resolve or dial; the message says why."""


def literal_address(raw: str) -> Address | None:
    """The address `raw` spells if it is an IP literal in any spelling the door accepts (the C library's forms, IPv6
    in brackets with or without a zone id, a trailing dot), else None; HostError for an almost-address (1.2.3.256)
    or brackets around something that is not an address. check_host and host pattern matching both use it, so a
    pattern and a host written differently are compared as the one address the door dials."""
    try:
        address = parse_ip_literal(raw)
        if address is None and raw.endswith(".") and not raw.startswith("["):
            # a name is resolved without its trailing dot, where "0x7f." is the C library's 0.0.0.127
            address = parse_ip_literal(raw[:-1])
    except ValueError as e:
        raise HostError(str(e)) from None
    if address is None and raw.startswith("["):
        raise HostError(f"{raw[:80]!r} is not an IPv6 address")
    return address


def host_pattern_matches(host: str, pattern: str) -> bool:
    """Whether a host the door stated (a lower-case name, or an address's text) matches one host pattern of a policy
    (a secret's `hosts`, the host part of an `egress.allow` entry). An IP-literal pattern, in any spelling, names one
    address and matches that address only: compared as text, `[2001:db8::1]` would be a glob character class and
    `2001:DB8:0::1` would never equal the door's `2001:db8::1`. Any other pattern is a glob (`*`, `?`) over the name,
    or over an address's usual text (`198.18.7.*`), case-insensitively."""
    try:
        want = literal_address(pattern)
        have = literal_address(host)
    except HostError:
        return False
    if want is not None:
        return have == want
    return fnmatch.fnmatchcase(str(have) if have is not None else host.lower(), pattern.lower())


def check_host(raw: str) -> tuple[str, Address | str]:
    """("ip", address) or ("name", ascii lower-case name), or HostError."""
    if not isinstance(raw, str) or not raw:
        raise HostError("an empty host")
    if len(raw) > MAX_NAME + 2:
        raise HostError(f"a host of {len(raw)} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in raw) or "%" in raw and not raw.startswith("["):
        raise HostError(f"{raw[:80]!r} holds control characters, spaces or percent escapes")
    address = literal_address(raw)
    if address is not None:
        return "ip", address
    name = raw[:-1] if raw.endswith(".") else raw
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
