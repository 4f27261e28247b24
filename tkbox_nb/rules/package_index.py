"""A package index's project page (PEP 503 HTML, PEP 691 JSON), read strictly and with limits, and the page the
package door serves the box in its place. Sans-IO: bytes in, files out.

The page comes from an index the policy names, but what it links to is what the box will install, so it is read as
hostile: a link to a file on a host other than the page's own (or one `[packages] file_hosts` names), a file name
with `/`, `\\` or `..` in it (a `/` spelled `%2F`), a link with no sha256, an attribute the door would pass
on that is not plain text, or a page over its limits refuses the whole page (IndexPageError, one line the door signs):
a page is never half read. Files that are neither a wheel nor an sdist (`.egg`, `.exe`, ...), or that name another
project, are left out, as pip would ignore them. The box never sees the index's page or its URLs: `render_page` writes
the door's own page, each link `/files/<sha256>/<name>` on the door, with the hash pip checks again.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import quote, unquote, urljoin, urlsplit

MAX_PAGE_BYTES = 64 << 20
MAX_FILES = 100_000
MAX_URL = 4096
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+!-]{0,254}")
SHA256 = re.compile(r"[0-9a-fA-F]{64}")
REQUIRES_PYTHON = re.compile(r"[0-9A-Za-z<>=!~*., ]{0,200}")
PROJECT = re.compile(r"[a-z0-9]([a-z0-9-]{0,198}[a-z0-9])?")
SDIST = (".tar.gz", ".zip")


class IndexPageError(ValueError):
    """Why an index page (or a link on it) is refused; one line."""


@dataclass(frozen=True)
class IndexFile:
    """One file an index page offers: its name, where the door fetches it, the index's sha256 for it (lower-case
    hex), and what pip reads besides (requires-python; yanked: None, or the reason, "" for none given)."""

    filename: str
    url: str
    sha256: str
    requires_python: str = ""
    yanked: str | None = None


def normalize(name: str) -> str:
    """PEP 503's normal form of a project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(path: str) -> str | None:
    """The project a request path `/simple/<name>/` names, in normal form; None for any other path."""
    m = re.fullmatch(r"/simple/([A-Za-z0-9._-]{1,200})/?", path)
    if m is None:
        return None
    name = normalize(m.group(1))
    return name if PROJECT.fullmatch(name) else None


