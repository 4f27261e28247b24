"""The agent's entry in a VM box: read the box's settings from the config disk, open the door, serve it.

The init (busybox, in the initramfs) has mounted the read-only config disk the host made for this box at
/run/tkbox/config: env.json (the box's environment), seed/ (the workspace copy) and perhaps ca-bundle.pem.
Under QEMU the door is the virtio-serial port named "tkbox.door"; it is found by that name in /sys/class/virtio-ports,
never by guessing a /dev/vport path (opening a wrong one for writing would create a plain file on devtmpfs). Under
Firecracker the kernel command line says `tkbox.door=vsock:PORT`: the agent connects to the host (CID 2) on that port,
and Firecracker hands the connection to the Unix socket the host listens on. Standard library only.
"""

import json
import os
import sys
import time

CONFIG = "/run/tkbox/config"
DOOR_NAME = "tkbox.door"
HOST_CID = 2


def vsock_port(cmdline):
    """The door's vsock port named on the kernel command line (`tkbox.door=vsock:PORT`), or None (virtio-serial)."""
    for word in cmdline.split():
        if word.startswith("tkbox.door=vsock:"):
            port = word[len("tkbox.door=vsock:"):]
            if port.isdigit() and 1 <= int(port) < 2 ** 32 - 1:
                return int(port)
            raise SystemExit("tkbox vm: bad door port on the kernel command line: %r" % word[:64])
    return None


def connect_vsock(port, wait_s=10.0):
    """The door as a vsock stream to the host; retried while the transport module settles."""
    import socket
    deadline = time.monotonic() + wait_s
    while True:
        s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        try:
            s.connect((HOST_CID, port))
            return s
        except OSError as e:
            s.close()
            if time.monotonic() > deadline:
                raise SystemExit("tkbox vm: cannot connect the vsock door (port %d): %s" % (port, e))
            time.sleep(0.05)


def find_port(name=DOOR_NAME, wait_s=10.0):
    deadline = time.monotonic() + wait_s
    while True:
        base = "/sys/class/virtio-ports"
        for port in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            try:
                with open(os.path.join(base, port, "name")) as f:
                    if f.read().strip() == name:
                        dev = os.path.join("/dev", port)
                        if os.path.exists(dev) and not os.path.isfile(dev):
                            return dev
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise SystemExit("tkbox vm: no virtio-serial port named %s" % name)
        time.sleep(0.02)


def main():
    with open(os.path.join(CONFIG, "env.json")) as f:
        env = json.load(f)
    os.environ.update({str(k): str(v) for k, v in env.items()})
    seed = os.path.join(CONFIG, "seed")
    if os.path.isdir(seed):
        os.environ["TKBOX_SEED"] = seed
    os.chdir("/workspace")
    from .agent import CharDevice, main as agent_main
    with open("/proc/cmdline") as f:
        port = vsock_port(f.read())
    if port is not None:
        return agent_main(connect_vsock(port))
    fd = os.open(find_port(), os.O_RDWR | os.O_CLOEXEC)
    return agent_main(CharDevice(fd))


if __name__ == "__main__":
    sys.exit(main())
