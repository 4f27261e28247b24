"""The guest agent: the one process in the box that speaks the door stream. Standard library only (Python >= 3.9).

It runs what the host asks, after the host's exec door has a signed allow: commands (argv, env, cwd, stdin; stdout
and stderr streamed back; the exit status at the end) and Python cells in one persistent namespace (outputs in the
Jupyter message model). It trusts nothing but the door: it has no other channel, no network and no secrets.

Run as `python3 -m tkbox_guest.agent` with the door's file descriptor in $TKBOX_DOOR_FD.
"""

import ast
import io
import json
import os
import socket
import subprocess
import sys
import threading
import traceback

from . import protocol as p


class Door:
    """The connection to the host: framed sends under one lock, the guest's Session, window waits."""

    def __init__(self, sock):
        self.sock = sock
        self.session = p.Session(is_host=False)
        self.lock = threading.Condition()
        self.decoder = p.Decoder()

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
                self.send_raw(p.encode(p.DATA, sid, bytes([channel]) + bytes(view[:n])))
            view = view[n:]

    def send_msg(self, sid, obj):
        self.send_data(sid, p.CH_MSG, json.dumps(obj).encode("utf-8"))

    def close(self, sid, body):
        with self.lock:
            self.send_raw(self.session.close(sid, body))


class Command:
    def __init__(self, door, sid, req):
        self.door, self.sid = door, sid
        argv = req.get("argv")
        env = req.get("env") or {}
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a non-empty list of strings")
        full_env = dict(os.environ)
        full_env.pop("TKBOX_DOOR_FD", None)
        full_env.update({str(k): str(v) for k, v in env.items()})
        self.proc = subprocess.Popen(argv, cwd=req.get("cwd") or "/workspace", env=full_env,
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


class _Stream(io.TextIOBase):
    """sys.stdout / sys.stderr while a cell runs: each write becomes a Jupyter stream message."""

    def __init__(self, cells, name):
        self.cells, self.name = cells, name

    def writable(self):
        return True

    def write(self, text):
        if text:
            self.cells.emit({"output_type": "stream", "name": self.name, "text": str(text)})
        return len(text)


class Cells:
    """Python cells, one at a time, in one namespace that persists for the life of the box."""

    def __init__(self, door):
        self.door = door
        self.count = 0
        self.namespace = {"__name__": "__main__", "display": self.display}
        self.lock = threading.Lock()
        self.sid = None

    def emit(self, msg):
        if self.sid is not None:
            self.door.send_msg(self.sid, msg)

    def bundle(self, obj):
        data = {"text/plain": repr(obj)}
        for method, mime in (("_repr_html_", "text/html"), ("_repr_markdown_", "text/markdown"),
                             ("_repr_json_", "application/json")):
            f = getattr(obj, method, None)
            if callable(f):
                try:
                    value = f()
                except Exception:
                    value = None
                if value is not None:
                    data[mime] = value
        return data

    def display(self, *objs):
        for obj in objs:
            self.emit({"output_type": "display_data", "data": self.bundle(obj), "metadata": {}})

    def run(self, sid, code):
        threading.Thread(target=self._run, args=(sid, code), daemon=True).start()

    def _run(self, sid, code):
        with self.lock:
            self.sid = sid
            self.count += 1
            status = "ok"
            old = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = _Stream(self, "stdout"), _Stream(self, "stderr")
            try:
                tree = ast.parse(code, "<cell>", "exec")
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = ast.Expression(tree.body.pop().value)
                exec(compile(tree, "<cell>", "exec"), self.namespace)
                if last is not None:
                    value = eval(compile(last, "<cell>", "eval"), self.namespace)
                    if value is not None:
                        self.namespace["_"] = value
                        self.emit({"output_type": "execute_result", "execution_count": self.count,
                                   "data": self.bundle(value), "metadata": {}})
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the cell failed, the box goes on
                status = "error"
                tb = traceback.format_exception(type(e), e, e.__traceback__)
                self.emit({"output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                           "traceback": [line.rstrip("\n") for line in tb]})
            finally:
                sys.stdout, sys.stderr = old
                self.sid = None
            self.door.close(sid, {"status": status, "execution_count": self.count})


def serve(sock):
    door = Door(sock)
    cells = Cells(door)
    commands = {}
    hello = door.session.open()
    door.send_raw(p.encode_json(p.OPEN, hello, {"kind": "hello", "pid": os.getpid(),
                                                "python": sys.version.split()[0]}))
    door.send_raw(door.session.close(hello))
    while True:
        data = sock.recv(65536)
        if not data:
            return 0
        for ftype, sid, payload in door.decoder.feed(data):
            with door.lock:
                event = door.session.receive(ftype, sid, payload)
                door.lock.notify_all()
            kind = event[0]
            if kind == "open":
                req = event[2]
                try:
                    if req.get("kind") == "command":
                        commands[sid] = Command(door, sid, req)
                    elif req.get("kind") == "cell" and isinstance(req.get("code"), str):
                        cells.run(sid, req["code"])
                    else:
                        door.close(sid, {"error": "unknown request"})
                except (OSError, ValueError) as e:
                    door.close(sid, {"error": str(e)[:500], "exit_code": 127})
            elif kind == "data":
                with door.lock:
                    door.send_raw(door.session.consumed(sid, len(event[3])))
                if sid in commands and event[2] == p.CH_STDIN:
                    commands[sid].stdin(event[3])
            elif kind == "close":
                if sid in commands:
                    commands.pop(sid).end_stdin()


def main():
    fd = int(os.environ["TKBOX_DOOR_FD"])
    seed = os.environ.get("TKBOX_SEED")
    if seed and os.path.isdir(seed):  # the box's own writable copy, in its size-limited tmpfs
        import shutil
        shutil.copytree(seed, "/workspace", symlinks=True, dirs_exist_ok=True)
    sock = socket.socket(fileno=fd)
    try:
        return serve(sock)
    except p.ProtocolError as e:
        sys.stderr.write("tkbox agent: protocol error from the host: %s\n" % e)
        return 3
    except (BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
