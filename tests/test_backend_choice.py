"""Choosing a backend and naming a guest image: the isolation minimum, the image digest's inputs, bad input."""

from __future__ import annotations

import pytest

from tkbox_nb import Policy
from tkbox_nb.backends import image, initramfs
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.backends.registry import choose_backend, get_backend
from tkbox_nb.core.errors import PolicyError, TkboxError

from conftest import run_cli


def test_isolation_minimum_is_namespace_or_vm():
    assert Policy.from_toml('[box]\nisolation = "vm"\n').get("box", "isolation") == "vm"
    assert Policy.default().get("box", "isolation") == "namespace"
    with pytest.raises(PolicyError, match="box.isolation must be one of namespace, vm"):
        Policy.from_toml('[box]\nisolation = "container"\n')


def test_a_vm_minimum_never_falls_back_to_a_namespace_box():
    with pytest.raises(TkboxError, match="below the policy's box.isolation"):
        get_backend("bwrap", "vm")
    picked, why = choose_backend("vm")
    assert picked is None or picked.name == "qemu"  # a VM (where an image is built, QEMU under TCG), never bwrap
    if picked is None:  # nothing meets the minimum: the reasons say bwrap was not taken for being below it
        assert any(line.startswith("bwrap: namespace isolation is below") for line in why)


@pytest.mark.skipif(not BwrapBackend().available()[0], reason="bubblewrap cannot run here")
def test_auto_prefers_bwrap_over_an_emulated_vm_when_a_namespace_is_enough():
    picked, why = choose_backend("namespace")
    if picked.name == "qemu":  # only where KVM boots stock kernels
        assert picked.isolation == "vm-kvm"
    else:
        assert picked.name == "bwrap" and any("qemu (TCG)" in line for line in why)


def test_image_digest_names_every_input(tmp_path, monkeypatch):
    _, base = image.inputs(["python3"])
    digests = {image.digest_of(base)}
    assert image.inputs(["python3", "python3"])[1] == base  # order and repeats do not matter
    digests.add(image.digest_of(image.inputs(["python3", "python3-numpy"])[1]))
    digests.add(image.digest_of(image.inputs(["python3"], kernel="linux-image-rt-amd64")[1]))
    guest = tmp_path / "guest"
    guest.mkdir()
    for src in initramfs.GUEST_DIR.glob("*.py"):
        (guest / src.name).write_bytes(src.read_bytes())
    (guest / "agent.py").write_bytes((guest / "agent.py").read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(initramfs, "GUEST_DIR", guest)
    changed_agent = image.inputs(["python3"])
    digests.add(image.digest_of(changed_agent[1]))
    assert len(digests) == 4
    assert changed_agent[0] == image.inputs(["python3"])[0]  # an agent change keeps the cached root


def test_bad_package_name_is_a_one_line_error(tmp_path):
    r = run_cli("image", "build", "--packages", "python3;rm -rf /", env={"TKBOX_HOME": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a Debian package name" in r.stderr
    assert not (tmp_path / "images").exists()


def test_initramfs_archive_is_newc_with_aligned_entries():
    data = initramfs.cpio_newc([("init", 0o100755, b"#!/bin/sh\n"), ("bin", 0o040755, b"")])
    assert data.startswith(b"070701") and len(data) % 4 == 0
    names = []
    offset = 0
    while True:
        fields = [int(data[offset + 6 + 8 * i: offset + 14 + 8 * i], 16) for i in range(13)]
        size, namesize = fields[6], fields[11]
        name = data[offset + 110: offset + 110 + namesize - 1].decode()
        names.append(name)
        offset += 110 + namesize
        offset += -offset % 4
        offset += size + (-size % 4)
        if name == "TRAILER!!!":
            break
    assert names == ["init", "bin", "TRAILER!!!"] and offset == len(data)


def test_prune_keeps_the_current_image_and_the_root_it_links(tmp_path):
    base = tmp_path / "images"
    (base / "roots").mkdir(parents=True)
    for root in ("r1", "r2"):
        (base / "roots" / f"{root}.img").write_bytes(b"x" * 4096)
        (base / "roots" / f"{root}.json").write_text("{}")
    for digest, root in (("a" * 32, "r1"), ("b" * 32, "r2")):
        (base / digest).mkdir()
        (base / digest / "manifest.json").write_text("{}")
        import os
        os.link(base / "roots" / f"{root}.img", base / digest / "root.img")
    (base / "current").write_text("a" * 32 + "\n")
    removed, freed = image.prune(tmp_path)
    assert removed == 1 and freed >= 4096
    assert sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) == ["a" * 32, "current", "roots"]
    assert sorted(p.name for p in (base / "roots").iterdir()) == ["r1.img", "r1.json"]


@pytest.mark.skipif(not BwrapBackend().available()[0], reason="bubblewrap cannot run here")
def test_doctor_says_what_auto_picks_and_why(tmp_path):
    policy = tmp_path / "vm.toml"
    policy.write_text('[box]\nisolation = "vm"\n')
    r = run_cli("doctor", "--policy", str(policy), env={"TKBOX_HOME": str(tmp_path / "home")})
    auto = [line for line in r.stdout.splitlines() if line.startswith("auto")]
    assert len(auto) == 1 and "for box.isolation = 'vm'" in auto[0]
    assert "picks bwrap" not in auto[0]
    assert "bwrap: namespace isolation is below the policy's minimum" in r.stdout
    r = run_cli("doctor", env={"TKBOX_HOME": str(tmp_path / "home")})
    assert "picks" in r.stdout and "qemu (TCG)" in r.stdout
