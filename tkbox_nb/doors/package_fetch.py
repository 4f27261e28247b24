"""How the package door reaches an index or file host: resolved on the host, judged, and dialled only at the address
that was judged.

httpx left to itself would look the name up again when it connects, after the door checked it: a name that answers
a public address to the check and 127.0.0.1 (or 169.254.169.254) to the connect would make the host fetch from
itself or from the cloud's metadata service. So the door resolves each host once (`doors/resolver.resolve`: the
system resolver, or `[packages] nameservers`), states the whole answer (`host`, `addresses`, `address_class`),
refuses before any connection when `policy/packages.address_verdict` does (the same rule `tkbox verify` applies to
the stated facts), and sends the request to the checked address itself: the URL names the address, the `Host`
header the host, and for HTTPS the TLS server name (SNI, and the name the certificate is checked against) is the
host's name. One httpx client per host name, so a kept-alive connection made for one name is never reused for
another that shares its address.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

from tkbox_nb.doors.egress import MAX_ADDRESSES
from tkbox_nb.doors.resolver import resolve
from tkbox_nb.policy.base import Settings, Verdict
from tkbox_nb.policy.packages import address_verdict
from tkbox_nb.rules.addresses import classify, refused_name
from tkbox_nb.rules.hostnames import HostError, check_host


class AddressRefused(Exception):
    """The host's name or one of its addresses is refused: nothing was sent to it."""

    def __init__(self, verdict: Verdict, facts: dict):
        super().__init__(verdict.reason)
        self.verdict, self.facts = verdict, facts  # what the door states: the decision refuses again on them


def dial_facts(policy: Settings, url: str) -> tuple[dict, str]:
    """What the door states of the host of `url` (its name, every address of its one lookup, the address it dials)
    and that address; OSError when the name does not resolve. A name refused as a name is never looked up."""
    parts = urlsplit(url)
    facts: dict = {"host": (parts.hostname or "")[:200], "addresses": [], "address": ""}
    try:
        kind, value = check_host(parts.hostname or "")
    except HostError as e:
        facts["host_error"] = str(e)[:300]
        return facts, ""
    facts["host"] = str(value)
    if kind == "ip":
        found = [str(value)]
    elif refused_name(str(value)):
        found = []
    else:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        found = resolve(str(value), port, policy.get("packages", "nameservers"), policy.get("packages", "timeout_s"))
    cidrs = tuple(ipaddress.ip_network(c, strict=False) for c in policy.get("packages", "allow_cidrs"))
    rank = {"always": 0, "special": 1, "ok": 2}
    judged = {a: classify(ipaddress.ip_address(a), cidrs)[0] for a in set(found)}
    unique = sorted(judged, key=lambda a: (rank[judged[a]], ":" in a, a))  # the refused ones first, as egress
    if len(unique) > MAX_ADDRESSES:
        facts["addresses_dropped"] = len(unique) - MAX_ADDRESSES
    facts["addresses"] = unique[:MAX_ADDRESSES]
    classes = set(judged.values())
    facts["address_class"] = "always" if "always" in classes or refused_name(facts["host"]) else \
        "special" if "special" in classes else "ok"
    return facts, facts["addresses"][0] if facts["addresses"] else ""


def checked(policy: Settings, url: str) -> tuple[dict, str]:
    """dial_facts, then the policy's verdict on them: AddressRefused (carrying the stated facts in `facts`) before
    anything is sent, or (facts, the address to dial)."""
    facts, address = dial_facts(policy, url)
    refused = address_verdict(policy, facts)
    if refused is None and not address:
        refused = Verdict("deny", "packages.resolve", f"{facts['host'][:100]} has no address")
    if refused is not None:
        raise AddressRefused(refused, facts)
    facts["address"] = address
    return facts, address


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def pinned_request(url: str, address: str) -> tuple[str, dict[str, str], dict]:
    """(the URL naming `address`, the headers naming the host, the httpx extensions naming it to TLS) for a GET of
    `url` sent to `address` and no other."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    target = urlunsplit((parts.scheme, _bracket(address) + port, parts.path or "/", parts.query, ""))
    extensions = {}
    if parts.scheme == "https" and check_host(host)[0] == "name":
        extensions["sni_hostname"] = host
    return target, {"Host": _bracket(host) + port}, extensions
