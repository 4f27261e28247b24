"""Names resolved on the host, for the doors that dial out (egress, packages): a box never resolves a name itself, and
a door checks every address of the answer before it connects to one (rules/addresses.py)."""

from __future__ import annotations

import socket


def resolve(name: str, port: int, nameservers: list[str], timeout: float) -> list[str]:
    """Every address the name has (A and AAAA), from the policy's nameservers or the system resolver."""
    if nameservers:
        import dns.exception
        import dns.resolver
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = list(nameservers)
        resolver.lifetime = timeout
        found, failure = [], None
        for rdtype in ("A", "AAAA"):
            try:
                found += [r.address for r in resolver.resolve(name, rdtype, search=False)]
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as e:  # a server that fails one type: the other may still answer
                failure = f"lookup of {name} ({rdtype}) failed: {type(e).__name__}"
        if not found and failure:
            raise OSError(failure)
        return found
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]
