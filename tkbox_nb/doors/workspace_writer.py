"""Writing decided patch files into a host workspace without ever leaving it or leaving it half-written.

Every path is walked from a directory descriptor of the workspace root, one component at a time, with O_NOFOLLOW
and O_DIRECTORY: a symlink anywhere (made by the box or already on the host) stops the file, never followed. A file
is applied only if the host copy is still what the box started from (its `base` digest), so a change made on the
host meanwhile is never overwritten. Applying has two phases: every accepted file is first written beside its
target (a temporary name in the same directory; one syncfs flushes them all), then all are renamed into place; a
failure while staging (a full disk), or an apply called off between the phases (`Staging.abort`), removes every
staged file and every directory made for them, so the workspace is as it was.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass

from tkbox_nb.rules.patch_rules import clamp_mode, fold, kept_mode, path_problem

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class FileChange:
    """One allowed file: what to do at `path`, with the digest the host file must have now (None: absent)."""

    path: str
    op: str                    # add, modify, delete, rename
    content: bytes | None
    mode: int
    base: str | None
    source: str | None = None  # a rename's source path
    source_base: str | None = None
    old_mode: int | None = None  # the mode the box started with (of a rename's source): None if not stated
    base_from: str = "the box started"  # what `base` is the host file as of (said when the host file moved on)
    source_base_from: str = "the box started"  # the same of `source_base`


@dataclass
class Outcome:
    path: str
    applied: bool
    reason: str = ""


class ApplyError(Exception):
    """Staging failed (a full disk, a read-only workspace): nothing was changed."""


def sha256_file_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Refused(Exception):
    pass


class _Dirs:
    """Descriptors of workspace directories, each opened from its parent without following symlinks; a bounded
    cache, so ten thousand files in as many directories never hold ten thousand descriptors."""

    LIMIT = 256

    def __init__(self, root: str):
        self.root_fd = os.open(root, DIR_FLAGS)
        self.fds: dict[str, int] = {}
        self.made: list[str] = []  # directories this apply created, in creation order

    def get(self, dirpath: str, create: bool) -> int:
        if dirpath == "":
            return self.root_fd
        if dirpath in self.fds:
            return self.fds[dirpath]
        parent, _, part = dirpath.rpartition("/")
        pfd = self.get(parent, create)
        try:
            fd = os.open(part, DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            if not create:
                raise _Refused(f"{dirpath!r} does not exist on the host") from None
            os.mkdir(part, 0o755, dir_fd=pfd)
            self.made.append(dirpath)
            fd = os.open(part, DIR_FLAGS, dir_fd=pfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _Refused(f"{dirpath!r} on the host is a symlink or not a directory") from None
            raise
        if len(self.fds) >= self.LIMIT:
            self.drop()
        self.fds[dirpath] = fd
        return fd

    def drop(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        self.drop()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1


def _current(dir_fd: int, name: str) -> str | None:
    """The digest of the regular file `name` in `dir_fd` now, None if absent; a symlink or other kind refuses."""
    now = _look(dir_fd, name)
    return now[0] if now else None


def _look(dir_fd: int, name: str) -> tuple[str, int] | None:
    """The digest and permission bits of the regular file `name` in `dir_fd` now (as `_current`)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Refused("the host path is a symlink") from None
        if e.errno == errno.ENOTDIR:
            raise _Refused("a parent on the host is not a directory") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("the host path is not a regular file")
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest(), st.st_mode & 0o777


def host_umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def current_digest(root: str, path: str) -> str | None:
    """The digest of a workspace file now (None if absent or not reachable without a symlink)."""
    dirs = _Dirs(root)
    try:
        parent, _, name = path.rpartition("/")
        return _current(dirs.get(parent, False), name)
    except _Refused:
        return None
    finally:
        dirs.close()


def apply_changes(root: str, changes: list[FileChange]) -> list[Outcome]:
    """Apply `changes` (each already allowed) to the workspace at `root`; one Outcome per change. A change whose
    host file moved on, or whose path meets a symlink or a non-directory on the host, is refused alone. Raises
    ApplyError, with nothing changed, if staging fails."""
    staging = Staging(root, changes)
    staging.stage()
    return staging.commit()


