"""The patch door: the box's workspace changes come back file by file, each decided and signed, and only allowed
files are ever written to the host (tkbox_nb/doors/workspace_writer.py), in the policy's apply mode.

The host asks; the guest agent states its changes as data (guest/patch.py); `PatchReader` parses them strictly.
Facts that depend on the whole patch (the same path twice, a case or Unicode-form collision, the running total)
are stated by the door, so `Policy.decide` stays pure and `tkbox verify` re-derives every decision. One signed
record per file (path, operation, mode, size, content digest, the host digest it replaces, the rule) discloses
the file's bytes; one summary record per patch discloses the whole cumulative patch as a `git apply` diff.
"""

from __future__ import annotations

import html
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tkbox_nb.guest import protocol as p
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.rules.patch_diff import DiffFile, render
from tkbox_nb.signing.recorder import sha256_digest
from tkbox_nb.core.visible import visible
from tkbox_nb.doors.door import Door
from tkbox_nb.doors.workspace_writer import ApplyError, FileChange, Staging, current_digest, sha256_file_digest
from tkbox_nb.rules import patch_rules as rules
from tkbox_nb.rules.patch_reader import Entry, PatchReader
from tkbox_nb.rules.door_table import PATCH

if TYPE_CHECKING:
    from tkbox_nb.doors.context import DoorContext

PATCH_TIMEOUT_S = 300.0


@dataclass
class FileDecision:
    path: str
    op: str
    decision: str
    rule: str
    reason: str = ""
    size: int = 0
    applied: bool = False
    apply_reason: str = ""


@dataclass
class Patch:
    """One collected patch: a decision per file, what was applied, and the cumulative diff."""

    files: list[FileDecision] = field(default_factory=list)
    diff: bytes = b""
    mode: str = "review"

    @property
    def allowed(self) -> list[FileDecision]:
        return [f for f in self.files if f.decision == "allow"]

    @property
    def refused(self) -> list[FileDecision]:
        return [f for f in self.files if f.decision != "allow"]

    def summary(self) -> str:
        lines = [f"patch: {len(self.allowed)} file(s) allowed, {len(self.refused)} refused (apply = {self.mode})"]
        for f in self.files:
            state = ("applied" if f.applied else f"not applied: {f.apply_reason}") if f.decision == "allow" else \
                f"refused by {f.rule}: {f.reason}"
            lines.append(f"  {visible(f.op):<7} {visible(f.path)}  {visible(state)}")  # the box named them: no row
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(f.op)}</td><td><code>{html.escape(f.path)}</code></td>"
                       f"<td>{html.escape(f.decision)}</td><td>{html.escape(f.rule)}</td>"
                       f"<td>{html.escape(f.reason or ('applied' if f.applied else f.apply_reason))}</td></tr>"
                       for f in self.files)
        return (f"<b>patch</b>: {len(self.allowed)} allowed, {len(self.refused)} refused (apply = "
                f"{html.escape(self.mode)})<table><tr><th>op</th><th>path</th><th>decision</th><th>rule</th>"
                f"<th></th></tr>{rows}</table>")


RERUN_KEEPS = "a rerun applies nothing to a folder: review its patch, then `tkbox apply BUNDLE`"


