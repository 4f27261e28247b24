"""[packages]: which simple-API indexes the package door reads, which projects and files may enter the box, and
how large; and the decision on one project page or one file (doors/packages.py states its facts, `tkbox verify`
decides them again).

No `index`: no package crosses (the door is not there, and pip in the box reaches nothing). Project names are
compared in their PEP 503 normal form (`Foo_Bar.baz` is `foo-bar-baz`), and so are the globs: a user who writes
`allow = ["Scikit_Learn"]` means scikit-learn. `deny` is read before `allow`. A file is decided on what the door saw:
the index's sha256 for it and the sha256 of the bytes that came (they must be the same), its size (refused past
`max_file_bytes`; the door stops reading one byte past it), and the run's bytes before it (refused past
`max_total_bytes`). `page_max_age_s` caps how long the door serves an index page from its host cache without
asking the index (never longer than the index's own max-age, as pip: rules/package_cache.py; 0 = always ask); a page
the record says came from the cache while its index answered is decided on its stated age by the rule the door used
(`cache_verdict`). Pure: no clock, no I/O (the age is the door's statement).

Every index and file host is resolved by the door itself, which states the host and its whole answer (`host`,
`addresses`) and dials only the address it checked: a host whose addresses include one that rules/addresses.py refuses
always (loopback, private, link-local, cloud metadata, ...) is refused before any connection, whatever the policy
says, and so is a special-purpose range (documentation, benchmarking, ...) that `allow_cidrs` does not open; the
egress door's rule, so that an index URL (a policy's, or a bundle's for a rerun) cannot make the host reach what the
box may not.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import math
import re
from typing import Any
from urllib.parse import urlsplit

from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy.base import Settings, Verdict, seconds_problem
from tkbox_nb.rules.addresses import classify, refused_name
from tkbox_nb.rules.package_cache import fresh_enough
from tkbox_nb.rules.package_index import PROJECT, normalize

SCHEMA: dict[str, type | tuple[type, ...]] = {
    "index": list, "allow": list, "deny": list, "file_hosts": list, "max_file_bytes": int, "max_total_bytes": int,
    "timeout_s": (int, float), "allow_cidrs": list, "nameservers": list, "page_max_age_s": (int, float)}
DEFAULTS: dict[str, Any] = {"index": [], "allow": [], "deny": [], "file_hosts": [], "max_file_bytes": 256 << 20,
                            "max_total_bytes": 2 << 30, "timeout_s": 60, "allow_cidrs": [],
                            "nameservers": [], "page_max_age_s": 600}
MAX_PAGE_AGE_S = 7 * 24 * 3600
MAX_BYTES = 1 << 40
SHA256 = re.compile(r"[0-9a-f]{64}")


def validate(out: dict[str, dict[str, Any]], name: str) -> None:
    """What [packages] must hold beyond its keys' types (core.py checked those): http(s) index URLs with a host and
    nothing a URL should not carry (no user or password: a secret in a policy is disclosed in every bundle), host
    names for file_hosts, sizes from 1 byte to 1 TiB."""
    section = out.get("packages")
    if section is None:
        return
    for url in section.get("index", []):
        why = index_url_problem(url)
        if why:
            raise PolicyError(f"{name}: packages.index entry {url[:120]!r} {why}")
    for host in section.get("file_hosts", []):
        if not re.fullmatch(r"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?", host):
            raise PolicyError(f"{name}: packages.file_hosts entry {host[:120]!r} must be a host name (HOST or "
                              "HOST:PORT)")
    for key in ("allow", "deny"):
        for pattern in section.get(key, []):
            if not re.fullmatch(r"[A-Za-z0-9._*?\[\]!-]{1,200}", pattern):
                raise PolicyError(f"{name}: packages.{key} entry {pattern[:120]!r} must be a project name or a glob "
                                  "of one (letters, digits, - _ . and * ? [ ])")
    why = seconds_problem(section["timeout_s"], 600) if "timeout_s" in section else ""
    if why:
        raise PolicyError(f"{name}: packages.timeout_s {why}")
    age = section.get("page_max_age_s", 0)
    if isinstance(age, bool) or not (isinstance(age, (int, float)) and 0 <= age <= MAX_PAGE_AGE_S):
        raise PolicyError(f"{name}: packages.page_max_age_s must be a number of seconds from 0 (always ask the index) "
                          f"to {MAX_PAGE_AGE_S}, not {age!r}"[:300])
    for key in ("max_file_bytes", "max_total_bytes"):
        if key in section and not 0 < section[key] <= MAX_BYTES:
            raise PolicyError(f"{name}: packages.{key} must be from 1 to {MAX_BYTES} bytes, not {section[key]}")
    for key in ("allow_cidrs", "nameservers"):
        for value in section.get(key, []):
            try:
                (ipaddress.ip_network(value, strict=False) if key == "allow_cidrs" else ipaddress.ip_address(value))
            except (TypeError, ValueError):
                raise PolicyError(f"{name}: packages.{key} entry {str(value)[:120]!r} is not an "
                                  f"{'address range' if key == 'allow_cidrs' else 'IP address'}") from None


def index_url_problem(url: str) -> str:
    """Why a policy's index URL is unusable, or ""."""
    try:
        parts = urlsplit(url)
        parts.port
    except ValueError as e:
        return f"is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if parts.username or parts.password:
        return "must not carry a user name or password (the policy is disclosed in every bundle)"
    if parts.query or parts.fragment:
        return "must have no query or fragment"
    return ""


