"""The environment a box runs in, as a manifest its box.start signs: the same notebook saw pandas 3.1.1 in a
bubblewrap box and 1.5.3 in a VM, and nothing in either run told. For a run to be reproducible its environment must
be named in it.

The manifest (docs/bundle-format.md#environment) names the interpreter, every distribution the box's interpreter
finds (name, version, where it lives as the box sees it, a digest of its files as its RECORD lists them and one of
the RECORD itself), and the Debian packages under it. It trusts each RECORD's own hashes and never re-reads the
files: that keeps a cold scan to milliseconds per distribution, and what it names is what the installer wrote. A
file changed in place after installation is not seen (the threat model says so).

A bubblewrap box binds the host's interpreter and venv read-only, so its manifest is computed on the host, once per
state of the scanned directories: the cache (under $TKBOX_HOME/environments) is keyed by each site directory's and
each dist-info directory's inode and mtime, which an install, upgrade or removal changes, so a warm box start pays
only the stats (`python -m bench environment` measures it). A VM image's manifest is made once, when the image is
built, from the root it built, and kept beside the image.

The manifest in a bundle is the box's content like any other (hostile): `parse` reads it strictly, with limits.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import platform
import re
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any

FORMAT = "tkbox-environment/1"
MAX_BYTES = 8 << 20             # a manifest larger than this is not read from a bundle
MAX_ITEMS = 20000               # distributions or Debian packages
MAX_RECORD_BYTES = 16 << 20     # a RECORD larger than this is named by its digest only
_DIST_DIR = re.compile(r".+\.(dist-info|egg-info)")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _text(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (kept by os.listdir as surrogates) become U+FFFD, so the
    manifest is always UTF-8 and every reader can print it."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a box.start commits to: sorted keys, no spaces, UTF-8."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# -- reading what an installer wrote (pure but for the reads) ----------------------------------------------------------
def record_digests(record: bytes) -> dict[str, Any]:
    """A RECORD's digests: `record` over its bytes, `files` over each listed file with a hash (its path and the
    RECORD's own hash, sorted), and how many it lists and hashes (a RECORD lists itself and .pyc files unhashed)."""
    rows = []
    listed = 0
    for row in csv.reader(io.StringIO(record.decode("utf-8", "replace"))):
        if not row or not row[0]:
            continue
        listed += 1
        if len(row) > 1 and row[1]:
            rows.append(f"{row[0]}\0{row[1]}\n")
    files = hashlib.sha256("".join(sorted(rows)).encode("utf-8", "surrogatepass")).hexdigest()
    return {"record_digest": _sha(record), "files_digest": "sha256:" + files, "files": listed, "hashed": len(rows)}