class PatchDoor(Door):
    name = "patch"  # nothing to start or end: the box's last patch is collected before its stop (its last word)

    def __init__(self, box: "DoorContext", rerun: bool = False):
        self.box = box
        self.rerun = rerun  # a rerun's box: it writes its bundle and nothing else, whatever the policy says (I57)
        self.sent: dict[str, tuple[str, str | None]] = {}   # path -> (op, digest) last decided: decided again only
                                                             # when it changes
        self.accepted: dict[str, DiffFile] = {}              # the cumulative allowed patch, for the diff
        self._bases: dict[str, tuple[str, int]] = {}         # seed path -> (digest, mode): each read once a box
        self._olds: dict[str, bytes] = {}                    # seed path -> its bytes, for an allowed file's diff
        self._renamed: dict[str, str] = {}                   # a rename's folded source -> the target it went to
        # path -> the digest this box last wrote there on the host (None: removed): a later apply of the path (a
        # second %box_pull of a result the box recomputed) goes over that, never over what the user made of it since
        self._written: dict[str, str | None] = {}

    @property
    def seed(self) -> Path | None:
        seed = self.box.recorder.spool / "seed" if self.box.recorder else None
        return seed if seed is not None and seed.is_dir() else None

    def _base(self, path: str) -> tuple[str | None, int | None]:
        """The digest and mode of `path` in the host's copy of the starting workspace (None: absent), each file
        read once a box however often the box names it: the seed never changes while the box runs."""
        if path in self._bases:
            return self._bases[path]
        seed = self.seed
        if seed is None or rules.path_problem(path):
            return None, None
        digest = current_digest(str(seed), path)
        if digest is None:
            return None, None
        self._bases[path] = digest, (seed / path).lstat().st_mode & 0o777
        return self._bases[path]

    def _old(self, path: str, digest: str | None, content: bytes | None, content_digest: str | None) -> bytes | None:
        """The starting bytes of `path` for the diff (only an allowed file's, once a path): the box's own content
        when it is the same file, else read from the seed."""
        if digest is None:
            return None
        if content is not None and content_digest == digest:
            return content
        if path not in self._olds and self.seed is not None:
            try:
                self._olds[path] = (self.seed / path).read_bytes()
            except OSError:
                return None
        return self._olds.get(path)

    def collect(self, apply: str | None = None, only: frozenset[str] | None = None, again: bool = False) -> Patch:
        """Ask the box for its changes, decide and sign each file, apply the allowed ones if the mode says so. `only`:
        the files at those paths alone (the others are left undecided, for a later patch); `only` or `again`: each
        decided again even if it was in an earlier patch unchanged (to apply what was reviewed)."""
        box = self.box
        policy = box.recorder.policy
        mode = apply or policy.get("patch", "apply")
        if self.rerun and mode == "auto":  # a bundle's policy or its replayed `%box_patch auto` asks: held at review
            mode = "review"
        keep = policy.get("patch", "max_file_bytes")
        reader = PatchReader(keep, 2 * policy.get("patch", "max_total_bytes") + keep + (64 << 20))
        entries: list[Entry] = []

        def on_data(channel: int, data: bytes) -> None:
            if channel != p.CH_BYTES:
                raise p.ProtocolError(f"patch data on channel {channel}")
            entries.extend(reader.feed(data))

        body = box.exchange({"kind": "patch"}, PATCH_TIMEOUT_S, on_data)
        try:
            reader.finish()
            if body.get("entries") != reader.entries:
                raise p.ProtocolError(f"the box said {str(body.get('entries'))[:20]} patch entries and sent "
                                      f"{reader.entries}")
        except p.ProtocolError as e:
            box.fail_closed(f"door protocol violation: {e}")
            raise TkboxError(f"the box has ended: {box.ended}") from None
        if body.get("error"):
            raise TkboxError(f"the box could not list its changes: {str(body['error'])[:200]}")
        if only is not None:
            entries = [e for e in entries if e.path in only]
        return self._decide_all(entries, mode, again or only is not None)

    def _decide_all(self, entries: list[Entry], mode: str, again: bool = False) -> Patch:
        box, rec = self.box, self.box.recorder
        patch = Patch(mode=mode)
        seen: set[str] = set()
        seen_folds: dict[str, str] = {}
        seed_folds: dict[str, str] = {}
        accepted_folds = {rules.fold(path): path for path in self.accepted}
        if self.seed is not None:
            for top, dirs, names in os.walk(self.seed):
                for name in dirs + names:
                    rel = os.path.relpath(os.path.join(top, name), self.seed).replace(os.sep, "/")
                    seed_folds.setdefault(rules.fold(rel), rel)
        # First every file's statement, host-side and in order: what the door states of a file depends on the files
        # before it (the same path twice, collisions, the running total of the ones the box policy allows), never on
        # the signer's answers. Then all are put to the signer together (RunRecorder.decide_many), so their records
        # share fsyncs. The total counts the files the box policy allows; the signer's pack only turns a stated deny
        # into a signed deny, so it agrees with the signed decisions unless the signer is lost (and then the box ends).
        total, index = 0, 0
        stated: list[tuple] = []  # (entry, digest, facts, content): no host file's bytes are kept
        for e in entries:
            digest = sha256_digest(e.content) if e.content is not None else None
            if not again and self.sent.get(e.path) == (e.op, digest):
                continue  # the same change as the last patch of this box: decided already
            facts: dict = {"path": e.path, "op": e.op, "type": e.type, "mode": e.mode, "size": e.size,
                           "index": index, "total_before": total, "rules": rules.RULES}
            if e.source is not None:
                facts["from"] = e.source
            if e.target is not None:
                facts["target"] = e.target[:1024]
            if e.content is not None and e.op != "delete":
                facts["binary"] = rules.is_binary(e.content)
            if e.dropped:
                facts["dropped"] = True
            if e.not_utf8:
                facts["not_utf8"] = True
            key = rules.fold(e.path) if isinstance(e.path, str) and not rules.path_problem(e.path) else None
            if e.path in seen:
                facts["duplicate_of"] = e.path
            elif key is not None:
                other = seen_folds.get(key) or accepted_folds.get(key) or seed_folds.get(key)
                if other is not None and other != e.path:
                    facts["collides_with"] = other
            # a path seen before costs no host I/O: the first time read it (or found it absent) and it is refused
            base, old_mode = (None, None) if key is None else \
                self._bases.get(e.path, (None, None)) if e.path in seen else self._base(e.path)
            facts["base"] = base
            if e.op == "rename":
                source_base, old_mode = self._base(e.source) if e.source is not None else (None, None)
                facts["from_base"] = source_base
                if source_base is not None:  # one source, one rename: else each would put the source's bytes in the
                    taken = self._renamed.setdefault(rules.fold(e.source), e.path)  # diff again (and again...)
                    if taken != e.path:
                        facts["from_taken"] = taken
            if old_mode is not None and e.op != "add":
                facts["old_mode"] = old_mode  # what the box started with: only the execute bits it changes apply
            content = {"content": e.content} if e.content is not None and e.op != "delete" else {}
            if e.op != "delete" and rec.verdict(PATCH, "file", facts, content).allowed:
                total += e.size
            index += 1
            seen.add(e.path)
            if key is not None:
                seen_folds.setdefault(key, e.path)
            stated.append((e, digest, facts, content))
        crossings = rec.decide_many([(PATCH, "file", facts, content) for _, _, facts, content, *_ in stated])
        if rec.broken:
            box.fail_closed(f"signer lost: {rec.broken}")
            raise TkboxError(f"the box has ended: {box.ended}")
        pending: list[tuple] = []  # (FileDecision, FileChange or None)
        done: list[tuple] = []
        for (e, digest, facts, _content), crossing in zip(stated, crossings):
            fd = FileDecision(e.path, e.op, "allow" if crossing.allowed else "deny", crossing.verdict.rule,
                              crossing.verdict.reason or ", ".join(crossing.rule_ids), e.size)
            change = None
            self.sent[e.path] = (e.op, digest)
            if crossing.allowed:  # on this file's own signed allow, never another's
                old_mode = facts.get("old_mode")
                source_base = facts.get("from_base")
                change = FileChange(e.path, "delete" if e.op == "delete" else e.op, e.content, e.mode,
                                    self._written.get(e.path, facts["base"]), e.source,
                                    self._written.get(e.source, source_base) if e.source else source_base, old_mode,
                                    _since(e.path in self._written), _since(e.source in self._written))
                new = e.content if e.op != "delete" else None
                old = self._old(e.source, facts.get("from_base"), new, digest) if e.op == "rename" else \
                    self._old(e.path, facts["base"], new, digest)
                self.accepted[e.path] = DiffFile(e.path, e.op, old, new, rules.planned_mode(e.op, e.mode, old_mode),
                                                 0o644 if old_mode is None else old_mode, e.source)
                if e.op == "rename" and e.source:
                    self.accepted.pop(e.source, None)
                # the file's bytes are out of the box and disclosed; applying is the summary's
                done.append((crossing, "ok", _applied_over(change, e.path in self._written) if mode == "auto" else {},
                             None))
            patch.files.append(fd)
            pending.append((fd, change))
        # Each allowed file is written beside its target (invisible) while the signer records the results and the
        # summary; it becomes visible only once the summary is allowed, and is removed if it is not.
        stager = _StageBehind(self.box.workspace, pending) if mode == "auto" else None
        try:
            rec.complete_many(done)
            patch.diff = render(list(self.accepted.values()))
            if not patch.files:  # nothing new since the last patch (or nothing at all): no record to add
                return patch
            s = rec.decide(PATCH, "summary", {"files": len(patch.files), "allowed": len(patch.allowed),
                                                "refused": len(patch.refused), "apply": mode},
                           {"diff": patch.diff})
            if not s.allowed:
                raise TkboxError(f"the patch summary was refused ({', '.join(s.rule_ids)}); nothing applied")
            (rec.spool / "patch.diff").write_bytes(patch.diff)
            self._apply(pending, mode, stager)
        finally:
            if stager is not None:
                stager.abort()  # whatever was not committed (a refused summary, a lost signer) leaves no trace
        not_applied = [{"path": f.path, "reason": f.apply_reason[:200]} for f, c in pending
                       if c is not None and not f.applied]
        rec.complete(s, "ok" if mode != "auto" or not not_applied else "error",
                     {"applied": sum(f.applied for f, _ in pending), "not_applied": not_applied[:1000],
                      "not_applied_count": len(not_applied)})
        return patch

    def _apply(self, pending: list[tuple], mode: str, stager: "_StageBehind | None") -> None:
        """Make the staged files visible in auto mode; say why not otherwise."""
        outcomes = {}
        why = {"never": "apply = never (bundle only)", "review": RERUN_KEEPS if self.rerun else
               "apply = review: `tkbox apply BUNDLE`"}.get(mode)
        if mode == "auto" and self.box.workspace is None:
            why = "no host workspace"
        elif stager is not None and stager.changes:
            try:
                outcomes = {id(c): o for c, o in zip(stager.changes, stager.commit())}
            except (ApplyError, OSError) as e:  # staging failed (nothing applied), or the workspace itself did
                why = str(e)
        for fd, change in pending:
            if change is not None:
                o = outcomes.get(id(change))
                fd.applied, fd.apply_reason = (o.applied, o.reason) if o else (False, why or "")
                if fd.applied:
                    self._written[change.path] = None if change.op == "delete" else \
                        sha256_file_digest(change.content or b"")
                    if change.op == "rename" and change.source and change.source != change.path:
                        self._written[change.source] = None


