"""The guest side of the patch door: what changed in /workspace since the box started, as data.

The host never mounts or reads a filesystem the box could write, so the box states its own changes: per path, the
operation (add, modify, delete, rename), the entry's type as the box sees it (a regular file, or a symlink, FIFO,
socket, device or hard link, which the host refuses), its mode and its content. The host trusts none of it: it
parses the stream strictly (tkbox_nb/rules/patch_reader.py), decides every entry and writes only what it allowed.

Wire format, on DATA channel 4 of a host-opened `{"kind": "patch"}` stream: for each entry, `length:u32be`, that
many bytes of a UTF-8 JSON header `{"path", "op", "type", "mode", "size", "from"?, "target"?}`, then exactly `size`
bytes of content (the file's bytes; nothing for a delete). The guest CLOSEs with `{"entries": N}`.
Standard library only (Python >= 3.9).
"""

import hashlib
import json
import os
import stat
import struct

HEADER = struct.Struct(">I")
CHUNK = 1 << 20


def _kind(st):
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "hardlink" if st.st_nlink > 1 else "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "other"


def _unreadable(e):
    raise e  # a folder the walk cannot list would read as all its files deleted: no patch at all instead


def _walk(root):
    """{relative path: lstat} of every non-directory entry under `root`, without following symlinks. A folder that
    cannot be listed raises OSError (the patch fails closed with it as the reason)."""
    out = {}
    if not root or not os.path.isdir(root):
        return out
    for top, dirs, files in os.walk(root, onerror=_unreadable):
        for name in dirs[:]:  # a symlink to a directory is an entry, not a directory to walk into
            full = os.path.join(top, name)
            if os.path.islink(full):
                dirs.remove(name)
                files.append(name)
        for name in files:
            full = os.path.join(top, name)
            try:
                out[os.path.relpath(full, root)] = os.lstat(full)
            except OSError:
                pass
    return out


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _same(seed, work, rel, a, b):
    if _kind(a) != _kind(b) or (a.st_mode & 0o7777) != (b.st_mode & 0o7777):
        return False
    if _kind(a) == "symlink":
        return os.readlink(os.path.join(seed, rel)) == os.readlink(os.path.join(work, rel))
    if _kind(a) not in ("file", "hardlink"):
        return True
    return a.st_size == b.st_size and _digest(os.path.join(seed, rel)) == _digest(os.path.join(work, rel))


def changes(seed, work):
    """The entries that differ between `seed` (the start) and `work` (now), in path order; a deleted file whose
    content reappears under a new path is one rename."""
    before, after = _walk(seed), _walk(work)
    out = []
    for rel in sorted(set(before) | set(after)):
        if rel not in after:
            out.append({"path": rel, "op": "delete", "type": _kind(before[rel]), "mode": before[rel].st_mode & 0o7777})
        elif rel not in before:
            out.append({"path": rel, "op": "add", "type": _kind(after[rel]), "mode": after[rel].st_mode & 0o7777})
        elif not _same(seed, work, rel, before[rel], after[rel]):
            out.append({"path": rel, "op": "modify", "type": _kind(after[rel]), "mode": after[rel].st_mode & 0o7777})
    deleted = {}
    for e in out:
        if e["op"] == "delete" and e["type"] == "file":
            deleted.setdefault(_digest(os.path.join(seed, e["path"])), e)
    for e in out:
        if e["op"] == "add" and e["type"] == "file" and deleted:
            src = deleted.pop(_digest(os.path.join(work, e["path"])), None)
            if src is not None:
                e["op"], e["from"] = "rename", src["path"]
                src["op"] = None
    return [e for e in out if e["op"]]


def encode(entry, content=b""):
    """One entry on the wire: its header, then its content."""
    header = dict(entry, size=len(content))
    body = json.dumps(header, separators=(",", ":")).encode("ascii")  # a name that is not UTF-8 stays escaped
    return HEADER.pack(len(body)) + body + content


def stream(seed, work):
    """Yield the wire bytes of every change; a file's content is read only as it is sent."""
    count = 0
    for e in changes(seed, work):
        full = os.path.join(work, e["path"])
        content = b""
        if e["op"] != "delete":
            if e["type"] == "symlink":
                e["target"] = os.readlink(full)
            elif e["type"] in ("file", "hardlink"):
                try:
                    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
                    with os.fdopen(fd, "rb") as f:
                        content = f.read()
                except OSError:
                    continue  # gone or changed under us: not part of this patch
        count += 1
        yield encode(e, content)
