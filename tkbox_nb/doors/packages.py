"""The package door on the host: pip in the box installs from the indexes `[packages]` names, each project and each
file decided and signed, each file's bytes checked against the index's sha256 and kept in a host cache.

pip in the box is pointed here with no setting of the user's (`box_env`: PIP_INDEX_URL and the rest): it speaks
plain HTTP to the agent's endpoint on the box's loopback (guest/forwarder.py, kind "packages", 127.0.0.1:3130),
and each connection is one door stream carrying one request, answered with `Connection: close`. Two kinds of
request are served, anything else is a 404:

- `/simple/<project>/`: the project's name (PEP 503 normal form) is decided first; a refused one is signed and never
  asked of any index. An allowed one's page comes from the host cache while it is fresh (younger than the max-age the
  index stated, as pip's own cache keeps it, and than `[packages] page_max_age_s`: rules/package_cache.py; a second
  box asks the index nothing), else it is fetched by the host itself (its own TLS and trust store, no proxy, no
  redirect followed) from the first index that has it and kept (doors/package_store.py). Either way it is read
  strictly (rules/package_index.py) under this box's policy and signed (`project`: the index, how many files, where
  the page came from and, from the cache, when the index served it; the sha256 of the index's bytes and of the page
  the box gets; the host and the addresses it was reached at: doors/package_fetch.py, which refuses a private or
  metadata address before connecting and dials only the address it checked); an index that cannot be reached is
  answered from the page last kept, however old, and the record says so. The box gets the door's own page: every link
  on the door, by sha256.
- `/files/<sha256>/<name>`: only a file of a page this box was served. Its bytes come from the content-addressed
  cache (a second box installs without touching the index) or from the index, read to one byte past
  `max_file_bytes`, hashed as they come; the file is then decided and signed (`file`: project, name, version, the
  index's sha256, the sha256 of the bytes, size, where they came from, the run's bytes before it), and served only
  when allowed. Bytes that do not match the index's hash are never kept.

Installs go to a per-box directory in the box's writable /tmp (`PIP_TARGET`, which the agent puts on PYTHONPATH):
the host's environment is read-only in the box and is never changed.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import h11

from tkbox_nb.doors.door import Door
from tkbox_nb.doors.package_fetch import AddressRefused, checked, pinned_request
from tkbox_nb.doors.package_store import Cache, digest
from tkbox_nb.guest import protocol as p
from tkbox_nb.policy.packages import project_verdict
from tkbox_nb.rules.package_cache import KeptPage, age_of, fresh_enough, index_max_age
from tkbox_nb.rules.door_table import PACKAGES
from tkbox_nb.rules.package_index import (MAX_PAGE_BYTES, IndexFile, IndexPageError, file_request, file_version,
                                          parse_page, pin_files, project_of, render_page)
from tkbox_nb.stream.connection import Stream, StreamClosed
from tkbox_nb.stream.events import Data

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext

PORT = 3130
SITE = "/tmp/tkbox-site-packages"  # where pip installs in the box (its writable tmpfs)
HEAD_TIMEOUT_S = 30.0
MAX_AT_ONCE = 8
CHUNK = p.MAX_PAYLOAD - 1
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"


def box_env(port: int = PORT) -> dict[str, str]:
    """pip (and uv) in the box use the door, install into the box's own writable directory, and ask nothing else
    (no version check: it would be a request for the project `pip`; no pip.conf of the host's, whose extra indexes
    or find-links would be other ways in, or a constraints file the box does not have). They wait long for an
    answer: the door has a file whole, and hashed, before it sends the first byte (pip's own 15 s would ask again
    for a large one)."""
    base = f"http://127.0.0.1:{port}/simple/"
    return {"TKBOX_PACKAGES_PORT": str(port), "TKBOX_PACKAGES_SITE": SITE, "PIP_INDEX_URL": base,
            "PIP_TRUSTED_HOST": "127.0.0.1", "PIP_TARGET": SITE, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1", "PIP_TIMEOUT": "900", "PIP_CONFIG_FILE": "/dev/null", "UV_INDEX_URL": base,
            "UV_DEFAULT_INDEX": base, "UV_HTTP_TIMEOUT": "900",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class PackagesDoor(Door):
    """The package door of one box: its index pages and files, decided, signed and served from the host cache."""

    name = PACKAGES

    def __init__(self, box: "DoorContext", cache_root: Path, pins: dict[str, dict[str, str]] | None = None):
        self.box = box
        self.pins = pins or {}  # a rerun's: project -> file name -> the sha256 the original run signed
        self.cache = Cache(cache_root)
        self.offered: dict[str, tuple[str, IndexFile, str]] = {}  # sha256 -> (project, file, index): served pages
        self.run_bytes = 0     # bytes of files allowed in this run, stated in each next file's decision
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_AT_ONCE)
        self._clients: dict = {}  # host name -> httpx client (package_fetch.py: one per name)

    def accept(self, stream: Stream, body: dict) -> bool:
        if body.get("kind") != "packages":
            return False
        threading.Thread(target=self._serve, args=(stream,), daemon=True, name="tkbox-packages").start()
        return True

    def env(self) -> dict[str, str]:
        return box_env()

    def stop(self, reason: str) -> None:
        with self.lock:
            for c in self._clients.values():
                c.close()

    def get(self, url: str, address: str, headers: dict | None = None):
        """A streamed GET of `url` sent to `address` (checked) and nowhere else: see package_fetch.py."""
        import httpx
        target, names, extensions = pinned_request(url, address)
        host = names["Host"]
        with self.lock:
            if host not in self._clients:  # the host's proxy settings are not the box's; a redirect is not followed
                wait = self.box.policy.get("packages", "timeout_s")  # to connect, and between any two reads
                self._clients[host] = httpx.Client(timeout=httpx.Timeout(wait), trust_env=False,
                                                   follow_redirects=False)
            client = self._clients[host]
        return client.stream("GET", target, headers={**(headers or {}), **names}, extensions=extensions)

    # -- one request ---------------------------------------------------------------------------------------------
    def _serve(self, stream: Stream) -> None:
        with self.slots:
            conn = h11.Connection(h11.SERVER)
            try:
                path = self._read(stream, conn)
                if path is None:
                    return self.box.conn.close(stream.sid)
                project, wanted = project_of(path), file_request(path)
                if project is not None:
                    self._page(stream, conn, project)
                elif wanted is not None:
                    self._file(stream, conn, *wanted)
                else:
                    raise _Refused(404, f"the package door serves /simple/<project>/ and its files, not {path[:100]}")
            except _Refused as e:
                self._answer(stream, conn, e.status, f"tkbox packages door: {e}\n".encode(), "text/plain")
            except (StreamClosed, OSError, h11.LocalProtocolError):
                pass
            except h11.RemoteProtocolError as e:
                self._answer(stream, conn, 400, f"tkbox packages door: {e}\n".encode(), "text/plain")
            except p.ProtocolError as e:
                self.box.fail_closed(f"door protocol violation: {e}")
            except Exception as e:  # a fault of this door: the box's pip gets an answer, never a hang
                self._answer(stream, conn, 502, f"tkbox packages door: failed ({type(e).__name__})\n".encode(),
                             "text/plain")
            finally:
                try:
                    self.box.conn.close(stream.sid)
                except (StreamClosed, OSError):
                    pass

    def _read(self, stream: Stream, conn: h11.Connection) -> str | None:
        deadline = time.monotonic() + HEAD_TIMEOUT_S
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    got = stream.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise _Refused(408, "no complete request within 30s") from None
                if not isinstance(got, Data):  # the box closed the stream, or the door stream ended
                    return None
                if got.channel != p.CH_BYTES:
                    raise p.ProtocolError(f"packages data on channel {got.channel}")
                conn.receive_data(bytes(got.payload))
                continue
            if isinstance(event, h11.Request):
                if event.method != b"GET":
                    raise _Refused(405, f"only GET, not {event.method[:20].decode('latin-1')}")
                target = event.target.decode("latin-1").partition("?")[0]
            elif isinstance(event, h11.EndOfMessage):
                return target
            elif not isinstance(event, h11.Data):
                return None

    def _refused(self, crossing) -> _Refused:
        if self.box.recorder.broken:
            self.box.fail_closed(f"signer lost: {self.box.recorder.broken}")
        why = crossing.verdict.reason or crossing.reason
        return _Refused(403, f"refused by {crossing.verdict.rule} ({', '.join(crossing.rule_ids) or 'refused'}): "
                             f"{why}")

    # -- a project's page ----------------------------------------------------------------------------------------
    def _page(self, stream: Stream, conn: h11.Connection, project: str) -> None:
        policy, recorder = self.box.policy, self.box.recorder
        facts: dict = {"project": project}
        files: list[IndexFile] = []
        if project_verdict(policy, project).allowed:  # a refused name is never asked of any index
            try:
                files, where = self._fetch_page(project)
                files = pin_files(files, self.pins[project]) if project in self.pins else files
                facts.update(where, files=len(files))
            except IndexPageError as e:
                facts["index_error"] = str(e)[:300]
            except AddressRefused as e:  # nothing sent: the decision re-derives the refusal from the stated answer
                facts.update(e.facts)
            except Exception as e:  # a fault of this door on this page: refused, signed, never half served
                facts["index_error"] = f"the package door failed reading the page ({type(e).__name__})"
        page = render_page(project, files)
        if "files" in facts:
            facts["served_sha256"] = hashlib.sha256(page).hexdigest()  # the bytes the box gets
        crossing = recorder.decide(PACKAGES, "project", facts)
        if not crossing.allowed:
            raise self._refused(crossing)
        with self.lock:
            for f in files:
                self.offered[f.sha256] = (project, f, facts["index"])
        self._signed_send(crossing, len(page), lambda: self._answer(stream, conn, 200, page,
                                                                    "text/html; charset=utf-8", quiet=False))

    def _fetch_page(self, project: str) -> tuple[list[IndexFile], dict]:
        """The project's files from the first index that has it: its page kept in the host cache while fresh (the
        index's max-age, at most `page_max_age_s`), else fetched (or, when that index cannot be reached, its page
        last kept, of any age); and what the record states of where they came from. IndexPageError when none."""
        import httpx
        policy = self.box.policy
        hosts, max_age = policy.get("packages", "file_hosts"), policy.get("packages", "page_max_age_s")
        resolvers = tuple(policy.get("packages", "nameservers"))  # a page is kept per resolver: package_cache.py
        for index in policy.get("packages", "index"):
            url, dialled = index.rstrip("/") + f"/{project}/", {}
            kept = self.cache.page(index, project, resolvers)
            age = age_of(kept.fetched_at, time.time()) if kept is not None else 0.0
            if kept is not None and fresh_enough(age, kept.index_max_age, max_age):  # the rule decide asks again
                try:  # read again under this box's policy: a kept page offers nothing a fetched one could not
                    return parse_page(kept.body, kept.content_type, project, kept.url, hosts), \
                        {"index": index, **kept.dialled, **_kept_facts(kept, max_age, age)}
                except IndexPageError:
                    pass  # refused as read now: the index is asked
            began = time.time()
            try:
                try:
                    dialled, address = checked(policy, url)
                except AddressRefused as e:
                    e.facts["index"] = index
                    raise
                except OSError as e:  # the name did not resolve: as an index that cannot be reached
                    raise httpx.ConnectError(str(e)) from None
                with self.get(url, address, {"Accept": ACCEPT}) as r:
                    if r.status_code == 404:
                        continue
                    if r.status_code != 200:
                        raise IndexPageError(f"{index} answered {r.status_code} for {project} (no redirect is "
                                             "followed)")
                    body = bytearray()
                    for chunk in r.iter_bytes():
                        body += chunk
                        if len(body) > MAX_PAGE_BYTES:
                            raise IndexPageError(f"{index}: the page for {project} is over {MAX_PAGE_BYTES} bytes")
                    ctype, stated = r.headers.get("content-type", ""), index_max_age(r.headers.get("cache-control"))
            except httpx.HTTPError as e:
                if kept is None:
                    raise IndexPageError(f"{index} cannot be reached ({type(e).__name__}) and no page for {project} "
                                         "is kept") from None
                files = parse_page(kept.body, kept.content_type, project, kept.url, hosts)
                return files, {"index": index, "index_unreachable": f"{type(e).__name__}", **dialled,
                               **_kept_facts(kept, max_age, age_of(kept.fetched_at, time.time()))}
            files = parse_page(bytes(body), ctype, project, url, hosts)
            self.cache.keep_page(KeptPage(index, project, url, ctype, began, bytes(body), dialled, stated,
                                          tuple(sorted(set(resolvers)))))
            return files, {"index": index, "source": "index", **dialled, "index_max_age_s": stated,
                           "page_sha256": hashlib.sha256(body).hexdigest()}
        raise IndexPageError(f"no index in [packages] index has {project}")

    # -- one file ------------------------------------------------------------------------------------------------
    def _file(self, stream: Stream, conn: h11.Connection, sha: str, name: str) -> None:
        with self.lock:
            offered = self.offered.get(sha)
        if offered is None or offered[1].filename != name:
            raise _Refused(404, f"{name[:100]} is on no page this box was served")
        project, f, index = offered
        limit = self.box.policy.get("packages", "max_file_bytes")
        facts = {"project": project, "filename": name, "version": file_version(project, name) or "",
                 "sha256": sha, "index": index}
        if self.pins.get(project, {}).get(name) == sha:  # a rerun's: only these bytes may be installed
            facts["pinned"] = sha
        handle, source = self.cache.open_file(sha), "cache"
        if handle is None:
            source = "index"
            try:
                if not f.url:
                    raise _FetchError(f"{name} is on the index's page no more, and not in the host cache")
                try:
                    dialled, address = checked(self.box.policy, f.url)
                except OSError as e:
                    raise _FetchError(f"{name}: its host did not resolve ({str(e)[:200]})") from None
                facts.update(dialled)
                handle = self._download(f, limit, address)
            except AddressRefused as e:  # nothing sent: the decision re-derives the refusal from the stated answer
                facts.update(e.facts)
            except _FetchError as e:
                facts["fetch_error"] = str(e)[:300]
        got, size = ("", 0) if handle is None else digest(handle, limit)
        facts.update(source=source, got_sha256=got, size=size)
        try:
            with self.lock:  # one at a time, so each states the allowed bytes signed before it
                facts["run_bytes"] = self.run_bytes
                crossing = self.box.recorder.decide(PACKAGES, "file", facts)
                if crossing.allowed:
                    self.run_bytes += size
            if not crossing.allowed:
                raise self._refused(crossing)
            if source == "index":
                self.cache.keep_file(handle.name, sha)
            handle.seek(0)
            self._signed_send(crossing, size, lambda: self._send_file(stream, conn, handle, size))
        finally:
            if handle is not None:
                handle.close()
                if source == "index" and os.path.exists(handle.name) and \
                        Path(handle.name).parent == self.cache.root / "tmp":
                    os.unlink(handle.name)

    def _download(self, f: IndexFile, limit: int, address: str):
        """The file from its index (at `address`, checked), into a temporary file of the cache, at most `limit` + 1
        bytes."""
        import httpx
        out = self.cache.new_file()
        try:
            with self.get(f.url, address) as r:
                if r.status_code != 200:
                    raise _FetchError(f"the index answered {r.status_code} for {f.filename} (no redirect is "
                                      "followed)")
                n = 0
                for chunk in r.iter_raw():
                    out.write(chunk[:limit + 1 - n])
                    n += len(chunk)
                    if n > limit:
                        break
        except httpx.HTTPError as e:
            out.close()
            os.unlink(out.name)
            raise _FetchError(f"{f.filename} could not be fetched ({type(e).__name__})") from None
        except _FetchError:
            out.close()
            os.unlink(out.name)
            raise
        out.flush()
        return out

    def _send_file(self, stream: Stream, conn: h11.Connection, handle, size: int) -> None:
        self._send(stream, conn, h11.Response(status_code=200, headers=[
            ("content-type", "application/octet-stream"), ("content-length", str(size)), ("connection", "close")]))
        while True:
            chunk = handle.read(CHUNK)
            if not chunk:
                break
            self._send(stream, conn, h11.Data(data=chunk))
        self._send(stream, conn, h11.EndOfMessage())

    # -- answering the box ---------------------------------------------------------------------------------------
    def _signed_send(self, crossing, size: int, send) -> None:
        """Send an allowed page or file; its crossing ends signed however the sending ends."""
        try:
            send()
        except BaseException as e:
            self.box.recorder.complete(crossing, "error", {"error": f"not all sent to the box ({type(e).__name__})"})
            raise
        self.box.recorder.complete(crossing, "ok", {"bytes": size})

    def _send(self, stream: Stream, conn: h11.Connection, event) -> None:
        data = conn.send(event)
        if data:
            self.box.conn.send_data(stream.sid, p.CH_BYTES, data)

    def _answer(self, stream: Stream, conn: h11.Connection, status: int, body: bytes, ctype: str,
                quiet: bool = True) -> None:
        """A whole answer; a box that went away meanwhile is ignored when `quiet` (a refusal), else raised."""
        try:
            if conn.our_state is not h11.SEND_RESPONSE:  # the request was not whole: answer without h11's state
                head = (f"HTTP/1.1 {status} Error\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                        "connection: close\r\n\r\n").encode()
                self.box.conn.send_data(stream.sid, p.CH_BYTES, head + body)
                return
            self._send(stream, conn, h11.Response(status_code=status, headers=[
                ("content-type", ctype), ("content-length", str(len(body))), ("connection", "close")]))
            self._send(stream, conn, h11.Data(data=body))
            self._send(stream, conn, h11.EndOfMessage())
        except (StreamClosed, OSError, h11.LocalProtocolError):
            if not quiet:
                raise


class _FetchError(Exception):
    pass



def _kept_facts(kept: KeptPage, max_age: float, age: float) -> dict:
    """What the record states of a page served from the host cache: when the index served those bytes, how old
    they were when judged (`age`, the very number fresh_enough judged: decide judges it again), the freshness rule
    (the index's max-age, the policy's), and their sha256."""
    when = datetime.fromtimestamp(kept.fetched_at, timezone.utc).isoformat(timespec="milliseconds")
    return {"source": "cache", "fetched_at": when, "age_s": age,
            "index_max_age_s": kept.index_max_age, "page_max_age_s": max_age, "page_sha256": kept.sha256}
