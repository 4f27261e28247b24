"""[egress]: which hosts and ports a box may connect to, which private ranges it may reach, which resolvers the door
asks; and the decision on one connection (doors/egress.py states its facts, `tkbox verify` decides them again)."""

from __future__ import annotations

import re
from typing import Any

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import Settings, Verdict, seconds_problem

SCHEMA: dict[str, type | tuple[type, ...]] = {
    "allow": list, "allow_cidrs": list, "nameservers": list, "connect_timeout_s": (int, float),
    "upstream_ca_file": str, "max_connections": int}
DEFAULTS: dict[str, Any] = {"allow": [], "allow_cidrs": [], "nameservers": [], "connect_timeout_s": 10,
                            "upstream_ca_file": "", "max_connections": 10_000}
MAX_CONNECTIONS = 1_000_000  # allowed connections a run may have (0: no limit but the run's size, [box] max_run_mib)


def validate(out: dict[str, dict[str, Any]], name: str) -> None:
    """What [egress] must hold beyond its keys' types (core.py checked those): HOST:PORT entries, ranges, addresses."""
    egress = out.get("egress", {})
    for pattern in egress.get("allow", []):
        host, sep, port = pattern.rpartition(":")
        if not sep or not host or not (port == "*" or re.fullmatch(r"[0-9]{1,5}", port) and 0 < int(port) < 65536):
            raise PolicyError(f"{name}: egress.allow entry {pattern!r} must be HOST:PORT (HOST may use * and ?, "
                              "PORT a number or *)")
    if not 0 <= egress.get("max_connections", 0) <= MAX_CONNECTIONS:
        raise PolicyError(f"{name}: egress.max_connections must be from 0 (no limit) to {MAX_CONNECTIONS}, not "
                          f"{egress['max_connections']}")
    why = seconds_problem(egress["connect_timeout_s"], 600) if "connect_timeout_s" in egress else ""
    if why:
        raise PolicyError(f"{name}: egress.connect_timeout_s {why}")
    import ipaddress
    for key in ("allow_cidrs", "nameservers"):
        for value in egress.get(key, []):
            try:
                (ipaddress.ip_network(value, strict=False) if key == "allow_cidrs" else ipaddress.ip_address(value))
            except ValueError:
                raise PolicyError(f"{name}: egress.{key} entry {value!r} is not an "
                                  f"{'address range' if key == 'allow_cidrs' else 'IP address'}") from None


def allow_cidrs(policy: Settings) -> tuple:
    """[egress] allow_cidrs as networks: private ranges the policy opens (rules/addresses.py refuses the rest)."""
    import ipaddress
    return tuple(ipaddress.ip_network(c, strict=False) for c in policy.get("egress", "allow_cidrs"))


def decide(policy: Settings, kind: Any, facts: dict[str, Any]) -> Verdict:
    """A connection out of the box: the name, every address its lookup gave, then the allow list. Pure: the
    address table is code (rules/addresses.py), and the facts carry the whole lookup answer."""
    import ipaddress

    from tkbox_nb.rules.addresses import classify, refused_name
    if kind != "connect":
        return Verdict("deny", "egress.kind", f"unknown egress kind {kind!r}")
    host, port = facts.get("host"), facts.get("port")
    if facts.get("host_error") or not isinstance(host, str) or not isinstance(port, int):
        return Verdict("deny", "egress.host", str(facts.get("host_error") or "no valid host and port")[:300])
    why = refused_name(host)
    if why:
        return Verdict("deny", "egress.always", why)
    allowed_by = allow_index(policy, host, port)
    literal = is_ip_literal(host)
    if allowed_by is None and not literal:  # a name off the list is refused before any lookup (no DNS leak)
        return Verdict("deny", "egress.allow", f"{host}:{port} is not in [egress] allow")
    addresses = facts.get("addresses")
    if facts.get("resolve_error") or not isinstance(addresses, list) or not addresses:
        return Verdict("deny", "egress.resolve", str(facts.get("resolve_error") or "the name has no address"))
    try:
        parsed = [ipaddress.ip_address(a) for a in addresses]
    except (TypeError, ValueError):
        return Verdict("deny", "egress.resolve", "an answer that is not an address")
    cidrs = allow_cidrs(policy)
    for addr in parsed:  # one refused address refuses the whole answer
        cls, why = classify(addr, cidrs)
        if cls != "ok":
            return Verdict("deny", f"egress.{cls}", why)
    if allowed_by is None:
        return Verdict("deny", "egress.allow", f"{host}:{port} is not in [egress] allow")
    before, limit = facts.get("run_connections"), policy.get("egress", "max_connections")
    if limit and (not isinstance(before, int) or isinstance(before, bool) or before >= limit) \
            and "run_connections" in facts:  # the run's allowed connections before this one (the door states it)
        return Verdict("deny", "egress.max_connections", f"the run has had its {limit} connections "
                                                         "([egress] max_connections)")
    return Verdict("allow", f"egress.allow[{allowed_by}]")


def allow_index(policy: Settings, host: str, port: int) -> int | None:
    """The first `[egress] allow` entry that matches host:port (the door resolves only such names). An IP literal
    entry, in any spelling (`[2001:db8::1]:443`), matches the address it spells (hostnames.host_pattern_matches)."""
    from tkbox_nb.rules.hostnames import host_pattern_matches
    for i, pattern in enumerate(policy.get("egress", "allow")):
        want_host, _, want_port = pattern.rpartition(":")
        if want_port in ("*", str(port)) and host_pattern_matches(host, want_host):
            return i
    return None


def is_ip_literal(host: str) -> bool:
    """Whether `host` is an address itself: such a host is looked up by no resolver, so it is decided on its address."""
    import ipaddress
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