def _since(last_write: bool) -> str:
    """What a write's expected host digest is the host file as of, in its refusal's words."""
    return "this box last wrote it" if last_write else "the box started"


def _applied_over(change: FileChange, last_write: bool) -> dict:
    """An auto-applied file's signed result: what the write goes over on the host, the only digest the host file may
    have for it to go ahead (null: no file), and whether that is the workspace the box started with ("start") or what
    this box last wrote there ("last_write": a second %box_pull); a rename names its source's the same way."""
    over = {"applied_over": change.base, "applied_over_kind": "last_write" if last_write else "start"}
    if change.op == "rename":
        over["from_applied_over"] = change.source_base
    return over


class _StageBehind:
    """A patch's allowed files staged (workspace_writer.Staging.stage) on a thread of their own, while the door
    goes on signing; `commit` waits for it and makes them visible, `abort` removes whatever is still staged."""

    def __init__(self, workspace: Path | None, pending: list[tuple]):
        self.changes = [c for _, c in pending if c is not None] if workspace is not None else []
        self.error: BaseException | None = None
        self._staging: Staging | None = None
        self._thread = threading.Thread(target=self._stage, args=(str(workspace),), name="tkbox-patch-stage",
                                        daemon=True)
        if self.changes:
            self._thread.start()

    def _stage(self, workspace: str) -> None:
        try:
            try:
                self._staging = Staging(workspace, self.changes)
            except OSError as e:
                raise ApplyError(f"nothing applied: the workspace cannot be opened: {e.strerror or e}") from None
            self._staging.stage()
        except ApplyError as e:  # nothing staged is left
            self.error = e
        except Exception as e:  # anything else is reported the same way, as the file's not being applied
            self.error = ApplyError(f"nothing applied: {type(e).__name__} while staging: {str(e)[:200]}")

    def commit(self) -> list:
        self._thread.join()
        staging, self._staging = self._staging, None
        if self.error is not None:
            raise self.error
        return staging.commit()

    def abort(self) -> None:
        if self._thread.is_alive() or self._staging is not None:
            self._thread.join()
            if self._staging is not None:
                self._staging.abort()
                self._staging = None
