"""What a QEMU box's guest is given: the command line the backend builds names every device, and nothing else (I35);
a warm start's state reaches QEMU through a pipe that hashes it (I54). Pure: no VM is started here."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from tkbox_nb.backends.base import BoxSpec
from tkbox_nb.backends.image import Image
from tkbox_nb.backends.qemu import MACHINE, MAX_MOUNT_DISKS, QemuBackend
from tkbox_nb.backends.warm_start import StateFeed
from tkbox_nb.core.errors import TkboxError


def _argv(tmp_path, accel: str, warm: bool, disks: list[tuple[str, str]] = ()) -> list[str]:
    backend = QemuBackend(image=Image("0" * 32, tmp_path), accel=accel, warm=warm)
    return backend.argv(BoxSpec(box_id="b", seed=None, disks=list(disks)), tmp_path / "door.sock",
                        tmp_path / "config.img", 1, warm=warm)


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_the_guest_gets_exactly_the_devices_it_needs(tmp_path):
    for accel in ("tcg", "kvm"):
        for warm in (False, True):
            argv = _argv(tmp_path, accel, warm)
            machine = _values(argv, "-M")
            assert machine == [MACHINE] and MACHINE.startswith("microvm,")
            options = dict(o.split("=") for o in MACHINE.split(",")[1:])
            # off: what microvm would give otherwise and the guest has no use for
            assert {k: options.get(k) for k in ("pic", "ioapic2", "x-option-roms", "smm", "usb", "pcie")} == \
                {"pic": "off", "ioapic2": "off", "x-option-roms": "off", "smm": "off", "usb": "off", "pcie": "off"}
            # kept (docs/backends.md says why): the PIT, the RTC, the ISA serial port, ACPI's GED, fw_cfg
            assert not {"pit", "rtc", "isa-serial", "acpi"} & set(options)
            assert "-nodefaults" in argv and "-no-user-config" in argv
            assert _values(argv, "-device") == ["virtio-blk-device,drive=root", "virtio-blk-device,drive=cfg",
                                                "virtio-serial-device,max_ports=2",
                                                "virtserialport,chardev=door,name=tkbox.door"]
            drives = _values(argv, "-drive")
            assert len(drives) == 2 and all("readonly=on" in d and "if=none" in d for d in drives)
            assert _values(argv, "-chardev") == [f"socket,id=door,path={tmp_path / 'door.sock'}"]
            assert _values(argv, "-serial") == ["stdio"]
            for flag in ("-netdev", "-net", "-nic", "-usb", "-usbdevice", "-fsdev", "-virtfs", "-monitor", "-qmp",
                         "-parallel", "-global", "-set", "-readconfig"):
                assert flag not in argv, flag


def test_each_dataset_mount_is_one_more_read_only_virtio_disk_and_nothing_else(tmp_path):
    """A box with mounts gets, beside the devices above, one read-only virtio-blk disk per mount (each named by its
    serial, tkbox-mI, which the guest's init finds it by) and boots cold; more than microvm's slots allow is
    refused."""
    disks = [(str(tmp_path / "a.img"), "/data"), (str(tmp_path / "b.img"), "/labels.csv")]
    for accel in ("tcg", "kvm"):
        argv = _argv(tmp_path, accel, False, disks)
        assert _values(argv, "-device") == ["virtio-blk-device,drive=root", "virtio-blk-device,drive=cfg",
                                            "virtio-blk-device,drive=m0,serial=tkbox-m0",
                                            "virtio-blk-device,drive=m1,serial=tkbox-m1",
                                            "virtio-serial-device,max_ports=2",
                                            "virtserialport,chardev=door,name=tkbox.door"]
        drives = _values(argv, "-drive")
        assert drives[2:] == [f"id=m0,file={tmp_path / 'a.img'},format=raw,if=none,readonly=on",
                              f"id=m1,file={tmp_path / 'b.img'},format=raw,if=none,readonly=on"]
        assert all("readonly=on" in d and "if=none" in d for d in drives) and len(drives) == 4
        assert "tkbox.mounts=2" in _values(argv, "-append")[0]
        assert "tkbox.mounts" not in _values(_argv(tmp_path, accel, False), "-append")[0]
    backend = QemuBackend(image=Image("0" * 32, tmp_path), accel="tcg", warm=True)
    with pytest.raises(TkboxError, match=f"^\\[mounts\\]: a qemu box takes at most {MAX_MOUNT_DISKS} mounts"):
        backend.mount_disks([object()] * (MAX_MOUNT_DISKS + 1), tmp_path)  # refused before any disk is made
    assert backend.mount_disks([], tmp_path) == [] and backend.warm  # no mounts: a warm start as before
    for warm, n in ((True, 1), (False, MAX_MOUNT_DISKS + 1)):
        with pytest.raises(TkboxError, match=f"at most {MAX_MOUNT_DISKS} dataset mounts, and boots them cold"):
            _argv(tmp_path, "tcg", warm, disks[:1] * n)


def test_a_state_feed_hashes_exactly_the_bytes_qemu_reads(tmp_path):
    data = os.urandom(3 * StateFeed.CHUNK + 17)
    (tmp_path / "s.vmstate").write_bytes(data)
    feed = StateFeed(tmp_path / "s.vmstate")
    got = bytearray()
    while chunk := os.read(feed.fd, 1 << 16):
        got += chunk
    feed.close_read_end()
    assert feed.wait(10) and bytes(got) == data and feed.sha256 == hashlib.sha256(data).hexdigest()
    assert not feed.broken


def test_a_state_feed_whose_reader_goes_away_is_broken_and_unhashed(tmp_path):
    (tmp_path / "s.vmstate").write_bytes(b"x" * (4 * StateFeed.CHUNK))
    feed = StateFeed(tmp_path / "s.vmstate")
    os.read(feed.fd, 10)
    feed.close_read_end()  # QEMU refused the stream and ended
    assert feed.wait(10) and feed.broken and feed.sha256 is None


def test_the_config_disk_names_each_mount_s_target_and_its_disk_s_file_system_uuid(tmp_path):
    """How the guest's init (one for QEMU and Firecracker, whose drives carry no serial the host sets) tells the
    dataset disks apart: mounts/I holds mount I's target and mounts/I.uuid the UUID of its disk's ext4, which
    `findfs UUID=` finds. Each UUID is checked against what e2fsprogs' dumpe2fs reads from that disk."""
    import subprocess

    from tkbox_nb.backends.initramfs import INIT
    from tkbox_nb.backends.microvm import config_disk, mount_disk
    from tkbox_nb.backends.mounts import prepare
    from tkbox_nb.policy import Policy
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("x\n")
    (tmp_path / "b.csv").write_text("id\n")
    home = tmp_path / "home"
    home.mkdir()
    mounts = prepare(Policy.from_toml(f'[mounts.a]\nsource = "{tmp_path / "a"}"\ntarget = "/data"\n[mounts.b]\n'
                                      f'source = "{tmp_path / "b.csv"}"\ntarget = "/b.csv"\n', "p.toml"), home, "qemu")
    disks = [(str(mount_disk(m.source, m.digest, tmp_path / "disks")), m.target) for m in mounts]
    work = tmp_path / "w"
    work.mkdir()
    cfg = config_disk(BoxSpec(box_id="b", seed=None, disks=disks), work, 90)
    tools = "/usr/sbin:/sbin:/usr/bin:/bin"

    def read(path: str) -> str:
        r = subprocess.run([shutil.which("debugfs", path=tools), "-R", f"cat {path}", str(cfg)], capture_output=True,
                           text=True, check=True)
        return r.stdout

    for i, (disk, target) in enumerate(disks):
        dump = subprocess.run([shutil.which("dumpe2fs", path=tools), "-h", disk], capture_output=True, text=True,
                              check=True).stdout
        want = next(line.split()[-1] for line in dump.splitlines() if line.startswith("Filesystem UUID:"))
        assert (read(f"/mounts/{i}"), read(f"/mounts/{i}.uuid")) == (target, want)
    assert disks[0][0] != disks[1][0] and read("/mounts/0.uuid") != read("/mounts/1.uuid")
    assert 'findfs "UUID=$u"' in INIT and "/serial" not in INIT  # the init finds them so, and no other way


def _one_mount(tmp_path, size: int = 1 << 16):
    from tkbox_nb.backends.mounts import prepare
    from tkbox_nb.policy import Policy
    src = tmp_path / "ds"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.bin").write_bytes(os.urandom(size))
    home = tmp_path / "home"
    home.mkdir()
    return prepare(Policy.from_toml(f'[mounts.d]\nsource = "{src}"\ntarget = "/data"\n', "p.toml"), home, "qemu")[0]


def test_every_make_of_the_same_mount_gives_its_disk_the_same_uuid_and_never_replaces_a_published_one(tmp_path):
    """A dataset disk's file-system UUID is derived from the mount's signed digest (mke2fs -U), so a config disk
    that names it names every make of that data; and a make publishes its disk only where none is (a link, not a
    rename over it): the disk a box read the UUID of is the one its VMM opens (with mke2fs's random UUIDs and
    os.replace, two boxes starting with the same new data could each name the other's make)."""
    from tkbox_nb.backends.image import ext4_uuid
    from tkbox_nb.backends.microvm import mount_disk, mount_disk_uuid, publish_disk
    m = _one_mount(tmp_path)
    a = mount_disk(m.source, m.digest, tmp_path / "cache-a")
    b = mount_disk(m.source, m.digest, tmp_path / "cache-b")
    assert ext4_uuid(a) == ext4_uuid(b) == mount_disk_uuid(m.digest)
    assert mount_disk_uuid(m.digest) != mount_disk_uuid(m.digest[:-1] + ("0" if m.digest[-1] != "0" else "1"))
    first = os.stat(a)
    assert publish_disk(b, a) == a  # a second make that finishes later: the published disk stays
    assert (os.stat(a).st_ino, os.stat(a).st_dev) == (first.st_ino, first.st_dev)
    assert mount_disk(m.source, m.digest, tmp_path / "cache-a") == a and os.stat(a).st_ino == first.st_ino
    assert [p.name for p in (tmp_path / "cache-a").iterdir()] == [a.name]  # no scratch left behind


def test_boxes_making_the_same_new_mount_at_once_each_name_the_disk_at_its_path(tmp_path):
    """Four makes of the same new mount at once (threads: copy, digest and mke2fs overlap), each then making its
    config disk as a box would: every config names the UUID of the disk at the path once all are done, and every
    make returned the file that is there at the end."""
    import subprocess
    import threading

    from tkbox_nb.backends.image import ext4_uuid
    from tkbox_nb.backends.microvm import config_disk, mount_disk
    m = _one_mount(tmp_path, 1 << 20)
    cache, got, errors = tmp_path / "cache", {}, []

    def box(n: int) -> None:
        try:
            disk = mount_disk(m.source, m.digest, cache)
            ino = os.stat(disk).st_ino
            work = tmp_path / f"w{n}"
            work.mkdir()
            cfg = config_disk(BoxSpec(box_id=f"b{n}", seed=None, disks=[(str(disk), m.target)]), work, 90)
            named = subprocess.run([shutil.which("debugfs", path="/usr/sbin:/sbin:/usr/bin:/bin"), "-R",
                                    "cat /mounts/0.uuid", str(cfg)], capture_output=True, text=True, check=True)
            got[n] = (disk, ino, named.stdout)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=box, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 4
    (disk,) = {d for d, _, _ in got.values()}
    assert {ino for _, ino, _ in got.values()} == {os.stat(disk).st_ino}
    assert {named for _, _, named in got.values()} == {ext4_uuid(disk)}
