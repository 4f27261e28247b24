"""What a QEMU box's guest is given: the command line the backend builds names every device, and nothing else (I35);
a warm start's state reaches QEMU through a pipe that hashes it (I54). Pure: no VM is started here."""

from __future__ import annotations

import hashlib
import os

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