def project_verdict(policy: Settings, project: str) -> Verdict:
    """Whether the project may cross: deny first, then allow, names and globs both in normal form."""
    name = normalize(project)
    for i, pattern in enumerate(policy.get("packages", "deny")):
        if fnmatch.fnmatchcase(name, normalize(pattern)):
            return Verdict("deny", f"packages.deny[{i}]", f"{name!r} matches {pattern!r} in [packages] deny")
    for i, pattern in enumerate(policy.get("packages", "allow")):
        if fnmatch.fnmatchcase(name, normalize(pattern)):
            return Verdict("allow", f"packages.allow[{i}]")
    return Verdict("deny", "packages.allow", f"{name!r} is not in [packages] allow")


def address_verdict(policy: Settings, facts: dict[str, Any]) -> Verdict | None:
    """The deny verdict on the host the door would dial (or did) for a page or a file, or None when it passes: its
    name, then every address its lookup gave (one refused address refuses the whole answer, as at the egress door).
    The door asks this before it connects; `tkbox verify` asks it again of the stated facts."""
    host = facts.get("host")
    if facts.get("host_error") or not isinstance(host, str) or not host:
        return Verdict("deny", "packages.host", str(facts.get("host_error") or "no index or file host stated")[:300])
    why = refused_name(host)
    if why:
        return Verdict("deny", "packages.always", f"the host {why}, never reached")
    addresses = facts.get("addresses")
    try:
        parsed = [ipaddress.ip_address(a) for a in addresses]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return Verdict("deny", "packages.resolve", f"the addresses of {host[:100]} are not stated as addresses")
    cidrs = tuple(ipaddress.ip_network(c, strict=False) for c in policy.get("packages", "allow_cidrs"))
    for addr in parsed:
        cls, why = classify(addr, cidrs)
        if cls != "ok":
            why = why.replace("egress.allow_cidrs", "packages.allow_cidrs")
            return Verdict("deny", f"packages.{cls}", f"the host {host[:100]}: {why}" +
                           (", never reached whatever the policy says" if cls == "always" else ""))
    if facts.get("source") == "index" and facts.get("address") not in addresses:  # type: ignore[operator]
        return Verdict("deny", "packages.resolve", f"{host[:100]} was reached at an address not stated as checked")
    return None


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def cache_verdict(policy: Settings, facts: dict[str, Any]) -> Verdict | None:
    """The deny verdict on a page served from the host cache while its index answered, or None when it passes (or
    did not come from the cache, or came from it because the index could not be reached: then its page last kept,
    however old, and `index_unreachable` says so). It must have been fresh by rules/package_cache.fresh_enough, the
    rule the door asked before serving it, of the stated `age_s` and `index_max_age_s` and of this policy's
    `page_max_age_s`, which the record must state as it is."""
    if facts.get("source") != "cache" or facts.get("index_unreachable"):
        return None
    age, index_age, page_age = facts.get("age_s"), facts.get("index_max_age_s"), facts.get("page_max_age_s")
    if not (_seconds(age) and _seconds(index_age) and _seconds(page_age)):
        return Verdict("deny", "packages.page_age", "a page from the host cache whose age or max-ages are not stated")
    mine = policy.get("packages", "page_max_age_s")
    if page_age != mine:
        return Verdict("deny", "packages.page_max_age_s", f"the page from the host cache was judged under "
                                                          f"page_max_age_s = {page_age}, the policy says {mine}")
    if not fresh_enough(age, index_age, mine):
        return Verdict("deny", "packages.page_age", f"the page from the host cache is {age} s old, not under the "
                                                    f"index's max-age ({index_age} s) and [packages] page_max_age_s "
                                                    f"({mine} s)")
    return None


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 50


