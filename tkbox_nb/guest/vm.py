"""The agent's entry in a VM box: read the box's settings from the config disk, open the door, serve it.

The init (busybox, in the initramfs) has mounted the read-only config disk the host made for this box at
/run/tkbox/config: env.json (the box's environment), seed/ (the workspace copy) and perhaps ca-bundle.pem.
Under QEMU the door is the virtio-serial port named "tkbox.door"; it is found by that name in /sys/class/virtio-ports,
never by guessing a /dev/vport path (opening a wrong one for writing would create a plain file on devtmpfs). Under
Firecracker the kernel command line says `tkbox.door=vsock:PORT`: the agent connects to the host (CID 2) on that port,
and Firecracker hands the connection to the Unix socket the host listens on. Standard library only.

A warm start (`tkbox.warm=1` on the kernel command line) is a VM restored from a snapshot of a template that booted
this image and stopped here, before anything of a box: the agent has opened the door, said WARM_READY and waits for
the host's GO message. The GO carries fresh entropy (the restored kernel's random state is the template's, the same
in every box until reseeded) and the wall-clock time; only then is the box's config disk read and its workspace
made. The init found the config disk by its label in the template, so the buffer cache of that device holds the
template's blocks: they are dropped (BLKFLSBUF) before the box's disk is mounted.
"""

import json
import os
import sys
import time

CONFIG = "/run/tkbox/config"
DOOR_NAME = "tkbox.door"
HOST_CID = 2
WARM_READY = b"tkbox warm: ready\n"
GO_MAGIC = b"TKBOXGO1"
GO_ENTROPY = 64
GO_SIZE = len(GO_MAGIC) + GO_ENTROPY + 8
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207      # _IO('R', 0x07)
BLKFLSBUF = 0x1261          # _IO(0x12, 97)
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4


def encode_go(entropy, realtime_ns):
    """The host's GO for a warm-started guest: magic, entropy, wall-clock time (ns since the epoch, big-endian)."""
    if len(entropy) != GO_ENTROPY or not 0 < realtime_ns < 2 ** 63:
        raise ValueError("bad GO fields")
    return GO_MAGIC + bytes(entropy) + realtime_ns.to_bytes(8, "big")


def parse_go(data):
    """(entropy, realtime_ns) of a GO message, or ValueError. Pure (fuzzed)."""
    if len(data) != GO_SIZE or data[:len(GO_MAGIC)] != GO_MAGIC:
        raise ValueError("not a GO message")
    ns = int.from_bytes(data[len(GO_MAGIC) + GO_ENTROPY:], "big")
    if not 10 ** 18 < ns < 2 ** 63:  # after 2001, and what clock_settime takes
        raise ValueError("GO time out of range")
    return bytes(data[len(GO_MAGIC):len(GO_MAGIC) + GO_ENTROPY]), ns


def warm_wait(fd):
    """Say WARM_READY on the door and wait for the host's GO (the snapshot is taken in this wait); then make this
    box's own: reseed the kernel's random generator, set the clock."""
    import fcntl
    import struct
    os.write(fd, WARM_READY)
    data = b""
    while len(data) < GO_SIZE:
        chunk = os.read(fd, GO_SIZE - len(data))
        if not chunk:
            raise SystemExit("tkbox vm: the door closed before the host's GO")
        data += chunk
    try:
        entropy, ns = parse_go(data)
    except ValueError as e:
        raise SystemExit("tkbox vm: %s" % e)
    with open("/dev/urandom", "wb") as f:
        fcntl.ioctl(f, RNDADDENTROPY, struct.pack("ii", GO_ENTROPY * 8, GO_ENTROPY) + entropy)
        fcntl.ioctl(f, RNDRESEEDCRNG)
    time.clock_settime_ns(time.CLOCK_REALTIME, ns)


def _mount(source, target, fstype, flags, data):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        raise SystemExit("tkbox vm: cannot mount %s on %s: %s" % (source, target,
                                                                  os.strerror(ctypes.get_errno())))


def mount_box(cfg_dev):
    """What the init does for a cold boot, done after the GO for a warm one: the box's config disk (its cached
    template blocks dropped first) and its workspace tmpfs, sized by the config's box.json."""
    import fcntl
    fd = os.open(cfg_dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BLKFLSBUF)
    finally:
        os.close(fd)
    os.makedirs(CONFIG, exist_ok=True)
    _mount(cfg_dev, CONFIG, "ext4", MS_RDONLY | MS_NOSUID | MS_NODEV, "noload")
    with open(os.path.join(CONFIG, "box.json")) as f:
        ws = json.load(f).get("workspace_mib")
    if not (isinstance(ws, int) and 1 <= ws <= 1 << 20):
        raise SystemExit("tkbox vm: bad workspace size in box.json")
    _mount("tmpfs", "/workspace", "tmpfs", 0, "size=%dm,mode=1777" % ws)


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
    cfg_dev = os.environ.pop("TKBOX_CFG_DEV", "")
    with open("/proc/cmdline") as f:
        cmdline = f.read()
    if "tkbox.warm=1" in cmdline.split():
        from . import agent, forwarder, protocol, zygote  # noqa: F401 -- imported in the template, before the snapshot
        if zygote.start():  # ipykernel imported ahead, in the zygote and (for the kernel bridge) here
            import zmq  # noqa: F401

            from . import jsession, kernel  # noqa: F401
        fd = os.open(find_port(), os.O_RDWR | os.O_CLOEXEC)
        warm_wait(fd)
        mount_box(cfg_dev)
        return serve_config(lambda: agent.CharDevice(fd))
    port = vsock_port(cmdline)
    if port is not None:
        return serve_config(lambda: connect_vsock(port))
    return serve_config(serial_door)


def serial_door():
    from .agent import CharDevice
    return CharDevice(os.open(find_port(), os.O_RDWR | os.O_CLOEXEC))


def serve_config(open_door):
    """Serve the door with this box's config (environment, workspace seed) in place."""
    with open(os.path.join(CONFIG, "env.json")) as f:
        env = json.load(f)
    os.environ.update({str(k): str(v) for k, v in env.items()})
    seed = os.path.join(CONFIG, "seed")
    if os.path.isdir(seed):
        os.environ["TKBOX_SEED"] = seed
    os.chdir("/workspace")
    from .agent import main as agent_main
    return agent_main(open_door())


if __name__ == "__main__":
    sys.exit(main())
