"""The `.tkb` bundle: Tracekit's v2 export of one box's run, plus a `box/` layer listed in the same manifest.

Writing takes the run from the machine signer and the box's host-only spool. Reading is parsing hostile input:
`read_entries` is a pure function of the bundle's bytes that refuses unsafe zips (names that could leave a folder,
duplicates under case folding or Unicode normalization, symlinks, directories, encryption, zip bombs, sizes past the
limits) before anything else looks at them. Nothing here ever writes a file from a bundle to disk.

docs/bundle-format.md specifies the layout for third-party verifiers.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import re
import unicodedata
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkbox_nb.core.atomic_file import write_atomic
from tkbox_nb.core.errors import BundleError, SignerError
from tkbox_nb.guest.protocol import loads_one_reading

BOX_FORMAT = "tkbox.box.v1"
TRACEKIT_FORMAT = "tracekit.bundle.v2"
MAX_ENTRIES = 10_000          # Tracekit's verifier limits, so every bundle we accept is one it can read
MAX_ENTRY = 64 << 20
MAX_TOTAL = 512 << 20
MAX_RATIO = 200               # uncompressed / compressed for entries over 1 MiB: more is a bomb
SMALL_BUNDLE_EXPANSION = 64 << 20  # and all entries together may expand MAX_RATIO times the file, or to this
MAX_DISCLOSURE_LINE = 4 << 20  # a disclosure is one crossing's statement or result: the signer's frames are smaller
CONTENT_PART_BYTES = 32 << 20
DISCLOSURE_PART_BYTES = 32 << 20  # a long run's disclosures (about 500 bytes a record) outgrow one 64 MiB entry
DISCLOSURE_PART = re.compile(r"box/disclosures-([0-9]{4})\.jsonl")
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)*")
_HEX64 = re.compile(r"[0-9a-f]{64}")


# -- reading (sans-IO) -----------------------------------------------------------------------------------------------
def check_name(name: str) -> None:
    """Refuse a zip entry name that is not a plain relative path of safe characters."""
    if "\x00" in name:
        raise BundleError(f"entry name {name[:80]!r} contains NUL")
    if "\\" in name:
        raise BundleError(f"entry name {name[:80]!r} contains a backslash")
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise BundleError(f"entry name {name[:80]!r} is an absolute path")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise BundleError(f"entry name {name[:80]!r} has an empty, '.' or '..' component")
    if not _NAME.fullmatch(name):
        raise BundleError(f"entry name {name[:80]!r} has characters outside [A-Za-z0-9._-/]")


def read_entries(data: bytes) -> dict[str, bytes]:
    """{name: bytes} of a bundle's zip, or BundleError naming the first thing that makes it unsafe or unreadable."""
    if len(data) > MAX_TOTAL + (16 << 20):
        raise BundleError(f"the bundle is {len(data)} bytes, over the {MAX_TOTAL >> 20} MiB limit")
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        infos = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, ValueError, EOFError, OSError,
            NotImplementedError) as e:  # NotImplementedError: a zip version zipfile does not read
        raise BundleError(f"not a readable zip file: {e}") from None
    if len(infos) > MAX_ENTRIES:
        raise BundleError(f"{len(infos)} entries, over the limit of {MAX_ENTRIES}")
    seen: dict[str, str] = {}
    for info in infos:  # duplicates first: they are the reason even when a name is also unsafe
        name = info.orig_filename
        folded = unicodedata.normalize("NFKC", name).casefold()
        if folded in seen:
            what = "duplicate entry" if seen[folded] == name else "entries that differ only in case or normalization"
            raise BundleError(f"{what}: {seen[folded][:80]!r} and {name[:80]!r}")
        seen[folded] = name
    declared = 0
    for info in infos:
        name = info.orig_filename
        if not info.filename:  # empty, or cut at a NUL by zipfile (whose is_dir then fails): refused by name
            check_name(name)
            raise BundleError(f"entry name {name[:80]!r} is empty")
        if name.endswith("/") or info.is_dir():
            raise BundleError(f"directory entry {name[:80]!r}")
        check_name(name)
        mode = info.external_attr >> 16
        if mode & 0o170000 == 0o120000:
            raise BundleError(f"symlink entry {name!r}")
        if mode & 0o170000 not in (0, 0o100000):
            raise BundleError(f"entry {name!r} is not a regular file")
        if info.flag_bits & 0x1:
            raise BundleError(f"entry {name!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise BundleError(f"entry {name!r} uses compression method {info.compress_type}")
        if info.file_size > MAX_ENTRY:
            raise BundleError(f"entry {name!r} is {info.file_size} bytes, over the {MAX_ENTRY >> 20} MiB limit")
        if expands_too_much(info.file_size, info.compress_size):
            raise BundleError(f"entry {name!r} expands {info.file_size // max(info.compress_size, 1)}x: a zip bomb")
        declared += info.file_size
        if declared > MAX_TOTAL:
            raise BundleError(f"the entries expand to more than {MAX_TOTAL >> 20} MiB")
    if declared > max(MAX_RATIO * len(data), SMALL_BUNDLE_EXPANSION):  # many small entries, each under the ratio
        raise BundleError(f"the entries expand {declared // max(len(data), 1)}x the bundle's size: a zip bomb")
    files: dict[str, bytes] = {}
    total = 0
    for info in infos:
        cap = min(MAX_ENTRY, MAX_TOTAL - total)
        try:
            with z.open(info) as f:
                body = f.read(cap + 1)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, ValueError, EOFError, OSError,
                NotImplementedError) as e:
            raise BundleError(f"entry {info.filename!r} is corrupt: {e}") from None
        if len(body) > cap or len(body) != info.file_size:
            raise BundleError(f"entry {info.filename!r} holds {len(body)} bytes, not the {info.file_size} it declares")
        files[info.filename] = body
        total += len(body)
    return files


