"""The agent's entry in a QEMU box: read the box's settings from the config disk, find the door port, serve it.

The init (busybox, in the initramfs) has mounted the read-only config disk the host made for this box at
/run/tkbox/config: env.json (the box's environment), seed/ (the workspace copy) and perhaps ca-bundle.pem. The door is
the virtio-serial port named "tkbox.door"; it is found by that name in /sys/class/virtio-ports, never by guessing a
/dev/vport path (opening a wrong one for writing would create a plain file on devtmpfs). Standard library only.
"""

import json
import os
import sys
import time

CONFIG = "/run/tkbox/config"
DOOR_NAME = "tkbox.door"


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
    fd = os.open(find_port(), os.O_RDWR | os.O_CLOEXEC)
    from .agent import CharDevice, main as agent_main
    return agent_main(CharDevice(fd))


if __name__ == "__main__":
    sys.exit(main())