def decide(policy: Settings, kind: Any, facts: dict[str, Any]) -> Verdict:
    """A project's page (`project`) or one file (`file`) into the box."""
    if kind not in ("project", "file"):
        return Verdict("deny", "packages.kind", f"unknown packages kind {kind!r}")
    if not policy.get("packages", "index"):
        return Verdict("deny", "packages.index", "the policy names no package index ([packages] index)")
    project = facts.get("project")
    if not isinstance(project, str) or not PROJECT.fullmatch(project):
        return Verdict("deny", "packages.project", "no project name in PEP 503's normal form")
    by_name = project_verdict(policy, project)
    if not by_name.allowed:
        return by_name
    if "host" in facts or facts.get("source") == "index" and not facts.get("fetch_error"):  # what it reached
        refused = address_verdict(policy, facts)
        if refused is not None:
            return refused
    if facts.get("index_error"):  # the page could not be had (nor from the cache), or was refused as read
        return Verdict("deny", "packages.index_page", str(facts["index_error"])[:300])
    if kind == "project":
        return cache_verdict(policy, facts) or by_name
    stated, got, size, before = facts.get("sha256"), facts.get("got_sha256"), facts.get("size"), facts.get("run_bytes")
    if not isinstance(stated, str) or not SHA256.fullmatch(stated):
        return Verdict("deny", "packages.hash", "the index gives no sha256 for the file")
    if facts.get("fetch_error"):
        return Verdict("deny", "packages.fetch", str(facts["fetch_error"])[:300])
    pinned = facts.get("pinned")  # a rerun's file: the sha256 its original run signed, and no other bytes
    if pinned is not None and (pinned != stated or got != pinned):
        return Verdict("deny", "packages.rerun", f"{str(facts.get('filename'))[:200]}: the run this reruns installed "
                                                 f"sha256 {str(pinned)[:64]}, the bytes to be had now are "
                                                 f"{str(got)[:64] or 'none'}")
    if not _count(size) or not _count(before):
        return Verdict("deny", "packages.size", "the file's size or the run's bytes are not stated")
    limit = policy.get("packages", "max_file_bytes")
    if size > limit:
        return Verdict("deny", "packages.max_file_bytes", f"the file is over {limit} bytes ([packages] "
                                                          "max_file_bytes)")
    if got != stated:
        return Verdict("deny", "packages.hash", f"the file's bytes have sha256 {str(got)[:64]}, the index says "
                                                f"{stated}")
    total = policy.get("packages", "max_total_bytes")
    if before + size > total:
        return Verdict("deny", "packages.max_total_bytes", f"the run's files would be over {total} bytes "
                                                           "([packages] max_total_bytes)")
    return by_name
