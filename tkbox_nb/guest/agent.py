"""The guest agent: the one process in the box that speaks the door stream. Standard library only (Python >= 3.9).

It runs what the host asks, after the host's exec door has a signed allow: commands (argv, env, cwd, stdin; stdout
and stderr streamed back; the exit status at the end) and a real ipykernel whose Jupyter messages it carries
(kernel.py, imported only then). It trusts nothing but the door: it has no other channel, no network and no secrets.

Run as `python3 -m tkbox_guest.agent` with the door's file descriptor in $TKBOX_DOOR_FD (a socket), or from
vm.py in a VM, where the door is a virtio-serial port (a character device, read and written as a file).
"""

import os
import socket
import subprocess
import sys
import threading

from . import protocol as p

PORT_WRITE = 32 * 1024  # the most one write to a virtio-serial port takes (drivers/char/virtio_console.c)
SPLICE_MIN = 32 * 1024  # a smaller DATA frame for a forwarder is read as before: its copy costs less than 3 syscalls


class Door:
    """The connection to the host: framed sends under one lock, the guest's Session, window waits."""

    def __init__(self, sock):
        self.sock = sock
        self.session = p.Session(is_host=False)
        self.lock = threading.Condition()

    def send_raw(self, data):
        if data:
            self.sock.sendall(data)

    def send_data(self, sid, channel, data):
        view = memoryview(data)
        while len(view):
            with self.lock:
                while self.session.may_send(sid) == 0:
                    if sid not in self.session.streams:
                        return
                    self.lock.wait(1.0)
                n = min(len(view), self.session.may_send(sid), p.MAX_PAYLOAD - 1)
                self.session.sent(sid, n)
                self.send_parts((p.HEADER.pack(n + 1, p.DATA, sid), bytes((channel,)), view[:n]))
            view = view[n:]

    def send_parts(self, parts):
        """One frame from its parts, gathered by the kernel (an upload's bytes are not joined into a new frame)."""
        total = sum(len(part) for part in parts)
        sent = self.sock.sendmsg(parts)
        if sent < total:
            self.sock.sendall(b"".join(bytes(part) for part in parts)[sent:])

    def close(self, sid, body):
        with self.lock:
            self.send_raw(self.session.close(sid, body))


def command_request(req):
    """(argv, env, cwd) of a command stream's OPEN body, or ValueError. Pure (fuzzed)."""
    argv, env, cwd = req.get("argv"), req.get("env") or {}, req.get("cwd") or "/workspace"
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if not isinstance(env, dict):
        raise ValueError("env must be an object")
    if not isinstance(cwd, str):
        raise ValueError("cwd must be a string")
    return argv, {str(k): str(v) for k, v in env.items()}, cwd


class Command:
    def __init__(self, door, sid, req):
        self.door, self.sid = door, sid
        argv, env, cwd = command_request(req)
        full_env = dict(os.environ)
        full_env.pop("TKBOX_DOOR_FD", None)
        full_env.update(env)
        self.proc = subprocess.Popen(argv, cwd=cwd, env=full_env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, p.CH_STDOUT), daemon=True),
                        threading.Thread(target=self._pump, args=(self.proc.stderr, p.CH_STDERR), daemon=True)]
        for t in self.readers:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _pump(self, pipe, channel):
        while True:
            chunk = pipe.read1(65536)
            if not chunk:
                return
            self.door.send_data(self.sid, channel, chunk)

    def _wait(self):
        code = self.proc.wait()
        try:  # what the command left running (its process group: a fork bomb's children) ends with it
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        for t in self.readers:
            t.join()
        self.door.close(self.sid, {"exit_code": code})

    def stdin(self, data):
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def end_stdin(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def send_patch(door, sid):
    """The changes of /workspace since the box started (guest/patch.py), then CLOSE with their count."""
    from . import patch
    count = 0
    try:
        for chunk in patch.stream(os.environ.get("TKBOX_SEED"), "/workspace"):
            door.send_data(sid, p.CH_BYTES, chunk)
            count += 1
    except OSError as e:
        door.close(sid, {"error": str(e)[:300], "entries": count})
        return
    door.close(sid, {"entries": count})


def _private():
    """Make this process's /proc entries (its fds, memory, environment) closed to box code: not dumpable. The agent
    runs as the same user as the box's commands, which could otherwise open /proc/<agent>/fd/N: its pipes, and its
    stderr, which reaches the host. (Its children's exec makes them dumpable again.)"""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError, ImportError):
        pass