def file_version(project: str, filename: str) -> str | None:
    """The version a wheel's or an sdist's name gives, when the name is of `project` (normal form); else None."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        if len(parts) not in (5, 6):
            return None
        name, version = parts[0], parts[1]
        if normalize(name) != project or not re.fullmatch(r"[A-Za-z0-9.+!_]{1,100}", version):
            return None
        return version
    ext = next((e for e in SDIST if filename.endswith(e)), None)
    if ext is None:
        return None
    stem = filename[:-len(ext)]
    # as pip reads it: the version follows the first `-` whose left part is the project's name (normal form), so a
    # legacy version holding a `-` (`pkg-1.0-1.tar.gz`: 1.0-1) is the version, and a project's own `-` is the name's
    for i in (i for i, ch in enumerate(stem) if ch == "-"):
        if normalize(stem[:i]) == project:
            version = stem[i + 1:]
            return version if re.fullmatch(r"[A-Za-z0-9.+!_-]{1,100}", version) else None
    return None


def _authority(scheme: str, host: str | None, port: int | None) -> tuple[str, int]:
    return (host or "").lower(), port or (443 if scheme == "https" else 80)


def allowed_authorities(page_url: str, file_hosts: list[str] | tuple[str, ...] = ()) -> set[tuple[str, int]]:
    """(host, port) a page's files may come from: the page's own, and each `[packages] file_hosts` entry (HOST: on
    80 or 443; HOST:PORT)."""
    page = urlsplit(page_url)
    out = {_authority(page.scheme, page.hostname, page.port)}
    for entry in file_hosts:
        host, sep, port = entry.rpartition(":")
        if sep and port.isdigit():
            out.add((host.lower(), int(port)))
        else:
            out |= {(entry.lower(), 80), (entry.lower(), 443)}
    return out


def check_link(href: str, page_url: str, allowed: set[tuple[str, int]], fragment_hash: str | None = None
               ) -> tuple[str, str, str]:
    """(file name, absolute URL without its fragment, sha256) of one link, or IndexPageError. The sha256 is the
    link's `#sha256=` (or `fragment_hash`, JSON's `hashes`)."""
    if len(href) > MAX_URL or any(c in href for c in "\x00\r\n\t\\"):
        raise IndexPageError(f"a link of {len(href)} characters or with a control character or backslash")
    try:  # urljoin and urlsplit raise ValueError on what is no URL (a bracketed host that is not IPv6)
        url, _, fragment = urljoin(page_url, href).partition("#")
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise IndexPageError(f"a link that is no URL: {href[:100]!r}") from None
    if parts.scheme not in ("http", "https") or parts.username or parts.password:
        raise IndexPageError(f"a link that is not plain http(s): {href[:100]!r}")
    if _authority(parts.scheme, parts.hostname, port) not in allowed:
        raise IndexPageError(f"a link to a file on another host ({(parts.hostname or '')[:100]!r}): {href[:100]!r}")
    name = unquote(parts.path.rpartition("/")[2])  # a relative link's `..` is resolved on the page's own host
    if not FILE_NAME.fullmatch(name) or ".." in name:
        raise IndexPageError(f"a file name the door does not take (/, \\, .., or not a wheel's or sdist's "
                             f"characters): {name[:100]!r}")
    sha = fragment_hash
    if sha is None:
        found = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", fragment)
        sha = found.group(1) if found else None
    if sha is None or not SHA256.fullmatch(sha):
        raise IndexPageError(f"a link with no sha256: {name[:100]!r}")
    return name, url, sha.lower()


def _plain(value: str | None, what: str, pattern: re.Pattern | None = None) -> str:
    text = value or ""
    if len(text) > 200 or any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in text) or \
            (pattern is not None and not pattern.fullmatch(text)):
        raise IndexPageError(f"a {what} the door does not pass on: {text[:60]!r}")
    return text


def _take(project: str, out: list[IndexFile], seen: set[str], name: str, url: str, sha: str, requires: str,
          yanked: str | None) -> None:
    if file_version(project, name) is None:
        return  # neither a wheel nor an sdist of this project: pip would not take it either
    if name in seen:
        raise IndexPageError(f"the file {name!r} listed twice")
    if len(out) >= MAX_FILES:
        raise IndexPageError(f"a page of more than {MAX_FILES} files")
    seen.add(name)
    out.append(IndexFile(name, url, sha, requires, yanked))


class _Links(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[dict[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            if len(self.links) >= MAX_FILES * 2:
                raise IndexPageError(f"a page of more than {MAX_FILES * 2} links")
            self.links.append(dict(attrs))


def _text(data: bytes) -> str:
    if len(data) > MAX_PAGE_BYTES:
        raise IndexPageError(f"a page over {MAX_PAGE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexPageError(f"a page that is not UTF-8 (byte {e.start})") from None


def parse_html(data: bytes, project: str, page_url: str, file_hosts: list[str] | tuple[str, ...] = ()
               ) -> list[IndexFile]:
    """The files a PEP 503 page offers for `project` (normal form), or IndexPageError."""
    parser = _Links()
    try:
        parser.feed(_text(data))
        parser.close()
    except (AssertionError, RecursionError) as e:  # what html.parser raises on what it cannot read at all
        raise IndexPageError(f"a page html.parser cannot read ({type(e).__name__})") from None
    allowed = allowed_authorities(page_url, file_hosts)
    out: list[IndexFile] = []
    seen: set[str] = set()
    for attrs in parser.links:
        href = attrs.get("href")
        if href is None:
            continue
        name, url, sha = check_link(href, page_url, allowed)
        requires = _plain(attrs.get("data-requires-python"), "requires-python", REQUIRES_PYTHON)
        yanked = _plain(attrs["data-yanked"], "yanked reason") if "data-yanked" in attrs else None
        _take(project, out, seen, name, url, sha, requires, yanked)
    return out


def parse_json(data: bytes, project: str, page_url: str, file_hosts: list[str] | tuple[str, ...] = ()
               ) -> list[IndexFile]:
    """The files a PEP 691 JSON page offers for `project` (normal form), or IndexPageError for any other shape."""
    try:
        doc = json.loads(_text(data))
    except (ValueError, RecursionError) as e:
        raise IndexPageError(f"a JSON page that is not JSON ({str(e)[:80]})") from None
    meta = doc.get("meta") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or not str(meta.get("api-version", "")).startswith("1.") \
            or not isinstance(doc.get("files"), list) or not isinstance(doc.get("name"), str):
        raise IndexPageError("a JSON page without meta.api-version 1.x, a name and a list of files")
    if normalize(doc["name"]) != project:
        raise IndexPageError(f"a JSON page for {doc['name'][:80]!r}, not {project!r}")
    allowed = allowed_authorities(page_url, file_hosts)
    out: list[IndexFile] = []
    seen: set[str] = set()
    for f in doc["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("url"), str) or not isinstance(f.get("filename"), str) \
                or not isinstance(f.get("hashes"), dict):
            raise IndexPageError("a JSON file entry without a url, a filename and hashes")
        sha = f["hashes"].get("sha256")
        if not isinstance(sha, str):
            raise IndexPageError(f"a JSON file entry with no sha256: {f['filename'][:100]!r}")
        name, url, sha = check_link(f["url"].partition("#")[0], page_url, allowed, sha)
        if name != f["filename"]:
            raise IndexPageError(f"a JSON file entry whose filename {f['filename'][:100]!r} is not its URL's")
        requires = f.get("requires-python")
        if requires is not None and not isinstance(requires, str):
            raise IndexPageError("a JSON file entry whose requires-python is not a string")
        yanked = f.get("yanked", False)
        if not isinstance(yanked, (bool, str)):
            raise IndexPageError("a JSON file entry whose yanked is neither a boolean nor a string")
        reason = (_plain(yanked, "yanked reason") if isinstance(yanked, str) else "") if yanked else None
        _take(project, out, seen, name, url, sha, _plain(requires, "requires-python", REQUIRES_PYTHON), reason)
    return out


def parse_page(data: bytes, content_type: str, project: str, page_url: str,
               file_hosts: list[str] | tuple[str, ...] = ()) -> list[IndexFile]:
    """A page by its content type: PEP 691 JSON (`application/vnd.pypi.simple.v1+json`) or HTML."""
    kind = content_type.partition(";")[0].strip().lower()
    if kind == "application/vnd.pypi.simple.v1+json":
        return parse_json(data, project, page_url, file_hosts)
    if kind in ("text/html", "application/vnd.pypi.simple.v1+html", ""):
        return parse_html(data, project, page_url, file_hosts)
    raise IndexPageError(f"a page of content type {kind[:80]!r}")


def render_page(project: str, files: list[IndexFile]) -> bytes:
    """The door's page for `project`: each file linked on the door by its sha256, which pip checks again."""
    rows = []
    for f in files:
        attrs = f' data-requires-python="{html.escape(f.requires_python)}"' if f.requires_python else ""
        if f.yanked is not None:
            attrs += f' data-yanked="{html.escape(f.yanked)}"'
        href = f"/files/{f.sha256}/{quote(f.filename)}#sha256={f.sha256}"
        rows.append(f'<a href="{html.escape(href)}"{attrs}>{html.escape(f.filename)}</a><br/>')
    return ("<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\">"
            f"<title>Links for {html.escape(project)}</title></head><body><h1>Links for {html.escape(project)}</h1>\n"
            + "\n".join(rows) + "\n</body></html>\n").encode("utf-8")


def pin_files(files: list[IndexFile], pins: dict[str, str]) -> list[IndexFile]:
    """A rerun's page for a project its original run installed files of (`pins`: file name -> the sha256 signed
    then): exactly those files, each with that sha256 whatever the index states now, so pip in the rerun asks for
    the same bytes; the index's URL is kept to fetch one again ("" when the page has it no more: only the host cache
    can serve it). None is offered as yanked: the original installed it."""
    now = {f.filename: f for f in files}
    return [IndexFile(name, now[name].url if name in now else "", sha,
                      now[name].requires_python if name in now else "") for name, sha in sorted(pins.items())]


def file_request(path: str) -> tuple[str, str] | None:
    """(sha256, file name) of a request path `/files/<sha256>/<name>` on the door; None for any other."""
    m = re.fullmatch(r"/files/([0-9a-f]{64})/([^/]{1,1024})", path)
    if m is None:
        return None
    name = unquote(m.group(2))
    return (m.group(1), name) if FILE_NAME.fullmatch(name) and ".." not in name else None
