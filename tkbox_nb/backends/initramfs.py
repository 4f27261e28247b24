"""The guest's initramfs: busybox as PID 1, the virtio (and vsock) drivers, and the guest agent.

Part of a guest image (image.py), built apart from the root because it is what changes most: the agent's source
and the init script are in it, not in the root, so an agent change rebuilds this archive of a few hundred kilobytes
and keeps the cached root. Everything that goes into it (the init script, the module list, the agent's files) is
named in the image's digest (`image.inputs`), which is why they are module constants here. The archive is written
in Python (cpio "newc"), byte for byte the same for the same inputs, and nothing is mounted on the host.
"""

from __future__ import annotations

import gzip
import hashlib
import io
from pathlib import Path

from tkbox_nb.core.errors import TkboxError

MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console", "virtio_blk")  # load order matters
# loaded only when the kernel command line says the door is vsock (Firecracker): QEMU's door is virtio-serial
VSOCK_MODULES = ("vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport")
# loaded only for a box with dataset mounts: the read-only root becomes an overlay's lower layer so that the mounts'
# targets can be made, and the overlay is made read-only again before the box's code runs
MOUNT_MODULES = ("overlay",)
GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"
# the labels the init script finds the root and config disks by, and the name of the virtio-serial door
ROOT_LABEL, CONFIG_LABEL, DOOR_NAME = "tkbox-root", "tkbox-cfg", "tkbox.door"
# a dataset mount's disk: its label (never the root's or the config's), and the serial number QEMU gives the disk of
# mount I (tkbox-mI: for a person reading the guest's /sys; the init finds the disk by its UUID, as Firecracker's
# drives carry no serial the host sets)
MOUNT_LABEL, MOUNT_SERIAL = "tkbox-data", "tkbox-m"

# PID 1 of the guest (busybox sh in the initramfs): load the virtio drivers, mount the read-only root and the
# read-only config disk, give the box tmpfs for /workspace, /tmp and /run, copy the agent in, run it, power off.
# With `tkbox.mounts=N` (a cold boot only), each of the N dataset disks is mounted read-only (ro,nodev,nosuid,noexec)
# and its `data` (a directory or one file) bound at the target its config file names. Mount I's disk is the one whose
# file system has the UUID the config disk names in mounts/I.uuid (the host reads it from the image it made): the same
# for QEMU and Firecracker, whose drives carry no serial the host chooses.
INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() { echo "tkbox init: $*"; reboot -f; }
for m in %(modules)s; do insmod /modules/$m.ko || fail "insmod $m"; done
ws=64
door=serial
warm=0
mounts=0
for x in $(cat /proc/cmdline); do case "$x" in tkbox.ws=*) ws="${x#tkbox.ws=}";; tkbox.door=vsock:*) door=vsock;;
  tkbox.warm=1) warm=1;; tkbox.mounts=[1-5]) mounts="${x#tkbox.mounts=}";; esac; done
if [ $door = vsock ]; then for m in %(vsock_modules)s; do insmod /modules/$m.ko || fail "insmod $m"; done; fi
i=0
until root=$(findfs LABEL=%(root)s 2>/dev/null) && cfg=$(findfs LABEL=%(cfg)s 2>/dev/null); do
  i=$((i+1)); [ $i -gt 400 ] && fail "no root or config disk"; sleep 0.02
done
if [ $mounts = 0 ]; then
  mount -t ext4 -o ro,noload "$root" /newroot || fail "cannot mount the root"
else
  for m in %(mount_modules)s; do insmod /modules/$m.ko || fail "insmod $m"; done
  mkdir -p /lower /upper
  mount -t ext4 -o ro,noload "$root" /lower || fail "cannot mount the root"
  mount -t tmpfs -o mode=0755 tmpfs /upper
  mkdir /upper/u /upper/w
  mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w overlay /newroot || fail "no overlay root"
