#!/usr/bin/env python3
"""A stand-in for the `firecracker` binary, for the tests of the Firecracker backend on machines where Firecracker
cannot run (no KVM that boots stock kernels, no binary). It is a test fixture for a program outside this project, as
the model upstreams are: it checks what the backend sends against Firecracker's documented API, and plays the part of
Firecracker and its guest toward the host.

- `--version` prints a version line as Firecracker does ($FC_STANDIN_VERSION, default "Firecracker v1.10.1").
- `--api-sock PATH --id ID` serves the API on PATH (HTTP/1.1 on a Unix socket). Each request is checked against the
  API's documented schema (required fields, types, enums, minimums; an unknown field is refused, as Firecracker's own
  parser does): 204 when it holds, 400 and a `fault_message` when not. Every request is appended to $FC_STANDIN_LOG
  (JSON lines) so a test can see exactly what was sent.
- `InstanceStart` boots the "guest": it checks the kernel is an ELF that Firecracker could boot (x86-64 vmlinux) and
  the initrd and drives exist, reads the config drive as the guest's init would (with `debugfs`, never mounting it),
  connects to `<uds_path>_<PORT>` for the port named by `tkbox.door=vsock:PORT` in the boot args (what Firecracker
  does when the guest connects to the host's CID), and runs the real guest agent in a bubblewrap box behind that
  connection, copying bytes both ways as Firecracker's vsock device does. It exits when the guest does.
- Dataset mounts (`tkbox.mounts=N` in the boot args): it plays the guest's init. Mount K's drive is the one whose
  ext4 UUID the config drive names in mounts/K.uuid; its `data` is extracted with `debugfs -R rdump` (never mounted
  on this host) and bound read-only (bubblewrap's --ro-bind) at the target mounts/K names. A drive that is not
  read-only is refused when it is configured (Firecracker would take it; this guest could not keep it unchanged).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

S, INT, B, OBJ = "string", "integer", "boolean", "object"
# From Firecracker's swagger definitions (MachineConfiguration, BootSource, Drive, Vsock, InstanceActionInfo)
SCHEMAS = {
    "/machine-config": {"required": {"vcpu_count", "mem_size_mib"},
                        "props": {"vcpu_count": (INT, 1, 32), "mem_size_mib": (INT, 1, None), "smt": (B,),
                                  "track_dirty_pages": (B,), "cpu_template": (S,),
                                  "huge_pages": (S, ("None", "Transparent", "2M"))}},
    "/boot-source": {"required": {"kernel_image_path"},
                     "props": {"kernel_image_path": (S,), "boot_args": (S,), "initrd_path": (S,)}},
    "/drives/": {"required": {"drive_id", "is_root_device"},
                 "props": {"drive_id": (S,), "is_root_device": (B,), "is_read_only": (B,), "path_on_host": (S,),
                           "partuuid": (S,), "cache_type": (S, ("Unsafe", "Writeback")),
                           "io_engine": (S, ("Sync", "Async")), "rate_limiter": (OBJ,), "socket": (S,)}},
    "/vsock": {"required": {"guest_cid", "uds_path"},
               "props": {"guest_cid": (INT, 3, None), "uds_path": (S,), "vsock_id": (S,)}},
    "/actions": {"required": {"action_type"},
                 "props": {"action_type": (S, ("FlushMetrics", "InstanceStart", "SendCtrlAltDel"))}},
    "/network-interfaces/": {"required": {"iface_id", "host_dev_name"},
                             "props": {"iface_id": (S,), "host_dev_name": (S,), "guest_mac": (S,),
                                       "mtu": (INT, 68, 65535), "rx_rate_limiter": (OBJ,), "tx_rate_limiter": (OBJ,)}},
}
TYPES = {S: str, INT: int, B: bool, OBJ: dict}


def check(path: str, body) -> str | None:
    """Why `body` is not a valid request to `path`, or None."""
    key = path if path in SCHEMAS else next((k for k in SCHEMAS if k.endswith("/") and path.startswith(k)), None)
    if key is None:
        return f"Invalid request method and/or path: PUT {path}"
    schema = SCHEMAS[key]
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    for name in schema["required"] - set(body):
        return f"missing field `{name}`"
    for name, value in body.items():
        spec = schema["props"].get(name)
        if spec is None:
            return f"unknown field `{name}`"
        kind = spec[0]
        if isinstance(value, bool) != (kind == B) or not isinstance(value, TYPES[kind]):
            return f"invalid type for `{name}`: expected {kind}"
        if kind == S and len(spec) > 1 and value not in spec[1]:
            return f"unknown variant `{value}` for `{name}`"
        if kind == INT and len(spec) > 1 and (value < spec[1] or spec[2] is not None and value > spec[2]):
            return f"`{name}` out of range"
    if key == "/drives/":
        if body["drive_id"] != path.split("/")[-1]:
            return "The id from the path does not match the id from the body!"
        # virtio-block needs `path_on_host` and `is_read_only`; vhost-user-block needs `socket` and omits both (and
        # `io_engine` and `rate_limiter`), as the Drive definition's field descriptions say
        virtio = {"is_read_only", "path_on_host", "io_engine", "rate_limiter"}
        if "socket" in body and virtio & set(body):
            return f"`{sorted(virtio & set(body))[0]}` should be omitted for vhost-user-block configuration"
        for name in ("path_on_host", "is_read_only"):
            if "socket" not in body and name not in body:
                return f"`{name}` is required for virtio-block configuration"
    return None


class Vmm:
    """What the API has configured, and the guest once started."""

    def __init__(self, log: str | None):
        self.config: dict = {"drives": {}}
        self.started = False
        self.log = log
        self.done = threading.Event()

    def record(self, method: str, path: str, body) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"method": method, "path": path, "body": body}) + "\n")

    def put(self, path: str, body) -> str | None:
        if os.environ.get("FC_STANDIN_REFUSE") == path:
            return "refused by the test"
        why = check(path, body)
        if why:
            return why
        if self.started and path != "/actions":
            return "The requested operation is not supported after starting the microVM."
        if path == "/machine-config":
            self.config["machine"] = body
        elif path == "/boot-source":
            self.config["boot"] = body
        elif path.startswith("/drives/"):
            if body.get("is_read_only") is not True:  # Firecracker takes it; this guest cannot keep it unchanged
                return f"the stand-in gives its guest read-only drives only, and {body['drive_id']} is not read-only"
            self.config["drives"][body["drive_id"]] = body
        elif path == "/vsock":
            self.config["vsock"] = body
        elif path.startswith("/network-interfaces/"):
            self.config.setdefault("nics", []).append(body)
        elif body["action_type"] == "InstanceStart":
            if self.started:
                return "The microVM is already running."
            why = self.boot()
            if why:
                return why
            self.started = True
        return None

    def boot(self) -> str | None:
        from tkbox_nb.backends.linux_kernel import KernelImageError, elf_info
        boot = self.config.get("boot")
        if boot is None:
            return "Cannot start microvm without kernel configuration."
        try:
            elf_info(Path(boot["kernel_image_path"]).read_bytes())
        except (OSError, KernelImageError) as e:
            return f"Cannot load kernel due to invalid memory configuration or invalid kernel image: {e}"
        for p in [boot.get("initrd_path")] + [d.get("path_on_host") for d in self.config["drives"].values()]:
            if p and not os.path.isfile(p):
                return f"No such file: {p}"
        m = re.search(r"\btkbox\.door=vsock:(\d+)\b", boot.get("boot_args", ""))
        if not m or "vsock" not in self.config:
            return None  # a guest without a door: it boots and is never heard from
        cfg = self.config["drives"].get("cfg")
        n = re.search(r"\btkbox\.mounts=([1-5])\b", boot.get("boot_args", ""))
        threading.Thread(target=self.guest, args=(int(m.group(1)), cfg["path_on_host"] if cfg else None,
                                                  int(n.group(1)) if n else 0), daemon=True).start()
        return None

    def mounts(self, cfg: Path, count: int, tmp: Path) -> list[tuple[str, str]]:
        """What the guest's init does with `tkbox.mounts=N`, played without mounting anything on this host: mount K's
        target (the config disk's mounts/K) and its disk, the drive whose ext4 file system has the UUID mounts/K.uuid
        names (what `findfs UUID=` finds), whose `data` is extracted with debugfs into a folder the bubblewrap box
        binds read-only at the target."""
        from tkbox_nb.backends.image import ext4_uuid
        drives = {ext4_uuid(Path(d["path_on_host"])): d["path_on_host"] for i, d in self.config["drives"].items()
                  if i not in ("root", "cfg")}
        out = []
        for k in range(count):
            target = (cfg / "mounts" / str(k)).read_text()
            disk = drives[(cfg / "mounts" / f"{k}.uuid").read_text()]  # KeyError: no such disk, the guest fails
            where = tmp / f"m{k}"
            where.mkdir()
            subprocess.run([debugfs(), "-R", f"rdump /data {where}", disk], capture_output=True, check=True)
            out.append((str(where / "data"), target))
        return out

    def guest(self, port: int, config_drive: str | None, mounts: int = 0) -> None:
        """The guest's agent, in a bubblewrap box, its door the host's `<uds_path>_<port>` listener."""
        from tkbox_nb.backends.base import BoxSpec
        from tkbox_nb.backends.bwrap import BwrapBackend
        tmp = Path(tempfile.mkdtemp(prefix="fc-standin-"))
        try:
            env, seed, ca = {}, None, None
            if config_drive:
                out = tmp / "cfg"
                out.mkdir()
                subprocess.run([debugfs(), "-R", f"rdump / {out}", config_drive], capture_output=True, check=True)
                env = json.loads((out / "env.json").read_text())
                seed = out / "seed" if (out / "seed").is_dir() else None
                ca = (out / "ca-bundle.pem").read_bytes() if (out / "ca-bundle.pem").exists() else None
            for k in ("PATH", "HOME", "LANG", "USER"):
                env.pop(k, None)
            # (the guest's memory is not a per-process address-space limit, so bubblewrap's defaults stand)
            binds = self.mounts(tmp / "cfg", mounts, tmp) if mounts else []
            box = BwrapBackend().start(BoxSpec(box_id=env.get("TKBOX_BOX_ID", "standin"), seed=seed, env=env,
                                               ca_bundle=ca, mounts=binds))
            box.go()  # a VM's run opened before it booted: its guest waits for no GO (BwrapRunning.go)
            host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            host.connect(f"{self.config['vsock']['uds_path']}_{port}")
            pumps = [threading.Thread(target=pump, args=(a, b), daemon=True)
                     for a, b in ((box.door, host), (host, box.door))]
            for t in pumps:
                t.start()
            pumps[0].join()  # the guest side closed: the guest is gone, the VM powers off
            box.kill()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            self.done.set()


def debugfs() -> str:
    return shutil.which("debugfs", path="/usr/sbin:/sbin:/usr/bin:/bin") or "debugfs"


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for s in (dst, src):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def serve(api_sock: str, vmm: Vmm) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, status: int, body: dict | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            if data:
                self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            vmm.record("PUT", self.path, body)
            why = vmm.put(self.path, body)
            self.reply(204) if why is None else self.reply(400, {"fault_message": why})

        def do_GET(self):
            vmm.record("GET", self.path, None)
            if self.path == "/":
                self.reply(200, {"app_name": "Firecracker", "id": "standin", "vmm_version": "1.10.1",
                                 "state": "Running" if vmm.started else "Not started"})
            else:
                self.reply(400, {"fault_message": f"Invalid request method and/or path: GET {self.path}"})

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    server = Server(api_sock, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    vmm.done.wait()
    server.shutdown()


def main(argv: list[str]) -> int:
    if "--version" in argv:
        print(os.environ.get("FC_STANDIN_VERSION", "Firecracker v1.10.1"))
        return 0
    api_sock = argv[argv.index("--api-sock") + 1]
    if os.path.exists(api_sock):
        print(f"Failed to open the API socket at {api_sock}: address in use", file=sys.stderr)
        return 1
    serve(api_sock, Vmm(os.environ.get("FC_STANDIN_LOG")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
