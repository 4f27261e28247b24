"""The package door's kept index pages: how one is sealed on the host, read back, judged fresh, and which go when the
cache is over its bound. Sans-IO: bytes, a key and a clock reading in; the door (doors/packages.py) does the files.

A page kept is the index's own bytes (with the content type and the URL they came from, when, and the host and
addresses the door reached then), so serving it means reading it strictly again (rules/package_index.parse_page,
under the policy of the box now asking): a kept page can offer the box nothing a fresh one could not. An entry is
named by the sha256 of its index URL, project and the policy's `[packages] nameservers` (sorted) together
(`page_key`), and states all three inside: two indexes, two URLs, or two resolvers never share one. The key holds
what decides where the page came from: the URL, and the nameservers that chose the address behind its host (a
policy with a hostile resolver, say a rerun under a downloaded bundle's policy, must not keep an `http://` page that
the user's other boxes are then served). It leaves out what decides only whether that source may be used, which the
asking box judges itself on every serving: `allow_cidrs` (the decision judges the kept page's stated host and
addresses again under the asking box's policy, `policy/packages.address_verdict`, refusing what its own fetch would
refuse) and `file_hosts` (the page is parsed again under the asking box's policy, and each file's host is resolved
by that box's own door when its file is fetched).

An entry is sealed with an HMAC-SHA256 under a key of the host cache's own (`seal`), so an entry cut short, a bit
flipped, or one written by anyone who cannot read that key is refused whole by `unseal` (None: the door asks the
index again), never served.

Fresh is pip's own rule for a simple page, capped by the user's: a page is served from the cache while its age is
under the `max-age` the index stated in its `Cache-Control` (PyPI states 600 s; pip's HTTP cache keeps a page that
long) and under `[packages] page_max_age_s` (600 by default; 0 = always ask the index). An index that states no
max-age, or `no-cache` or `no-store`, is asked for every page, as pip asks it (`index_max_age`: 0). A page fetched
"in the future" (the clock went back) is not fresh.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, field

from tkbox_nb.rules.package_index import MAX_PAGE_BYTES

MAGIC = b"tkbox-page-1\n"
MAX_HEADER = 16 << 10
MAX_CACHE_BYTES = 256 << 20  # all kept pages together; the oldest go first past it
CLOCK_SKEW_S = 5.0           # a fetch time this far ahead of the clock is no longer believed
MAX_ENTRY_BYTES = len(MAGIC) + 65 + MAX_HEADER + 1 + MAX_PAGE_BYTES
MAX_STATED_AGE_S = 365 * 24 * 3600  # a longer max-age is read as this (the policy's cap is far below it anyway)
DIALLED = ("host", "addresses", "address", "address_class")  # what the door states of the host it reached


@dataclass(frozen=True)
class KeptPage:
    """One index page as fetched: from `index` for `project`, at `url`, at `fetched_at` (seconds since the epoch)."""

    index: str
    project: str
    url: str
    content_type: str
    fetched_at: float
    body: bytes
    dialled: dict = field(default_factory=dict)
    index_max_age: float = 0.0  # the max-age the index stated for it (index_max_age)
    nameservers: tuple = ()     # the policy's [packages] nameservers it was fetched under (sorted; () = the system's)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


def resolvers(nameservers) -> list[str]:
    """The nameservers as a key holds them: each once, sorted (the policy's order does not change who answers)."""
    return sorted({str(n) for n in nameservers})


def page_key(index: str, project: str, nameservers=()) -> str:
    """The entry's name: no two (index URL, project, nameservers) share it (JSON frames each, so no separator is
    ambiguous; with no nameservers, the system resolver's, it is the name it always was)."""
    ns = resolvers(nameservers)
    return hashlib.sha256(json.dumps([index, project, *([ns] if ns else [])]).encode()).hexdigest()


def _mac(key: bytes, header: bytes, body: bytes) -> bytes:
    m = hmac.new(key, MAGIC, hashlib.sha256)
    m.update(len(header).to_bytes(8, "big") + header)
    m.update(body)
    return m.hexdigest().encode()


def seal(key: bytes, page: KeptPage) -> bytes:
    """The entry's bytes: magic, MAC, header line (JSON), body."""
    dialled = {k: page.dialled[k] for k in DIALLED if k in page.dialled}
    header = json.dumps({"index": page.index, "project": page.project, "url": page.url,
                         "content_type": page.content_type, "fetched_at": page.fetched_at,
                         "sha256": page.sha256, "bytes": len(page.body), "dialled": dialled,
                         "index_max_age": page.index_max_age, "nameservers": resolvers(page.nameservers)},
                        sort_keys=True).encode()
    return MAGIC + _mac(key, header, page.body) + b"\n" + header + b"\n" + page.body


def unseal(key: bytes, data: bytes, index: str, project: str, nameservers=()) -> KeptPage | None:
    """The page an entry holds, when its MAC is right under `key`, it is of exactly `index`, `project` and
    `nameservers` (an entry that states none was kept under the system resolver), and its fields have their shapes;
    else None (the entry is as good as absent)."""
    if not data.startswith(MAGIC) or len(data) > MAX_ENTRY_BYTES:
        return None
    rest = data[len(MAGIC):]
    mac, nl, rest = rest[:64], rest[64:65], rest[65:]
    end = rest.find(b"\n", 0, MAX_HEADER + 1)
    if nl != b"\n" or end < 0:
        return None
    header, body = rest[:end], rest[end + 1:]
    if not hmac.compare_digest(mac, _mac(key, header, body)):
        return None
    try:
        h = json.loads(header)
    except ValueError:
        return None
    if not isinstance(h, dict) or h.get("index") != index or h.get("project") != project \
            or h.get("nameservers", []) != resolvers(nameservers):
        return None
    when = h.get("fetched_at")
    if not all(isinstance(h.get(k), str) for k in ("url", "content_type")) or isinstance(when, bool) \
            or not isinstance(when, (int, float)) or not math.isfinite(when) or not isinstance(h.get("dialled"), dict):
        return None
    stated = h.get("index_max_age")
    if isinstance(stated, bool) or not isinstance(stated, (int, float)) or not 0 <= stated <= MAX_STATED_AGE_S:
        return None
    if h.get("bytes") != len(body) or h.get("sha256") != hashlib.sha256(body).hexdigest():
        return None
    return KeptPage(index, project, h["url"], h["content_type"], float(when), body,
                    {k: v for k, v in h["dialled"].items() if k in DIALLED}, float(stated),
                    tuple(resolvers(nameservers)))


def index_max_age(cache_control: str | None) -> float:
    """The seconds an index's `Cache-Control` header lets a private cache (pip's, the door's) serve the page without
    asking again: its `max-age`; 0 when it states none, `no-cache` or `no-store`, or anything unreadable about it."""
    if not cache_control or len(cache_control) > 1000:
        return 0.0
    ages = []
    for part in cache_control.split(","):
        name, _, value = part.strip().partition("=")
        name, value = name.strip().lower(), value.strip().strip('"')
        if name in ("no-cache", "no-store"):
            return 0.0
        if name == "max-age":
            if not re.fullmatch(r"[0-9]{1,12}", value):
                return 0.0
            ages.append(min(int(value), MAX_STATED_AGE_S))
    return float(min(ages)) if ages else 0.0


def age_of(fetched_at: float, now: float) -> float:
    """A kept page's age at `now`, in seconds to the millisecond, rounded down: the age the door judges and states
    (`age_s`) is one number, so `tkbox verify` judging the stated age judges what the door judged."""
    return math.floor((now - fetched_at) * 1000) / 1000


def fresh_enough(age_s: float, index_max_age_s: float, page_max_age_s: float) -> bool:
    """Whether a page `age_s` old may be served from the cache without asking the index: younger than both the
    index's stated max-age and the policy's page_max_age_s (either 0: never), and not from the future beyond the
    clock's skew. The one rule: the door asks it before serving a kept page, and policy/packages.decide asks it
    again of the record's stated age and max-ages."""
    limit = min(index_max_age_s, page_max_age_s)
    return limit > 0 and -CLOCK_SKEW_S <= age_s < limit


def fresh(fetched_at: float, now: float, max_age_s: float) -> bool:
    """Whether a page fetched at `fetched_at` may be served at `now` without asking the index: younger than
    `max_age_s` (the smaller of the index's max-age and the policy's page_max_age_s)."""
    return fresh_enough(age_of(fetched_at, now), max_age_s, max_age_s)


def evictions(entries: list[tuple[str, int, float]], bound: int = MAX_CACHE_BYTES) -> list[str]:
    """Which entries (name, size, time last written) go so that the rest fit in `bound`: the oldest first."""
    total = sum(size for _, size, _ in entries)
    out = []
    for name, size, _ in sorted(entries, key=lambda e: (e[2], e[0])):
        if total <= bound:
            break
        out.append(name)
        total -= size
    return out
