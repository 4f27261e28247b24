"""The decision on what a model call asks the provider to fetch (rules/model_fetches.py lists it in the call's signed
facts): refused whole under `[models] server_tools = "refuse"` (the default), or each URL's and web tool domain's host
decided against `[egress]` as a connection's would be under `"egress"`. Pure: `tkbox verify` decides it again."""

from __future__ import annotations

from typing import Any

from tkbox_nb.policy.base import Settings, Verdict

SERVER_TOOLS = ("refuse", "egress")
SUBDOMAIN = "tkbox-any-subdomain."  # stands for any subdomain of a web tool's allowed domain in the egress check


def _host(policy: Settings, url: str, default_port: int = 443) -> tuple[str, str]:
    """(rule, "") when the host of a URL (or a bare domain) passes [egress] for a connection, else ("", why)."""
    import ipaddress
    from urllib.parse import urlsplit

    from tkbox_nb.rules.addresses import classify, refused_name
    from tkbox_nb.rules.hostnames import HostError, check_host
    from tkbox_nb.policy.egress import allow_cidrs, allow_index
    text = url if "://" in url else "https://" + url
    try:
        parts = urlsplit(text)
        port = parts.port or (80 if parts.scheme.lower() == "http" else default_port)
        kind, host = check_host(parts.hostname or "")
    except (ValueError, HostError) as e:
        return "", f"{url[:120]!r} names no host the door can decide ({str(e)[:80] or 'no host'})"
    if parts.scheme.lower() not in ("http", "https"):
        return "", f"{url[:120]!r}: the provider would fetch a {parts.scheme[:20]!r} URL"
    host = str(host)
    why = refused_name(host)
    if why:
        return "", f"{host}: {why}"
    if kind == "ip":
        cls, why = classify(ipaddress.ip_address(host), allow_cidrs(policy))
        if cls != "ok":
            return "", f"{host}: {why}"
    index = allow_index(policy, host, port)
    if index is None:
        return "", f"{host}:{port} is not in [egress] allow"
    return f"egress.allow[{index}]", ""


def decide_fetches(policy: Settings, fetches: Any) -> Verdict | None:
    """None when the call names nothing the provider fetches or every such thing passes; else the deny verdict."""
    if not fetches:
        return None
    mode = policy.data.get("models", {}).get("server_tools", "refuse")
    if not isinstance(fetches, list) or not all(isinstance(f, dict) for f in fetches):
        return Verdict("deny", "models.server_tools", "server-side tools stated in no form the policy reads")
    if mode != "egress":
        named = ", ".join(f"{f.get('tool') or f.get('kind')} at {f.get('where')}" for f in fetches[:5])
        return Verdict("deny", "models.server_tools",
                       f"the request names what the provider would fetch or run past [egress] ({named}); "
                       "[models] server_tools = \"refuse\"")
    for f in fetches:
        where, kind = str(f.get("where"))[:200], f.get("kind")
        if kind == "cut":
            return Verdict("deny", "models.server_tools", f"the request names {where} server-side tools or URLs")
        if f.get("network") is False:
            continue  # a tool in the provider's sandbox that reaches no host (file search, code execution)
        targets = [f["url"]] if isinstance(f.get("url"), str) else \
            f["domains"] if kind == "tool" and isinstance(f.get("domains"), list) else None
        if not targets:
            what = "an MCP connector or server without a URL" if kind == "mcp" else \
                f"the web tool {f.get('tool')!r} names no allowed_domains, so it could reach any host" \
                if f.get("domains", 0) is None else f"the server-side tool {f.get('tool')!r} is not one the door knows"
            return Verdict("deny", "models.server_tools", f"{where}: {what}")
        for target in targets:
            if not isinstance(target, str):
                return Verdict("deny", "models.server_tools", f"{where}: a URL that is not a string")
            rule, why = _host(policy, target)
            if rule and "url" not in f and "://" not in target:  # a web tool's domain admits its subdomains there
                rule, why = _host(policy, SUBDOMAIN + target.lstrip("."))
                why = why and f"{why} (a web tool's allowed domain {target[:100]!r} admits its subdomains, so " \
                              f"[egress] allow must admit *.{target[:100]} too)"
            if not rule:
                return Verdict("deny", "models.server_tools", f"{where}: {why}")
    return None