def _quiet():
    """From the hello on, the agent's stdout and stderr go nowhere: the host keeps its stderr (bubblewrap's, a VM's
    console) only as the tail shown when a box does not come up, and once the door is up nothing from the box may
    reach the host but through it. Every process started later inherits these."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for fd in (1, 2):
        try:
            os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)


def _package_site():
    """With the package door: the directory pip installs into (PIP_TARGET, in the box's writable /tmp) exists from
    the start and is on every box process's PYTHONPATH, so a package installed in a cell imports in the next one (a
    directory missing when an interpreter starts would never be looked in again)."""
    site = os.environ.get("TKBOX_PACKAGES_SITE")
    if not site:
        return
    try:
        os.makedirs(site, mode=0o755, exist_ok=True)
    except OSError:
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), site) if x)


def _wait_go():
    """A bubblewrap box's agent is spawned before its run's box.start is signed (the host walks the dataset mounts
    meanwhile): it waits here for the host's GO, one byte on TKBOX_GO_FD, before it copies the workspace or answers
    anything, so nothing but imports (its own, and an early kernel's zygote's) runs in the box before box.start.
    Anything else ends the agent."""
    fd = os.environ.pop("TKBOX_GO_FD", None)
    if fd is None:
        return
    try:
        got = os.read(int(fd), 1)
        os.close(int(fd))
    except (OSError, ValueError):
        got = b""
    if got != b"G":
        os._exit(3)


def serve(sock):
    _package_site()
    if os.environ.get("TKBOX_KERNEL_EARLY") == "1":  # first: the kernel's imports are the longest part of its start
        from . import zygote
        zygote.start_early()  # it imports ipykernel from /, and gets a kernel's folder and settings only after the GO
    _wait_go()
    door = Door(sock)
    commands, kernels, readers = {}, {}, {}
    # the box's own writable copy of the workspace, in its size-limited tmpfs (the seed stays as it was: what the
    # patch compares with): copied while the kernel above imports (its directory is given only when the host asks
    # for it, after the hello), and before the hello, so no command or kernel of the host's ever sees it half made
    seed = os.environ.get("TKBOX_SEED")
    if seed and os.path.isdir(seed):
        import shutil
        shutil.copytree(seed, "/workspace", symlinks=True, dirs_exist_ok=True)
    hello = door.session.open()
    door.send_raw(p.encode_json(p.OPEN, hello, {"kind": "hello", "pid": os.getpid(),
                                                "python": sys.version.split()[0]}))
    door.send_raw(door.session.close(hello))
    _quiet()
    forwarders = []  # the egress proxy, the model and package endpoints: each connection is a stream it opens
    from .forwarder import Forwarder
    for var, kind in (("TKBOX_EGRESS_PORT", "egress"), ("TKBOX_MODEL_PORT", "model"),
                      ("TKBOX_PACKAGES_PORT", "packages")):
        if os.environ.get(var):
            forwarders.append(Forwarder(door, int(os.environ[var]), kind))

    def owner(sid):
        return next((f for f in forwarders if f.owns(sid)), None)

    def handle(ftype, sid, payload):
        """One whole frame from the host."""
        with door.lock:
            event = door.session.receive(ftype, sid, payload)
            door.lock.notify_all()
        kind = event[0]
        forwarder = owner(sid) if forwarders and kind != "open" else None
        if kind == "window" and forwarder is not None:
            forwarder.wake()  # the stream may be read again
        elif kind == "open":
            req = event[2]
            try:
                if req.get("kind") == "command":
                    commands[sid] = Command(door, sid, req)
                elif req.get("kind") == "patch":
                    threading.Thread(target=send_patch, args=(door, sid), daemon=True).start()
                elif req.get("kind") == "kernel":
                    from .kernel import KernelBridge
                    kernels[sid] = KernelBridge(door, sid)
                    readers[sid] = p.MessageReader(parse=False)
                else:
                    door.close(sid, {"error": "unknown request"})
            except (OSError, ValueError) as e:
                door.close(sid, {"error": str(e)[:500], "exit_code": 127})
            except Exception as e:  # no ipykernel in this image; no thread or process left (a fork bomb)
                door.close(sid, {"error": "%s: %s" % (type(e).__name__, str(e)[:400]), "exit_code": 126})
        elif kind == "data":
            if forwarder is not None:  # credit goes back once delivered
                forwarder.data(sid, event[3])
                return
            with door.lock:
                door.send_raw(door.session.consumed(sid, len(event[3])))
            if sid in commands and event[2] == p.CH_STDIN:
                commands[sid].stdin(event[3])
            elif sid in kernels and event[2] == p.CH_MSG:
                for msg in readers[sid].feed(event[3]):
                    kernels[sid].from_host(msg)
        elif kind == "close":
            if forwarder is not None:
                forwarder.closed(sid)
            elif sid in commands:
                commands.pop(sid).end_stdin()
            elif sid in kernels:
                readers.pop(sid, None)
                kernels.pop(sid).stop()

    reader = p.FrameReader()  # one reused buffer: every consumer below copies or uses its bytes before the next read
    # Bulk bytes for a forwarder's client go from the door to the client by splice (forwarder.py), never through
    # this process's memory: reads then stop at each frame's first payload byte, so its header can be looked at
    # before its payload is read. Only on a socket door (bubblewrap) and where os.splice exists (Python >= 3.10).
    splicing = bool(forwarders) and isinstance(sock, socket.socket) and forwarders[0].can_splice()
    while True:
        room = reader.room()
        n = sock.recv_into(room[:reader.want()] if splicing else room)
        if not n:
            return 0
        for ftype, sid, payload in reader.filled(n):
            handle(ftype, sid, payload)
        head = reader.peek() if splicing else None
        if head and head[0] == p.DATA and head[2] > SPLICE_MIN:
            forwarder = owner(head[1])
            if forwarder is not None:
                _, sid, _, rest = reader.take()
                with door.lock:
                    door.session.receive_data(sid, rest)
                forwarder.splice_in(sid, sock.fileno(), rest)


class CharDevice:
    """A door on a character device (a VM's virtio-serial port): the two socket calls serve() uses, on an fd."""

    def __init__(self, fd):
        self.fd = fd

    def sendall(self, data):
        view = memoryview(data)
        while len(view):
            view = view[os.write(self.fd, view):]

    def sendmsg(self, parts):
        """A small frame joined and written at once. A virtio-serial port has no vectored write: the kernel writes
        each part of a writev on its own, and each write is a notify to the device (a VM exit, under TCG an exit from
        the translated code) and a separate write to the host's socket, where the door reader wakes for a 9-byte
        header. Joining a frame of a few hundred bytes costs less than one of those; a bulk frame is written in parts
        (the port takes at most PORT_WRITE bytes a write anyway)."""
        total = sum(len(part) for part in parts)
        if total <= PORT_WRITE:
            return os.write(self.fd, b"".join(parts))
        return os.writev(self.fd, parts)

    def recv_into(self, buffer):
        return os.readv(self.fd, [buffer])

    def close(self):
        os.close(self.fd)


def main(door=None):
    """Serve the door: a socket fd in $TKBOX_DOOR_FD (bubblewrap), or `door` given by the VM's entry (vm.py)."""
    if door is None:  # a namespace box, whose commands run as this process's user (in a VM they are root anyway)
        _private()
    if door is None:
        door = socket.socket(fileno=int(os.environ["TKBOX_DOOR_FD"]))
    try:
        return serve(door)
    except p.ProtocolError as e:
        sys.stderr.write("tkbox agent: protocol error from the host: %s\n" % e)
        return 3
    except (BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
