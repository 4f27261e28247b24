"""A kernel started ahead of its box: in a warm-start template (vm.py) this process imports ipykernel once, before
the snapshot, and then waits; a warm box's first kernel is this process, told its connection file, environment and
directory only after the box is its own (the host's GO has reseeded the guest's random generator).

Importing ipykernel is most of a kernel's start under emulation (seconds); restored from the snapshot it is already
done. What the interpreter fixed at its own start is the template's: the hash seed and the address-space layout are
the same in every warm box's first kernel (none of it is a secret from the box's own code, the only code in the box).
Python's `random` is reseeded here. A kernel whose environment asks for other interpreter settings (PYTHON* variables)
is started cold instead. Standard library only until the request; then ipykernel's own entry point runs.
"""

import json
import os
import subprocess
import sys

PREIMPORT = ("zmq", "jupyter_client.session", "IPython.core.interactiveshell", "ipykernel.ipkernel",
             "ipykernel.kernelapp")
READY = b"tkbox zygote: ready\n"
REQUEST_MAX = 1 << 20

_held = None  # (Popen, its start environment) in the agent of a warm box, until taken


def request(line):
    """(connection file, env, cwd) of a request line, or ValueError. Pure (fuzzed)."""
    req = json.loads(line)
    if not isinstance(req, dict):
        raise ValueError("a request is an object")
    conn, env, cwd = req.get("conn"), req.get("env"), req.get("cwd")
    if not (isinstance(conn, str) and conn.startswith("/") and "\0" not in conn):
        raise ValueError("conn must be an absolute path")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                          and "\0" not in k + v for k, v in env.items())):
        raise ValueError("env must map names to strings")
    if not (isinstance(cwd, str) and cwd.startswith("/") and "\0" not in cwd):
        raise ValueError("cwd must be an absolute path")
    return conn, env, cwd


def _interpreter_env(env):
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


def start(timeout_s=300.0):
    """In the template: start the zygote and wait until its imports are done (False when it cannot be had, as in an
    image without ipykernel; a box then starts its kernels cold)."""
    global _held
    import select
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "tkbox_guest.zygote"], env=env, cwd="/",
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if ready and proc.stdout.read(len(READY)) == READY:
        proc.stdout.close()
        _held = (proc, env)
        return True
    proc.kill()
    proc.wait()
    return False


def start_early():
    """In a box whose kernel is wanted from the start (TKBOX_KERNEL_EARLY): start the zygote now and do not wait for
    it, so that ipykernel imports while the host opens the kernel's stream; the first kernel is then this process."""
    global _held
    if _held is not None:
        return
    env = dict(os.environ)
    env.pop("TKBOX_DOOR_FD", None)
    proc = subprocess.Popen([sys.executable, "-m", "tkbox_guest.zygote"], env=env, cwd="/",
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _held = (proc, env)


def take(env, cwd, conn):
    """The held zygote, made this kernel (once), or None: none held, or `env` asks for other interpreter settings."""
    global _held
    if _held is None:
        return None
    proc, start_env = _held
    _held = None
    if proc.poll() is not None or _interpreter_env(env) != _interpreter_env(start_env):
        stop(proc)
        return None
    try:
        proc.stdin.write(json.dumps({"conn": conn, "env": env, "cwd": cwd}).encode() + b"\n")
        proc.stdin.close()
    except OSError:
        stop(proc)
        return None
    return proc


def stop(proc):
    proc.kill()
    proc.wait()


def main():
    # ipykernel imports debugpy as it makes its kernel (a fifth of a second of CPU, the larger part of the kernel's
    # own start): the Tracekit Box kernel offers no debugger (its kernelspec says so, and it forwards no
    # debug_request), so the kernel is made without it. Code in the box may still import debugpy afterwards.
    sys.modules.setdefault("debugpy", None)
    for name in PREIMPORT:
        __import__(name)
    if sys.path and sys.path[0] in ("", os.getcwd()):  # the template's directory: the box's goes there below
        del sys.path[0]
    os.write(1, READY)
    line = sys.stdin.buffer.readline(REQUEST_MAX)
    if not line.endswith(b"\n"):
        return 0  # the box stopped, or never asked
    conn, env, cwd = request(line)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, os.getcwd())  # as `python -m ipykernel_launcher` started in `cwd` has it
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    import random
    random.seed()
    import importlib.util
    sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, "-f", conn]  # as the launcher's own
    from ipykernel import kernelapp
    app = kernelapp.IPKernelApp.instance()  # kernelapp.launch_new_instance(), with debugpy importable once made
    app.initialize()
    if "debugpy" in sys.modules and sys.modules["debugpy"] is None:
        del sys.modules["debugpy"]
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