class Staging:
    """One apply in its two phases, which a caller may hold apart: `stage()` writes every file beside its target
    (nothing visible changes yet), then `commit()` makes them visible, or `abort()` removes what was staged and the
    directories made for it. The patch door stages while the signer records the files' results and the patch's
    summary, and commits only once the summary is allowed; so `commit` checks each host file again, just before it
    replaces or removes it, against what staging saw: an edit made on the host meanwhile is never overwritten."""

    def __init__(self, root: str, changes: list[FileChange]):
        self.changes = changes
        self.dirs = _Dirs(root)
        # per change: (its index, [(directory, name, temporary name or None for an unlink, the digest seen then)]),
        # a rename's new file before its source's unlink, so a failure between the two loses nothing
        self.staged: list[tuple[int, list[tuple[str, str, str | None, str | None]]]] = []
        self.outcomes: dict[int, Outcome] = {}
        self.umask = host_umask()
        # every path a change writes (as a case-insensitive or normalising filesystem may take it): never unlinked,
        # so a rename whose source is its own target, or another change's, cannot delete what the patch writes
        self.written = {fold(ch.path) for ch in changes if ch.op != "delete" and isinstance(ch.path, str)}

    def stage(self) -> None:
        """Write every change beside its target. Raises ApplyError, with everything staged removed, on a failure
        that is not one file's own (a full disk, a read-only workspace)."""
        try:
            for i, ch in enumerate(self.changes):
                why = path_problem(ch.path) or (path_problem(ch.source) if ch.op == "rename" else None)
                if why:
                    self.outcomes[i] = Outcome(ch.path, False, why)
                    continue
                try:
                    entries = _stage(self.dirs, ch, self.umask, self.written)
                except _Refused as e:
                    self.outcomes[i] = Outcome(ch.path, False, str(e))
                    continue
                except OSError as e:
                    raise ApplyError(f"nothing applied: {e.strerror or e} while writing beside {ch.path!r}") from None
                self.staged.append((i, entries))
        except BaseException:  # ApplyError or anything else: nothing stays staged
            self.abort()
            raise

    def commit(self) -> list[Outcome]:
        """Every staged file on disk, then each change made visible in turn, if its host files are still what
        staging saw; one Outcome per change. A change that cannot be made visible is refused alone."""
        dirs = self.dirs
        refused: list = []  # changes refused now: their temporary files go with anything left, in abort()
        try:
            _syncfs(dirs.root_fd)  # every staged file on disk before any becomes visible (one flush, not one a file)
            while self.staged:
                i, entries = self.staged[0]
                try:
                    for dirpath, name, _tmp, seen in entries:
                        if _current(dirs.get(dirpath, False), name) != seen:
                            raise _Refused("the host file changed while the patch was being signed")
                    for dirpath, name, tmp, _seen in entries:
                        dfd = dirs.get(dirpath, False)
                        if tmp is None:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(name, dir_fd=dfd)
                        else:
                            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except (_Refused, OSError) as e:
                    why = str(e) if isinstance(e, _Refused) else f"{e.strerror or e} while replacing the host file"
                    self.outcomes[i] = Outcome(self.changes[i].path, False, why)
                    refused.append((i, entries))
                self.staged.pop(0)
            _syncfs(dirs.root_fd)
            for i, ch in enumerate(self.changes):
                self.outcomes.setdefault(i, Outcome(ch.path, True))
            return [self.outcomes[i] for i in range(len(self.changes))]
        finally:
            self.staged += refused
            self.abort()  # the temporary files of what was not made visible go; then the descriptors are closed

    def abort(self) -> None:
        """Remove every staged file and every directory made for them: the workspace is as it was."""
        if self.dirs.root_fd < 0:
            return
        try:
            _unstage(self.dirs, self.staged)
            self.staged = []
        finally:
            self.dirs.close()


def _stage(dirs: _Dirs, ch: FileChange, umask: int, written: set[str]) -> list:
    """The entries that apply `ch`: (directory, name, temporary name or None for an unlink, the digest now). A new
    file is 0644 or 0755 less the host's umask; a modified or renamed one keeps its host mode but for the execute
    bits the box changed (patch_rules.kept_mode)."""
    dirpath, _, name = ch.path.rpartition("/")
    if ch.op == "delete" and fold(ch.path) in written:
        raise _Refused("another change of the patch writes this path")
    if ch.op == "delete":  # already gone is done; anything but what the box started from is kept
        try:
            dfd = dirs.get(dirpath, False)
        except _Refused:
            return []
        now = _current(dfd, name)
        if now is not None and now != ch.base:
            raise _Refused(f"the host file changed since {ch.base_from}")
        return [] if now is None else [(dirpath, name, None, now)]
    new_digest = sha256_file_digest(ch.content or b"")
    after = []
    mode = clamp_mode(ch.mode) & ~umask
    if ch.op == "rename":  # the source goes (if it is still what the box started from), the target comes
        sdir, _, sname = ch.source.rpartition("/")
        try:
            source_now = _look(dirs.get(sdir, False), sname)
        except _Refused:
            source_now = None
        if source_now is not None and source_now[0] != ch.source_base:
            raise _Refused(f"the rename source {ch.source!r} changed on the host since {ch.source_base_from}")
        if source_now is not None:
            mode = kept_mode(source_now[1], ch.old_mode, ch.mode)
            if fold(ch.source) not in written:  # never unlink what the patch writes (its own target too)
                after.append((sdir, sname, None, source_now[0]))
    dfd = dirs.get(dirpath, True)
    looked = _look(dfd, name)
    now = looked[0] if looked else None
    if looked is not None and ch.op != "rename":
        mode = kept_mode(looked[1], ch.old_mode, ch.mode)
    if now == new_digest and (looked[1] == mode or now != ch.base):  # applied already (a mode the host set since
        return after                                                # is the host's; a box's mode change is applied)
    if now != ch.base:
        raise _Refused(f"the host file changed since {ch.base_from}" if now else
                       f"the host file is gone since {ch.base_from}")
    tmp = f".tkbox-{secrets.token_hex(12)}.tmp"  # fixed length: a 255-byte name (multibyte) still has a temporary
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(ch.content or b"")
            f.flush()
            os.fchmod(f.fileno(), mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    return [(dirpath, name, tmp, now)] + after


def _syncfs(fd: int) -> None:
    """Flush the workspace's filesystem: syncfs(2) where the C library has it, else sync(2)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.syncfs(fd) == 0:
            return
    except (OSError, AttributeError):
        pass
    os.sync()


def _unstage(dirs: _Dirs, staged: list) -> None:
    """Remove the temporary files of `staged` ((index, entries) pairs), then every directory made for them that is
    empty now (rmdir: one a change was applied into stays)."""
    for _i, entries in staged:
        for dirpath, _name, tmp, _seen in entries:
            if tmp is not None:
                with contextlib.suppress(OSError, _Refused):
                    os.unlink(tmp, dir_fd=dirs.get(dirpath, False))
    for dirpath in reversed(dirs.made):
        parent, _, part = dirpath.rpartition("/")
        with contextlib.suppress(OSError, _Refused):
            os.rmdir(part, dir_fd=dirs.get(parent, False))
