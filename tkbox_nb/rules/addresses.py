"""Which addresses and names the egress door may dial: a table shipped in the code, one row per range.

Pure functions, no I/O, so the same code classifies in the door and in `tkbox verify` (re-deriving every egress
decision from the facts the door stated). `ipaddress.is_global` and friends are not used: on Python 3.11 they are wrong
for several ranges that matter here (they call 192.0.0.0/24, 100.64/10 and the IPv4-mapped forms in ways that do not
match this table), and this table must not change with the interpreter.

Two classes:
- ALWAYS_REFUSED: loopback, unspecified, private, link-local, CGNAT, unique-local, multicast, broadcast, reserved and
  cloud metadata addresses. No policy lifts these, and the signer's box pack refuses them too.
- SPECIAL: other IANA special-purpose ranges (documentation, benchmarking, ...): refused unless the policy's
  `egress.allow_cidrs` names them.
IPv6 forms that embed an IPv4 address (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo) are judged by the IPv4
address inside as well.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Union

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

# (range, name): checked in order; the first match names the refusal
ALWAYS_REFUSED: tuple[tuple[str, str], ...] = (
    ("169.254.169.254/32", "cloud metadata (AWS, GCP, Azure IMDS, OpenStack, ...)"),
    ("169.254.170.2/32", "cloud metadata (AWS ECS task metadata)"),
    ("168.63.129.16/32", "cloud metadata (Azure wire server)"),
    ("100.100.100.200/32", "cloud metadata (Alibaba Cloud)"),
    ("192.0.0.192/32", "cloud metadata (Oracle Cloud)"),
    ("fd00:ec2::254/128", "cloud metadata (AWS IMDS over IPv6)"),
    ("0.0.0.0/8", "this network (0/8, unspecified)"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space (CGNAT, RFC 6598)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved (240/4) and broadcast"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("fc00::/7", "unique-local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
    ("64:ff9b:1::/48", "local-use NAT64 (RFC 8215)"),
)
SPECIAL: tuple[tuple[str, str], ...] = (
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("100::/64", "discard-only"),
    ("2001::/23", "IETF protocol assignments"),
    ("2001:2::/48", "benchmarking"),
    ("2001:db8::/32", "documentation"),
    ("2001:10::/28", "ORCHID (deprecated)"),
    ("2001:20::/28", "ORCHIDv2"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "segment routing SIDs"),
)
_ALWAYS = tuple((ipaddress.ip_network(n), why) for n, why in ALWAYS_REFUSED)
_SPECIAL = tuple((ipaddress.ip_network(n), why) for n, why in SPECIAL)

# names refused before any lookup (and their subdomains)
REFUSED_NAMES = ("localhost", "localhost.localdomain", "metadata", "metadata.google.internal", "metadata.goog",
                 "instance-data", "instance-data.ec2.internal", "metadata.azure.com", "metadata.tencentyun.com",
                 "metadata.platformequinix.com", "kubernetes.default.svc", "ip6-localhost", "ip6-loopback")

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_COMPAT = ipaddress.ip_network("::/96")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")
_V4_LITERAL = re.compile(r"(0[xX][0-9a-fA-F]*|[0-9]+)(\.(0[xX][0-9a-fA-F]*|[0-9]+)){0,3}")


def embedded_ipv4(addr: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, compatible, NAT64, 6to4, Teredo server and client)."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return []
    n = int(addr)
    found = []
    if addr in _MAPPED or addr in _NAT64 or (addr in _COMPAT and n > 1):
        found.append(ipaddress.IPv4Address(n & 0xFFFFFFFF))
    if addr in _SIX_TO_FOUR:
        found.append(ipaddress.IPv4Address((n >> 80) & 0xFFFFFFFF))
    if addr in _TEREDO:
        found.append(ipaddress.IPv4Address((n >> 64) & 0xFFFFFFFF))            # the Teredo server
        found.append(ipaddress.IPv4Address((n & 0xFFFFFFFF) ^ 0xFFFFFFFF))     # the client, obfuscated
    return found


def classify(addr: Address, allow_cidrs: tuple[Network, ...] = ()) -> tuple[str, str]:
    """("ok", "") or ("always", why) or ("special", why) for one address (and any IPv4 address it embeds)."""
    for candidate in [addr, *embedded_ipv4(addr)]:
        for net, why in _ALWAYS:
            if candidate.version == net.version and candidate in net:
                return "always", f"{candidate} is {why}"
    for candidate in [addr, *embedded_ipv4(addr)]:
        for net, why in _SPECIAL:
            if candidate.version == net.version and candidate in net:
                if any(candidate.version == a.version and candidate in a for a in allow_cidrs):
                    break
                return "special", f"{candidate} is {why} (allow it with egress.allow_cidrs)"
    return "ok", ""


def parse_ip_literal(host: str) -> Address | None:
    """The address a host string means if it is an IP literal in any spelling the C library accepts (decimal
    `2130706433`, octal `0177.0.0.1`, hex `0x7f.1`, short `127.1`, bracketed IPv6), else None."""
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in h:
        try:
            return ipaddress.IPv6Address(h.split("%", 1)[0])
        except ValueError:
            return None
    if _V4_LITERAL.fullmatch(h):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            raise ValueError(f"{host!r} looks like an IP address but is not one") from None
    return None


def refused_name(name: str) -> str | None:
    """Why a host name is refused before any lookup, or None. Read as resolvers read it: in any case, and with its
    trailing dots dropped (`localhost.` is the fully-qualified `localhost`), since a bundle's stated host, which
    `tkbox verify` judges again, never went through rules/hostnames.check_host."""
    name = name.lower().rstrip(".")
    for bad in REFUSED_NAMES:
        if name == bad or name.endswith("." + bad):
            return f"{name} is a local or cloud metadata name ({bad})"
    if name.endswith(".localhost") or name.endswith(".internal") and "metadata" in name:
        return f"{name} is a local or cloud metadata name"
    return None