def expands_too_much(size: int, compressed: int) -> bool:
    """The reader's rule for one entry: over 1 MiB, it may expand at most MAX_RATIO times. The writer holds every entry
    it deflates to half that (`deflates_safely`), so what it writes is always read back."""
    return size > (1 << 20) and size > MAX_RATIO * max(compressed, 1)


def read_bundle_file(path: str | Path) -> dict[str, bytes]:
    return read_entries(read_bundle_bytes(path))


def read_bundle_bytes(path: str | Path) -> bytes:
    """The bytes of a bundle file, refusing what is not a regular file or is too large to be a bundle."""
    p = Path(path)
    try:
        if p.is_symlink() or not p.is_file():
            raise BundleError(f"{p}: not a regular file")
        size = p.stat().st_size
        if size > MAX_TOTAL + (16 << 20):
            raise BundleError(f"{p}: {size} bytes, over the {MAX_TOTAL >> 20} MiB limit")
        return p.read_bytes()
    except OSError as e:
        raise BundleError(f"{p}: cannot read: {e.strerror or e}") from None


def loads_json(data: bytes, what: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN or Infinity (spelled, or a number that overflows to it)."""
    try:
        return loads_one_reading(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BundleError(f"{what}: not valid JSON: {str(e)[:200]}") from None


def loads_jsonl(data: bytes, what: str, max_line: int | None = None) -> list[Any]:
    """JSON lines, each strict; with `max_line`, every line's length is checked before any is parsed."""
    lines = data.split(b"\n")
    if max_line is not None:
        long = next((i for i, line in enumerate(lines) if len(line) > max_line), None)
        if long is not None:
            raise BundleError(f"{what} line {long + 1}: {len(lines[long])} bytes, over the {max_line >> 20} MiB limit")
    return [loads_json(line, f"{what} line {i + 1}") for i, line in enumerate(lines) if line.strip()]


@dataclass
class BundleContents:
    """The parsed parts of a bundle, not yet verified. `records` are the run's v2 records in file order."""

    files: dict[str, bytes]
    manifest: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    box: dict[str, Any] | None = None
    disclosures: list[dict[str, Any]] = field(default_factory=list)
    disclosure_lines: list[tuple[str, int]] = field(default_factory=list)  # (file, line) of each disclosure
    content: dict[str, bytes] = field(default_factory=dict)
    policies: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str | None:
        for r in self.records:
            if isinstance(r, dict) and isinstance(r.get("event"), dict):
                return r["event"].get("run_id")
        return None


def parse(files: dict[str, bytes]) -> BundleContents:
    """Split a bundle's entries into its parts. Unreadable structure raises BundleError; content that is readable but
    wrong is left for the verifier."""
    if "manifest.json" not in files:
        raise BundleError("no manifest.json: not a Tracekit v2 bundle")
    manifest = loads_json(files["manifest.json"], "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != TRACEKIT_FORMAT:
        raise BundleError(f"manifest.json: format is not {TRACEKIT_FORMAT}")
    if not isinstance(manifest.get("files"), dict):
        raise BundleError("manifest.json: no files table")
    out = BundleContents(files=files, manifest=manifest)
    runs = sorted(n for n in files if n.startswith("runs/") and n.endswith(".jsonl"))
    if not runs:
        raise BundleError("the bundle holds no run records")
    for name in runs:  # Tracekit's verifier checks each record strictly; here they are only read
        try:
            out.records += [json.loads(line) for line in files[name].split(b"\n") if line.strip()]
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise BundleError(f"{name}: not JSON lines: {str(e)[:200]}") from None
    if "box/manifest.json" in files:
        out.box = loads_json(files["box/manifest.json"], "box/manifest.json")
        if not isinstance(out.box, dict):
            raise BundleError("box/manifest.json is not an object")
    parts = sorted(n for n in files if DISCLOSURE_PART.fullmatch(n))
    if parts and "box/disclosures.jsonl" in files:
        raise BundleError("box/disclosures.jsonl and box/disclosures-NNNN.jsonl parts: a bundle holds one or the other")
    if parts and [int(DISCLOSURE_PART.fullmatch(n).group(1)) for n in parts] != list(range(1, len(parts) + 1)):
        raise BundleError(f"box/disclosures parts are not numbered 0001 to {len(parts):04d} without a gap")
    for name in parts or (["box/disclosures.jsonl"] if "box/disclosures.jsonl" in files else []):
        items = loads_jsonl(files[name], name, MAX_DISCLOSURE_LINE)
        out.disclosures += items
        out.disclosure_lines += [(name, i + 1) for i in range(len(items))]
    for name in sorted(n for n in files if re.fullmatch(r"box/content-[0-9]{4}\.jsonl", n)):
        for i, item in enumerate(loads_jsonl(files[name], name)):
            if not (isinstance(item, dict) and set(item) == {"digest", "b64"} and isinstance(item["digest"], str)
                    and isinstance(item["b64"], str)):
                out.problems.append(f"{name} line {i + 1}: not a {{digest, b64}} item")
                continue
            if item["digest"] in out.content:
                out.problems.append(f"{name} line {i + 1}: content {item['digest'][:19]}... a second time")
                continue
            try:
                out.content[item["digest"]] = base64.b64decode(item["b64"], validate=True)
            except ValueError:
                out.problems.append(f"{name} line {i + 1}: content is not base64")
    for name, body in files.items():
        m = re.fullmatch(r"box/policies/([0-9a-f]{64})\.toml", name)
        if m:
            try:
                out.policies["sha256:" + m.group(1)] = body.decode("utf-8")
            except UnicodeDecodeError:
                out.problems.append(f"{name}: not UTF-8")
    return out


def opens(salt: bytes, digest: str, commitment: Any) -> bool:
    """Whether `commitment` (hmac-sha256:HEX) is HMAC-SHA256(salt, digest): the record committed to this content.
    Here, beside the format it checks, because writing a bundle checks it too (bundle/verify.py imports
    bundle/archive.py, never the other way round)."""
    if not isinstance(commitment, str) or not commitment.startswith("hmac-sha256:"):
        return False
    mine = "hmac-sha256:" + hmac.new(salt, digest.encode(), "sha256").hexdigest()
    return hmac.compare_digest(mine, commitment)


# -- writing ---------------------------------------------------------------------------------------------------------
def write_bundle(signer, run_id: str, spool: Path, out_path: str | Path, final: bool = True) -> Path:
    """Export `run_id` from `signer` and write `out_path` (atomically: a temporary file beside it, then rename).
    `final=False` writes the run so far: the records a checkpoint covers now, and what they disclose."""
    from tracekit.format.canon import canonical, event_hash

    out_path = Path(out_path)
    export_tmp = spool / "tracekit-export.tkb"
    signer.export(run_id, export_tmp, final=final)
    files = read_bundle_file(export_tmp)
    export_tmp.unlink()
    manifest = loads_json(files.pop("manifest.json"), "tracekit manifest")
    records = [r for n in sorted(files) if n.startswith("runs/") for r in loads_jsonl(files[n], n)]
    by_call: dict[tuple[str, str], dict] = {}
    for r in records:
        e = r["event"]
        call_id = e.get("data", {}).get("tool_use_id")
        if e["type"] in ("policy.decision", "tool.result") and call_id:
            by_call[(e["type"], call_id)] = e
    disclosures, wanted, blobs, found = [], set(), {}, []
    spooled = (spool / "disclosures.jsonl").read_bytes()
    for entry in loads_jsonl(spooled[:spooled.rfind(b"\n") + 1], "spool"):  # a torn last line: never signed
        blobs.update(entry.pop("blobs", {}))
        kind = "policy.decision" if entry["kind"] == "decision" else "tool.result"
        event = by_call.get((kind, entry.get("call_id")))
        if event is None:  # written ahead of a signer call that never recorded it (refused, lost, or past a snapshot)
            continue
        found.append((entry, kind, event))
    salts = signer.salts([event for _, _, event in found])  # the machine signer derives them; a central one sends them
    for entry, kind, event in found:
        salt = salts[event["run_seq"]]
        item = {"run_seq": event["run_seq"], "type": kind, "salt": salt.hex(), "content": entry["content"]}
        if kind == "policy.decision":
            item["args"] = entry["args"]
            digest = event_hash({"tool": event["data"]["tool"], "args": entry["args"]})
            commitment = event["data"].get("args_commitment")
        else:
            item["result"] = entry["result"]
            digest = "sha256:" + hashlib.sha256(canonical({"result": entry["result"]})).hexdigest()
            commitment = event["data"].get("output", {}).get("hash")
        if not opens(salt, digest, commitment):
            raise SignerError(f"record {event['run_seq']}: the spooled content does not open its commitment")
        disclosures.append(item)
        wanted.update(entry["content"].values())
    disclosures.sort(key=lambda d: d["run_seq"])
    box_files: dict[str, bytes] = {}
    box = json.loads((spool / "box.json").read_text())
    parts, current, size = [], [], 0
    for digest in sorted(wanted):
        line = json.dumps({"digest": digest, "b64": blobs[digest]}).encode() + b"\n"
        if current and size + len(line) > CONTENT_PART_BYTES:
            parts.append(b"".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        parts.append(b"".join(current))
    for i, part in enumerate(parts, 1):
        box_files[f"box/content-{i:04d}.jsonl"] = part
    for h in box["policies"]:
        box_files[f"box/policies/{h.removeprefix('sha256:')}.toml"] = \
            (spool / "policies" / (h.removeprefix("sha256:") + ".toml")).read_bytes()
    if (spool / "patch.diff").exists():  # the last patch summary's diff, readable with `unzip -p` and `git apply`
        box_files["box/patch.diff"] = (spool / "patch.diff").read_bytes()
    mount_lists = spool / "mounts"  # each dataset mount's entries, which its signed digest commits to (mounts.py)
    for f in sorted(mount_lists.glob("*.jsonl")) if mount_lists.is_dir() else []:
        box_files[f"box/mounts/{f.name}"] = f.read_bytes()
    box_files.update(disclosure_files(disclosures))
    box["format"] = BOX_FORMAT
    box["content_files"] = sorted(n for n in box_files if n.startswith("box/content-"))
    box_files["box/manifest.json"] = json.dumps(box, sort_keys=True, indent=1).encode()
    files.update(box_files)
    manifest["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    check_limits(files, run_id)
    write_zip(out_path, {"manifest.json": json.dumps(manifest, indent=1).encode(), **files})
    return out_path


def disclosure_files(disclosures: list[dict]) -> dict[str, bytes]:
    """`box/disclosures.jsonl`, or, once it would pass DISCLOSURE_PART_BYTES, its parts in order (whole lines)."""
    lines = [json.dumps(d, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n" for d in disclosures]
    if sum(len(line) for line in lines) <= DISCLOSURE_PART_BYTES:
        return {"box/disclosures.jsonl": b"".join(lines)}
    parts: list[list[bytes]] = [[]]
    size = 0
    for line in lines:
        if parts[-1] and size + len(line) > DISCLOSURE_PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(line)
        size += len(line)
    return {f"box/disclosures-{i:04d}.jsonl": b"".join(p) for i, p in enumerate(parts, 1)}


def check_limits(files: dict[str, bytes], run_id: str = "") -> None:
    """Refuse to write a bundle that no verifier could read back (Tracekit's limits: one entry at most 64 MiB, all
    of them 512 MiB), with the reason, instead of leaving an unreadable file. Tracekit splits a run's records into
    parts and this writer splits content and disclosures, so only the total can be reached: about 150,000
    crossings of small content."""
    for name, body in files.items():
        if len(body) > MAX_ENTRY:
            raise BundleError(f"run {run_id}: {name} would be {len(body) >> 20} MiB, over the {MAX_ENTRY >> 20} MiB a "
                              "bundle entry may hold; the records stay in the signer's store, but this run cannot be "
                              "one bundle")
    total = sum(len(b) for b in files.values())
    if total > MAX_TOTAL:
        raise BundleError(f"run {run_id}: the bundle would be {total >> 20} MiB, over the {MAX_TOTAL >> 20} MiB limit")


def deflates_safely(body: bytes) -> bool:
    """Whether `body` deflated (as zipfile deflates it) expands at most MAX_RATIO / 2 times. An honest run can
    deflate past the reader's bomb rule (2 MiB of one character printed is 966x, 200,000 equal progress lines
    about 400x): such an entry is stored instead, so every entry, and so the whole bundle, stays within half the
    ratio the reader allows, and the rule stays as strict as it is."""
    c = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
    return len(body) <= (MAX_RATIO // 2) * max(len(c.compress(body)) + len(c.flush()), 1)


def write_zip(out_path: Path, files: dict[str, bytes]) -> None:
    """Write a zip in the canonical layout Tracekit's verifier reads, atomically; no partial file is ever left.
    An entry that would deflate past half the reader's bomb ratio is stored (`deflates_safely`), and the sizes
    written are checked against the reader's rules before the file is kept, so no bundle is written that
    `read_entries` would refuse as a bomb."""
    def write(f) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
            for name, body in files.items():
                z.writestr(name, body, zipfile.ZIP_DEFLATED if deflates_safely(body) else zipfile.ZIP_STORED)
            infos = z.infolist()
        for info in infos:  # deflate is deterministic, so this never fires; if it did, no unreadable file is kept
            if expands_too_much(info.file_size, info.compress_size):
                raise BundleError(f"cannot write {out_path}: {info.filename} would deflate past the bomb ratio")
        written, size = sum(i.file_size for i in infos), f.tell()
        if written > max(MAX_RATIO * size, SMALL_BUNDLE_EXPANSION):
            raise BundleError(f"cannot write {out_path}: its entries would expand {written // size}x the file")
    try:
        write_atomic(out_path, write)
    except OSError as e:
        raise BundleError(f"cannot write {out_path}: {e.strerror or e}") from None
