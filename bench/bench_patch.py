"""The patch door deciding and applying 10,000 small files, against `shutil.copytree` of the same files.

Three figures, each against the plain copy measured in the same run (median of 3):
- host work: the patch stream parsed (PatchReader), every file decided (Policy.decide) and applied
  (workspace_writer: no-follow walk, write beside, rename), without the signer;
- the whole door from a real box: `box.patch(apply="auto")` after the box wrote the files: the guest lists and
  sends them, the host parses, decides, signs one record per file (and its result), 16 files in flight, and
  applies; beside its signing floor (an fsync shared by 16 records + Ed25519 signing per record, measured here).
Targets: under 5x the plain copy for the host work (issue #10); at most 2x for the whole door (issue #23).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from .bench_signer import IN_FLIGHT, _floors

FILES, PER_DIR, SIZE = 10_000, 100, 200


def _tree(root: Path) -> None:
    for i in range(FILES):
        d = root / f"d{i // PER_DIR:03d}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:05d}.txt").write_bytes(b"%05d" % i * (SIZE // 5))


def _copy(src: Path, work: Path) -> float:
    dst = work / "copy"
    t = time.perf_counter()
    shutil.copytree(src, dst)
    elapsed = time.perf_counter() - t
    shutil.rmtree(dst)
    return elapsed


def _host_work(wire: bytes, work: Path) -> float:
    from tkbox_nb.rules.patch_reader import PatchReader
    from tkbox_nb.policy import Policy
    from tkbox_nb.doors.workspace_writer import FileChange, apply_changes
    policy = Policy.default()
    dst = work / "applied"
    dst.mkdir()
    t = time.perf_counter()
    reader = PatchReader(policy.get("patch", "max_file_bytes"), 1 << 34, max_entries=FILES + 1)
    entries = reader.feed(wire)
    reader.finish()
    changes, total = [], 0
    for i, e in enumerate(entries):
        v = policy.decide({"door": "patch", "kind": "file", "path": e.path, "op": e.op, "type": e.type,
                           "mode": e.mode, "size": e.size, "index": i, "total_before": total, "binary": False})
        if v.allowed:
            total += e.size
            changes.append(FileChange(e.path, e.op, e.content, e.mode, None))
    outcomes = apply_changes(str(dst), changes)
    elapsed = time.perf_counter() - t
    assert len(outcomes) == FILES and all(o.applied for o in outcomes)
    shutil.rmtree(dst)
    return elapsed


def _door(home: Path, work: Path) -> float:
    from tkbox_nb import Box
    ws = work / "ws"
    ws.mkdir()
    with Box(backend="bwrap", home=home, workspace=ws, bundle_path=home / "bench-patch.tkb",
             policy='[patch]\napply = "auto"\n[box]\nworkspace_mib = 256\n') as box:
        box.collect_patch_at_stop = False
        box.run(["python3", "-c", f"import os\nfor i in range({FILES}):\n d='d%03d' % (i // {PER_DIR})\n"
                                  f" os.makedirs(d, exist_ok=True)\n open(f'{{d}}/f%05d.txt' % i, 'wb').write("
                                  f"b'%05d' % i * {SIZE // 5})\n"])
        t = time.perf_counter()
        patch = box.patch()
        elapsed = time.perf_counter() - t
    assert len(patch.files) == FILES and all(f.applied for f in patch.files), patch.summary()[:300]
    shutil.rmtree(ws)
    return elapsed


def main(n: int | None = None) -> None:
    from tkbox_nb.guest.patch import stream
    rounds = n or 3
    with tempfile.TemporaryDirectory(prefix="tkbench-") as tmp:
        work = Path(tmp)
        src = work / "src"
        src.mkdir()
        _tree(src)
        wire = b"".join(stream(None, str(src)))
        copies, hosts = [], []
        for _ in range(rounds):
            copies.append(_copy(src, work))
            hosts.append(_host_work(wire, work))
        copy, host = statistics.median(copies), statistics.median(hosts)
        print(f"patch: {FILES} files of {SIZE} bytes; shutil.copytree {copy * 1000:.0f} ms")
        print(f"  parse + decide + apply (no signer): {host * 1000:.0f} ms = {host / copy:.2f}x the copy "
              f"(target < 5x: {'met' if host / copy < 5 else 'NOT met'})")
        home = work / "home"
        door = _door(home, work)
        copy2 = _copy(src, work)
        from tkbox_nb.signing.signer import MachineSigner
        fsync, sign = _floors(MachineSigner(home).data_dir / "store")
        floor = FILES * 2 * (fsync / IN_FLIGHT + sign)
        print(f"  the whole door from a box (guest lists and sends, host parses, decides, signs "
              f"{FILES} decisions and results, {IN_FLIGHT} in flight, applies): {door * 1000:.0f} ms = "
              f"{door / copy2:.1f}x the copy ({door / FILES * 1e6:.0f} us per file; target <= 2x: "
              f"{'met' if door / copy2 <= 2 else 'NOT met'})")
        print(f"  its signing floor (fsync {fsync * 1e6:.0f} us shared by {IN_FLIGHT} records + Ed25519 sign "
              f"{sign * 1e6:.0f} us, two records a file): {floor * 1000:.0f} ms; the door took {door / floor:.1f}x it")
        MachineSigner(home).stop()