fi
mount -t tmpfs -o mode=0755 tmpfs /newroot/run
mkdir -p /newroot/run/tkbox/config
if [ $warm = 0 ]; then  # a warm start's agent mounts these after the host's GO (tkbox_guest/vm.py)
  mount -t ext4 -o ro,noload,nodev,nosuid "$cfg" /newroot/run/tkbox/config || fail "cannot mount the config disk"
  mount -t tmpfs -o "size=${ws}m,mode=1777" tmpfs /newroot/workspace
fi
if [ $mounts != 0 ]; then
  k=0
  while [ $k -lt $mounts ]; do  # mount K: its target and its disk's file system UUID, on the config disk
    t=$(cat "/newroot/run/tkbox/config/mounts/$k") || fail "no target for dataset mount $k"
    u=$(cat "/newroot/run/tkbox/config/mounts/$k.uuid") || fail "no disk named for dataset mount $k"
    i=0
    until dev=$(findfs "UUID=$u" 2>/dev/null); do
      i=$((i+1)); [ $i -gt 400 ] && fail "no dataset disk for mount $k"; sleep 0.02
    done
    d=/newroot/run/tkbox/mounts/$k
    mkdir -p $d
    mount -t ext4 -o ro,noload,nodev,nosuid,noexec "$dev" $d || fail "cannot mount the dataset disk of mount $k"
    if [ -d $d/data ]; then mkdir -p "/newroot$t"; else mkdir -p "$(dirname "/newroot$t")" && touch "/newroot$t"; fi
    mount --bind $d/data "/newroot$t" || fail "cannot mount the dataset disk of mount $k at its target"
    k=$((k+1))
  done
  mount -o remount,ro /newroot || fail "cannot make the root read-only again"
fi
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
mount -t tmpfs -o size=16m,mode=0755 tmpfs /newroot/opt/tkbox
cp -r /agent/tkbox_guest /newroot/opt/tkbox/
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
hostname tkbox
ip link set lo up || fail "cannot bring up lo"
cd /newroot
chroot /newroot /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 TKBOX_CFG_DEV="$cfg" \
  PYTHONPATH=/opt/tkbox PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m tkbox_guest.vm
echo "tkbox init: agent exited ($?)"
sync
reboot -f
""" % {"modules": " ".join(MODULES), "vsock_modules": " ".join(VSOCK_MODULES), "root": ROOT_LABEL, "cfg": CONFIG_LABEL,
       "mount_modules": " ".join(MOUNT_MODULES)}


def agent_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(GUEST_DIR.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """An initramfs archive (cpio "newc"): (name, mode, content) for files, dirs and symlinks, in order."""
    out = io.BytesIO()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08X}" for v in (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out.write(hdr.encode() + nb)
        out.write(b"\0" * (-(110 + len(nb)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))

    for i, (name, mode, data) in enumerate(entries, 1):
        put(name, mode, data, i)
    put("TRAILER!!!", 0, b"", 0)
    return out.getvalue()


def make_initramfs(modules_dir: Path, busybox: Path) -> bytes:
    """The gzipped initramfs of a kernel's modules directory and a static busybox, with the init and the agent."""
    d, f, x = 0o040755, 0o100644, 0o100755
    entries = [("bin", d, b""), ("modules", d, b""), ("agent", d, b""), ("agent/tkbox_guest", d, b""),
               ("init", x, INIT.encode()), ("bin/busybox", x, busybox.read_bytes()), ("bin/sh", 0o120777, b"busybox")]
    for m in MODULES + VSOCK_MODULES + MOUNT_MODULES:
        found = list(modules_dir.rglob(f"{m}.ko"))
        if len(found) != 1:
            raise TkboxError(f"image build: the kernel package has no single module {m}.ko")
        entries.append((f"modules/{m}.ko", f, found[0].read_bytes()))
    for src in sorted(GUEST_DIR.glob("*.py")):
        entries.append((f"agent/tkbox_guest/{src.name}", f, src.read_bytes()))
    return gzip.compress(cpio_newc(entries), 6, mtime=0)


def is_static(exe: Path) -> bool:
    """A static ELF has no PT_INTERP program header."""
    with open(exe, "rb") as f:
        head = f.read(1 << 16)
    return head[:4] == b"\x7fELF" and b"/ld-linux" not in head and b"ld-musl" not in head
