"""What a patch entry may be, as pure functions: the path rules, the `.git` rule, globs, modes, text or binary.

These hold whatever the policy says (a path that could escape the workspace, or reach a repository's hooks or
config, is never applied), and `Policy.decide` calls them, so `tkbox verify` re-derives every patch decision.
"""

from __future__ import annotations

import fnmatch
import unicodedata

MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255
MAX_DEPTH = 32
# Denied whatever the allow list says (the policy's `deny` adds to these): CI that would run with the repository's
# credentials, and environment files that hold secrets. Matched case-insensitively.
DEFAULT_DENY = (".github/workflows/**", ".gitlab-ci.yml", "**/.env", "**/.env.*", ".envrc")
OPS = ("add", "modify", "delete", "rename")
# The rules a patch statement is decided under, stated by the door as the `rules` fact. A statement without it was
# made before this fact was and is re-derived under the rules of then (policy/patch.py), so its bundle verifies.
# 2: a rename's source is held to every rule its delete would be, and may not be its own target; an add or a rename
# may not land on a file the box started with.
RULES = 2


def path_problem(path: object) -> str | None:
    """Why `path` cannot name a file inside the workspace, or None. Relative, `/`-separated, no empty, `.` or
    `..` component, no backslash, no NUL or control character, valid UTF-8, bounded length and depth."""
    if not isinstance(path, str) or not path:
        return "an empty path"
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        return "a path that is not valid UTF-8"
    if len(raw) > MAX_PATH_BYTES:
        return f"a path over {MAX_PATH_BYTES} bytes"
    if any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 or c in "\u2028\u2029" for c in path):
        return "a control character in the path"
    if "\\" in path:
        return "a backslash in the path"
    if path.startswith("/"):
        return "an absolute path"
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        return f"a path nested deeper than {MAX_DEPTH}"
    for part in parts:
        if part in ("", ".", ".."):
            return f"a {part!r} component in the path" if part else "an empty component in the path"
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            return f"a name over {MAX_NAME_BYTES} bytes"
    return None


def is_git(path: str) -> bool:
    """A component that a filesystem or git could take for `.git`: any case, trailing dots or spaces (Windows
    strips them), the 8.3 short name `git~1`."""
    for part in path.split("/"):
        folded = part.casefold().rstrip(". ")
        if folded in (".git", "git~1"):
            return True
    return False


def fold(path: str) -> str:
    """The key under which two paths collide on some filesystem: Unicode NFC, then case folded."""
    return unicodedata.normalize("NFC", path).casefold()


def glob_match(pattern: str, path: str) -> bool:
    """A glob against a workspace path: `**/` matches any (or no) leading directories, `*` may cross `/`; a pattern
    without `/` matches the last component."""
    if "/" not in pattern:
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    if pattern.startswith("**/") and fnmatch.fnmatchcase(path, pattern[3:]):
        return True
    if pattern.endswith("/**") and path == pattern[:-3]:
        return True
    return fnmatch.fnmatchcase(path, pattern)


def clamp_mode(mode: int) -> int:
    """A new file's mode before the host's umask: 0755 if any execute bit was set, else 0644. Never setuid, setgid,
    sticky or world-write."""
    return 0o755 if mode & 0o111 else 0o644


def kept_mode(current: int, old: int | None, new: int) -> int:
    """The mode a modified (or renamed) file gets: the host file's `current` permission bits, with only the execute
    bits the box changed (from `old`, the mode it started with, to `new`) changed, and one set only where the host
    file is readable. Never setuid, setgid or sticky. Without `old` (a statement of tkbox 0.2.0), the execute bits
    follow whether the box's file is executable at all."""
    current &= 0o777
    if old is None:
        if bool(current & 0o111) == bool(new & 0o111):
            return current
        old = current if new & 0o111 else current | 0o111
        new = (current | 0o111) if new & 0o111 else current & ~0o111
    changed = (old ^ new) & 0o111
    return (current | changed & new & (current & 0o444) >> 2) & ~(changed & ~new) & 0o777


def planned_mode(op: str, mode: int, old: int | None) -> int:
    """The mode the patch's diff shows a file with once applied to the workspace the box started from."""
    if op == "delete" and old is not None:
        return old
    return clamp_mode(mode) if old is None or op == "add" else kept_mode(old, old, mode)


def is_binary(content: bytes) -> bool:
    return b"\x00" in content[:8192] or not _utf8(content)


def _utf8(content: bytes) -> bool:
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