def _headers(text: str) -> dict[str, str]:
    """Name and Version from a METADATA or PKG-INFO (RFC 822 headers up to the first blank line)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in out:
            out[key] = value.strip()
    return out


def distribution(dist_dir: Path, location: str) -> dict[str, Any]:
    """One distribution from its .dist-info (or .egg-info) directory; `location`: its site directory as the box
    sees it."""
    meta = dist_dir / ("METADATA" if dist_dir.name.endswith(".dist-info") else "PKG-INFO")
    try:
        with open(meta, "rb") as f:
            head = _headers(f.read(64 << 10).decode("utf-8", "replace"))
    except OSError:
        head = {}
    item: dict[str, Any] = {"name": head.get("Name", _text(dist_dir.name).split("-")[0]),
                            "version": head.get("Version", ""), "location": _text(location),
                            "dist_info": _text(dist_dir.name)}
    try:
        with open(dist_dir / "RECORD", "rb") as f:
            record = f.read(MAX_RECORD_BYTES + 1)
    except OSError:
        item["record_digest"] = None  # an egg-info or a distribution installed without one: said, never guessed
        return item
    if len(record) > MAX_RECORD_BYTES:
        item["record_digest"] = None
        return item
    item.update(record_digests(record))
    return item


def dpkg_packages(status: str) -> list[dict[str, str]]:
    """The installed packages of a dpkg status file: name, version, architecture, sorted by name."""
    out = []
    for block in status.split("\n\n"):
        fields = dict(re.findall(r"^(Package|Version|Architecture|Status): *(.*)$", block, re.M))
        if "Package" in fields and fields.get("Status", "").endswith(" installed"):
            out.append({"name": fields["Package"], "version": fields.get("Version", ""),
                        "architecture": fields.get("Architecture", "")})
    return sorted(out, key=lambda p: (p["name"], p["architecture"]))


def scan(site_dirs: list[tuple[Path, str]]) -> list[dict[str, Any]]:
    """Every distribution in these site directories, (host path, box path) each, in the order the box's interpreter
    searches them."""
    out = []
    for host, box in site_dirs:
        try:
            names = sorted(os.listdir(host))
        except OSError:
            continue
        out += [distribution(host / n, box) for n in names if _DIST_DIR.fullmatch(n) and (host / n).is_dir()]
    return out


def state(site_dirs: list[Path], extra: list[Path] = ()) -> str:
    """What the cache is keyed by: each site directory's and each of its dist-info directories' device, inode and
    mtime (an install, upgrade or removal changes them), and those of `extra` files (a dpkg status)."""
    h = hashlib.sha256()
    for d in site_dirs:
        try:
            st = os.stat(d)
            h.update(f"{d}\0{st.st_dev}\0{st.st_ino}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
            with os.scandir(d) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if _DIST_DIR.fullmatch(e.name):
                        s = e.stat(follow_symlinks=True)
                        h.update(f"{e.name}\0{s.st_ino}\0{s.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        except OSError:
            h.update(f"{d}\0missing\n".encode("utf-8", "surrogateescape"))
    for p in extra:
        try:
            st = os.stat(p)
            h.update(f"{p}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_size}\n".encode())
        except OSError:
            h.update(f"{p}\0missing\n".encode())
    return h.hexdigest()


# -- the host's interpreter, as a bubblewrap box sees it ---------------------------------------------------------------
def host_site_dirs() -> list[Path]:
    """The directories this interpreter finds distributions in without this process's own additions: its site
    directories (a venv's, and the base's when the venv includes them) and what their .pth files add."""
    dirs = [Path(p) for p in site.getsitepackages()]
    known = {str(p) for p in dirs}
    for p in sys.path:  # .pth additions: under a site directory's prefix, in sys.path order
        if p and p not in known and ("site-packages" in p or "dist-packages" in p) and os.path.isdir(p) \
                and any(p.startswith(k) for k in (sys.prefix, sys.base_prefix)):
            dirs.append(Path(p))
            known.add(p)
    return dirs


def box_path(path: str, view: dict[str, str]) -> str | None:
    """`path` as the box sees it: `view` maps host directories to where the box binds them (longest first)."""
    for host in sorted(view, key=len, reverse=True):
        if path == host or path.startswith(host.rstrip("/") + "/"):
            return view[host] + path[len(host.rstrip("/")):] if host != "/" else path
    return None


def host_python(view: dict[str, str], cache_dir: Path | None = None,
                dpkg_status: Path = Path("/var/lib/dpkg/status"), dirs: list[Path] | None = None) -> bytes:
    """The environment part of a bubblewrap box's manifest, as canonical JSON: this interpreter and its
    distributions as the box sees them (`view`: host directory -> box directory), and the host's Debian packages
    (the box binds the host's /usr), from the cache under `cache_dir` when the scanned directories are as they
    were. `dirs`: other site directories than this interpreter's."""
    dirs = [d for d in (host_site_dirs() if dirs is None else dirs) if box_path(str(d), view) is not None]
    extra = [dpkg_status] if dpkg_status.is_file() else []
    key = state(dirs, extra)
    cache = None
    if cache_dir is not None:
        name = hashlib.sha256(canonical({"exe": sys.executable, "view": view, "dirs": [str(d) for d in dirs]})
                              ).hexdigest()[:32]
        cache = cache_dir / f"{name}.json"
        try:  # the state's digest on the first line, then the bytes as they go into the manifest: never re-encoded
            held = cache.read_bytes()
            if held[:65] == key.encode() + b"\n":
                return held[65:]
        except OSError:
            pass
    exe = os.path.join(sys.prefix, "bin", "python3")
    env = canonical({"interpreter": {"implementation": sys.implementation.name, "version": platform.python_version(),
                           "platform": sysconfig.get_platform(), "executable": _text(box_path(exe, view) or exe)},
           "paths": [_text(box_path(str(d), view) or "") for d in dirs],
           "distributions": scan([(d, box_path(str(d), view) or "") for d in dirs]),
           "debian": {"packages": dpkg_packages(dpkg_status.read_text("utf-8", "replace"))} if extra
           else {"unavailable": "no dpkg status on the host"}})
    if cache is not None:
        from tkbox_nb.core.atomic_file import write_atomic
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(cache, key.encode() + b"\n" + env)
    return env


def image_python(tree: Path) -> dict[str, Any]:
    """The environment part of a VM image's manifest, from the root directory an image build made (`tree`): its
    python3's version, the distributions under /usr/lib/python3 and /usr/local/lib/python3.*, and its dpkg status."""
    status = tree / "var" / "lib" / "dpkg" / "status"
    packages = dpkg_packages(status.read_text("utf-8", "replace")) if status.is_file() else None
    py = next((p["version"] for p in packages or [] if re.fullmatch(r"python3\.[0-9]+-minimal", p["name"])), "")
    dirs = sorted(tree.glob("usr/local/lib/python3*/dist-packages")) + [tree / "usr/lib/python3/dist-packages"]
    dirs = [d for d in dirs if d.is_dir()]
    rel = [(d, "/" + str(d.relative_to(tree))) for d in dirs]
    return {"interpreter": {"implementation": "cpython", "version": py.split("-")[0].split("+")[0],
                            "platform": "linux-x86_64", "executable": "/usr/bin/python3"},
            "paths": [b for _, b in rel], "distributions": scan(rel),
            "debian": {"packages": packages} if packages is not None
            else {"unavailable": "the image keeps no dpkg status"}}


def manifest(env: bytes | dict[str, Any] | None, backend: str, image_digest: str, why_none: str = "") -> bytes:
    """The manifest a box.start commits to: the backend and image as the box names them, and the environment part
    (canonical bytes, spliced in as they are: a warm start never re-encodes them) or why there is none."""
    if not env:
        return canonical({"backend": backend, "format": FORMAT, "image_digest": image_digest,
                          "unavailable": why_none or "not recorded"})
    part = env if isinstance(env, bytes) else canonical(env)
    return b'{"backend":%s,"environment":%s,"format":%s,"image_digest":%s}' % (
        canonical(backend), part, canonical(FORMAT), canonical(image_digest))


# -- reading a bundle's manifest (hostile) -----------------------------------------------------------------------------
def _str(v: Any, what: str, limit: int = 1000) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise ValueError(f"{what} is not a string of at most {limit} characters")
    return v


def parse(data: bytes) -> dict[str, Any]:
    """A manifest from a bundle, checked for the shape every reader takes it to have. ValueError names what is
    wrong. What it does not check (that the box.start committed to these bytes) is tkbox verify's."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"the environment manifest is over {MAX_BYTES >> 20} MiB")
    try:
        m = json.loads(data)
    except ValueError:
        raise ValueError("the environment manifest is not JSON") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"the environment manifest is not {FORMAT}")
    for k in ("backend", "image_digest"):
        _str(m.get(k), k, 200)
    if "unavailable" in m:
        _str(m["unavailable"], "unavailable")
        return m
    e = m.get("environment")
    if not isinstance(e, dict):
        raise ValueError("environment is not an object")
    interp = e.get("interpreter")
    if not isinstance(interp, dict):
        raise ValueError("interpreter is not an object")
    for k in ("implementation", "version", "platform", "executable"):
        _str(interp.get(k), f"interpreter.{k}")
    paths = e.get("paths")
    if not isinstance(paths, list) or len(paths) > 1000 or not all(isinstance(x, str) and len(x) <= 1000
                                                                  for x in paths):
        raise ValueError("paths is not a list of strings")
    dists = e.get("distributions")
    if not isinstance(dists, list) or len(dists) > MAX_ITEMS:
        raise ValueError(f"distributions is not a list of at most {MAX_ITEMS}")
    for i, d in enumerate(dists):
        if not isinstance(d, dict):
            raise ValueError(f"distribution {i} is not an object")
        for k in ("name", "version", "location", "dist_info"):
            _str(d.get(k), f"distribution {i} {k}")
        for k in ("record_digest", "files_digest"):
            if d.get(k) is not None and not (isinstance(d[k], str) and _DIGEST.fullmatch(d[k])):
                raise ValueError(f"distribution {i} {k} is not a sha256 digest")
    deb = e.get("debian")
    if not isinstance(deb, dict):
        raise ValueError("debian is not an object")
    if "packages" in deb:
        pk = deb["packages"]
        if not isinstance(pk, list) or len(pk) > MAX_ITEMS or not all(
                isinstance(p, dict) and all(isinstance(p.get(k), str) and len(p[k]) <= 300
                                            for k in ("name", "version", "architecture")) for p in pk):
            raise ValueError("debian.packages is not a list of name, version, architecture")
    else:
        _str(deb.get("unavailable"), "debian.unavailable")
    return m


COLUMNS = ["kind", "name", "version", "location", "digest"]


def rows(m: dict[str, Any]) -> list[dict[str, str]]:
    """One row per item of a parsed manifest (kind python, distribution or debian), for a table."""
    if "unavailable" in m:
        return []
    m = m["environment"]
    i = m["interpreter"]
    out = [{"kind": "python", "name": i["implementation"], "version": i["version"], "location": i["executable"],
            "digest": i["platform"]}]
    out += [{"kind": "distribution", "name": d["name"], "version": d["version"], "location": d["location"],
             "digest": d.get("files_digest") or "(no RECORD)"} for d in m["distributions"]]
    out += [{"kind": "debian", "name": p["name"], "version": p["version"], "location": p["architecture"],
             "digest": ""} for p in m["debian"].get("packages", [])]
    return out


def summary(m: dict[str, Any]) -> str:
    """One line: the interpreter, how many distributions and Debian packages."""
    if "unavailable" in m:
        return f"not recorded ({m['unavailable']})"
    m = m["environment"]
    i, deb = m["interpreter"], m["debian"]
    debs = f"{len(deb['packages'])} Debian packages" if "packages" in deb else f"Debian: {deb['unavailable']}"
    return (f"{i['implementation']} {i['version']} ({i['platform']}), {len(m['distributions'])} distributions, "
            f"{debs}")


def box_environment(backend: Any, home: Path) -> bytes:
    """The manifest a box.start commits to, from `backend` (its cache under `home`/environments). A manifest that
    cannot be read is named as such, with why: the box still starts, and its run says what it could not record."""
    try:
        return backend.environment(home / "environments")
    except Exception as e:  # an unreadable site directory, a cache the user cannot write
        return manifest(None, backend.name, backend.image_digest(),
                        f"could not be read ({type(e).__name__}: {str(e)[:200]})")


def status_line(data: bytes | None) -> str:
    """A running box's manifest in one line with the start of its digest (%box_status)."""
    if data is None:
        return "not recorded"
    try:
        return f"{summary(parse(data))} ({_sha(data)[:19]}...)"
    except ValueError as e:
        return f"unreadable: {e}"
