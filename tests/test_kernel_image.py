"""The vmlinux Firecracker boots, taken out of the image's bzImage (tkbox_nb/backends/linux_kernel.py): synthetic
bzImages in every compression the reader takes, one bad input per fault it must name, and the real Debian cloud
kernel (LZ4, legacy frame), extracted and cached beside its vmlinuz."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tarfile
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from fuzz.seeds import COMPRESSIONS, KERNEL_BASE, bzimage, elf_note, kernel_compress, tiny_vmlinux
from tkbox_nb.backends import linux_kernel as kernel_image
from tkbox_nb.backends.linux_kernel import ElfInfo, KernelImageError, elf_info, extract_vmlinux, vmlinux_for

MiB = 1 << 20


@pytest.mark.parametrize("kind", COMPRESSIONS)
def test_each_compression_gives_back_the_elf_exactly(kind):
    elf = tiny_vmlinux()
    assert extract_vmlinux(bzimage(kernel_compress(kind, elf))) == elf
    assert extract_vmlinux(bzimage(kernel_compress(kind, elf, trailer=False))) == elf  # the size trailer is optional
    info = elf_info(elf)
    assert info == ElfInfo(entry=info.entry, load_segments=1, mem_size=len(elf) + 0x1000, phys_start=KERNEL_BASE,
                           phys_end=KERNEL_BASE + len(elf) + 0x1000, pvh_note=True, pvh_entry=KERNEL_BASE + 0x40)


@pytest.mark.parametrize("kind", COMPRESSIONS)
def test_a_payload_of_many_blocks_comes_back_whole(kind):
    """Past one zstd block (128 KiB) and across several LZ4 legacy blocks, with setup_sects 0 (meaning 4)."""
    code = bytes(range(256)) * 1200 + os.urandom(40_000) + b"\0" * 200_000
    elf = tiny_vmlinux(code=code)
    assert extract_vmlinux(bzimage(kernel_compress(kind, elf, lz4_block=64 << 10), setup_sects=0)) == elf


def test_an_elf_without_a_pvh_note_is_reported_so():
    elf = tiny_vmlinux(notes=elf_note(b"GNU", 3, b"\x02" * 20) + elf_note(b"Xenx", 18, b"\0" * 4))
    info = elf_info(elf)
    assert not info.pvh_note and info.pvh_entry is None
    assert extract_vmlinux(bzimage(kernel_compress("gzip", elf))) == elf


def _with(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _gz(elf: bytes) -> bytes:
    return bzimage(kernel_compress("gzip", elf))


def _bomb(kind: str) -> bytes:
    return bzimage(kernel_compress(kind, tiny_vmlinux(code=b"\0" * (3 * MiB))))


def _zstd_header() -> bytes:
    import zstandard
    frame = kernel_compress("zstd", ELF)
    return frame[:zstandard.frame_header_size(frame)]


ELF = tiny_vmlinux()
BAD = {  # fault: (bzImage, max_out, what the message must say)
    "no magic": (lambda: bzimage(b"x" * 64, magic=b"HdrX"), None, r"no HdrS magic at 0x202"),
    "short file": (lambda: b"\0" * 0x200, None, r"shorter than the setup header"),
    "no boot flag": (lambda: _with(_gz(ELF), 0x1FE, "<H", 0), None, r"0xAA55 boot flag"),
    "protocol too old": (lambda: bzimage(b"x" * 64, version=0x0207), None, r"protocol 2\.07 .*older than 2\.08"),
    "setup past the end": (lambda: _with(_gz(ELF)[:3000], 0x1F1, "B", 200), None, r"setup_sects 200 .*past the end"),
    "payload out of bounds": (lambda: bzimage(kernel_compress("gzip", ELF), payload_length=1 << 20), None,
                              r"payload .*runs past the end of the \d+-byte file"),
    "payload offset out of bounds": (lambda: _with(bzimage(b"x" * 64), 0x248, "<I", 0xFFFFFFF0), None,
                                     r"payload .*runs past the end"),
    "empty payload": (lambda: bzimage(b"", payload_length=0), None, r"payload_length at 0x24c is 0"),
    "unknown compression": (lambda: bzimage(b"PK\x03\x04" + b"x" * 60), None,
                            r"unknown compression \(magic 504b03047878\)"),
    "bzip2": (lambda: bzimage(b"BZh91AY&SY" + b"x" * 60), None, r"bzip2-compressed, which this reader does not take"),
    **{f"truncated {k}": ((lambda k=k: bzimage(kernel_compress(k, ELF, trailer=False)[:-9])), None,
                          rf"{k} payload is truncated") for k in COMPRESSIONS},
    **{f"bomb over max_out ({k})": ((lambda k=k: _bomb(k)), 1 * MiB, rf"{k} payload decompresses past the limit of "
                                    rf"{MiB} bytes") for k in COMPRESSIONS},
    "size trailer wrong": (lambda: bzimage(kernel_compress("xz", ELF, trailer=False) + struct.pack("<I", 7)), None,
                           r"xz payload's size trailer says 7 bytes, the stream gave 296"),
    "trailing data": (lambda: bzimage(kernel_compress("zstd", ELF) + b"junk"), None, r"8 bytes after the end"),
    "lz4 block length": (lambda: bzimage(struct.pack("<II", 0x184C2102, 0) + b"x" * 16), None,
                         r"lz4 payload has a block length of 0"),
    "lz4 corrupt block": (lambda: bzimage(struct.pack("<II", 0x184C2102, 8) + b"\xff" * 8), None,
                          r"lz4 payload has a corrupt block at 8"),
    "zstd reserved block": (lambda: bzimage(_zstd_header() + b"\x07\x00\x00" + b"x" * 9), None,
                            r"zstd payload has a block of the reserved type"),
    "output not ELF": (lambda: bzimage(kernel_compress("lz4", b"MZ" + b"\0" * 100)), None,
                       r"not an ELF: magic 4d5a0000"),
    "ELF32": (lambda: _gz(_with(ELF, 4, "B", 1)), None, r"not an ELF64: EI_CLASS 1"),
    "big-endian": (lambda: _gz(_with(ELF, 5, "B", 2)), None, r"not a little-endian ELF"),
    "wrong machine": (lambda: _gz(tiny_vmlinux(machine=183)), None, r"wrong machine: e_machine 183 \(expected "
                                                                     r"EM_X86_64, 62\)"),
    "not ET_EXEC": (lambda: _gz(tiny_vmlinux(e_type=3)), None, r"not an executable: e_type 3"),
    "program headers past the end": (lambda: _gz(_with(ELF, 56, "<H", 9)), None,
                                     r"program headers \(offset 64, 9 of 56 bytes\) are outside"),
    "no PT_LOAD": (lambda: _gz(_with(ELF, 64, "<I", 6)), None, r"no PT_LOAD segment"),
    "PT_LOAD past the end": (lambda: _gz(tiny_vmlinux(load_filesz=4000)), None,
                             r"program header 0: PT_LOAD segment at offset 0 of 4000 bytes runs past the end of the "
                             r"296-byte file"),
    "PT_LOAD filesz over memsz": (lambda: _gz(_with(ELF, 64 + 40, "<Q", 1)), None, r"p_filesz 296 is more than "
                                                                                    r"p_memsz 1"),
    "note header past the segment end": (lambda: _gz(tiny_vmlinux(notes=elf_note(b"Xen", 18, b"\0" * 4) + b"\0" * 8)),
                                         None, r"note header at 20 runs past the segment end \(28\)"),
    "note past the segment end": (lambda: _gz(tiny_vmlinux(note_filesz=30)), None,
                                  r"note at 0 \(name 4, descriptor 20 bytes\) runs past the segment end \(30\)"),
    "note descriptor past the segment end": (lambda: _gz(tiny_vmlinux(notes=elf_note(b"Xen", 18, b"\0" * 4)[:16])),
                                             None, r"note at 0 \(name 4, descriptor 4 bytes\) runs past"),
    "unaligned note segment": (lambda: _gz(tiny_vmlinux(notes=elf_note(b"Xen", 18, b"\0" * 4)[:-1])), None,
                               r"runs past the segment end \(19\)"),
    "two PVH notes": (lambda: _gz(tiny_vmlinux(notes=elf_note(b"Xen", 18, b"\0" * 4) * 2)), None,
                      r"two PVH entry notes"),
    "PVH descriptor size": (lambda: _gz(tiny_vmlinux(notes=elf_note(b"Xen", 18, b"\0" * 2))), None,
                            r"PVH entry note descriptor of 2 bytes"),
    "PVH entry past 4 GiB": (lambda: _gz(tiny_vmlinux(notes=elf_note(b"Xen", 18, struct.pack("<Q", 1 << 33)))),
                             None, r"PVH entry 0x200000000 is past 4 GiB"),
}


@pytest.mark.parametrize("fault", sorted(BAD))
def test_a_bad_kernel_is_refused_naming_the_fault(fault):
    make, max_out, message = BAD[fault]
    with pytest.raises(KernelImageError, match=message) as e:
        extract_vmlinux(make(), **({"max_out": max_out} if max_out else {}))
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kind", COMPRESSIONS)
def test_a_bomb_is_refused_without_being_inflated_past_the_bound(kind):
    """64 MiB of zeros (kilobytes compressed), read with a 4 MiB bound: refused, and the memory the extraction
    took is the bound and the decoder's own state (an 8 MiB xz dictionary; an 8 MiB LZ4 block and its copy), not
    what the payload would give."""
    elf = tiny_vmlinux(code=b"\0" * (64 * MiB))
    bomb = bzimage(kernel_compress(kind, elf))
    assert len(bomb) < 3 * MiB
    del elf
    tracemalloc.start()
    try:
        with pytest.raises(KernelImageError, match="decompresses past the limit"):
            extract_vmlinux(bomb, max_out=4 * MiB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB + 16 * MiB, peak


def test_the_bound_counts_the_whole_vmlinux():
    elf = tiny_vmlinux()
    for kind in COMPRESSIONS:
        assert extract_vmlinux(bzimage(kernel_compress(kind, elf)), max_out=len(elf)) == elf
        with pytest.raises(KernelImageError, match="past the limit"):
            extract_vmlinux(bzimage(kernel_compress(kind, elf)), max_out=len(elf) - 1)


# -- the cache ------------------------------------------------------------------------------------------------------
def test_vmlinux_for_makes_it_once_even_with_callers_racing(tmp_path, monkeypatch):
    (tmp_path / "vmlinuz").write_bytes(bzimage(kernel_compress("lz4", tiny_vmlinux())))
    calls = []
    real = kernel_image.extract_vmlinux

    def slow_extract(data, max_out=kernel_image.MAX_OUT):
        calls.append(1)
        time.sleep(0.2)  # long enough for the other callers to find no vmlinux and wait on the lock
        return real(data, max_out)

    monkeypatch.setattr(kernel_image, "extract_vmlinux", slow_extract)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(vmlinux_for(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [tmp_path / "vmlinux"] * 4 and len(calls) == 1
    assert (tmp_path / "vmlinux").read_bytes() == tiny_vmlinux()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".vmlinux-")]  # no temporary file left


def test_a_cached_vmlinux_that_does_not_parse_is_made_again(tmp_path):
    (tmp_path / "vmlinuz").write_bytes(bzimage(kernel_compress("gzip", tiny_vmlinux())))
    for broken in (b"", b"\x7fELF" + b"\0" * 100, tiny_vmlinux()[:200]):
        (tmp_path / "vmlinux").write_bytes(broken)
        assert vmlinux_for(tmp_path).read_bytes() == tiny_vmlinux()


def test_vmlinux_for_names_the_file_it_could_not_read(tmp_path):
    with pytest.raises(KernelImageError, match="no kernel at .*vmlinuz"):
        vmlinux_for(tmp_path)
    (tmp_path / "vmlinuz").write_bytes(b"MZ" + b"\0" * 1000)
    with pytest.raises(KernelImageError, match=r"vmlinuz: not a bzImage: no HdrS magic"):
        vmlinux_for(tmp_path)
    assert not (tmp_path / "vmlinux").exists()


# -- the real Debian kernel -----------------------------------------------------------------------------------------
# The QEMU tests (tests/e2e/test_qemu_box.py, which run before this file in a full session) build their image with
# these packages into this cache; on a fresh CI machine that image is the only Debian kernel there is.
QEMU_TEST_PACKAGES = ["python3", "python3-ipykernel"]
IMAGE_HOME = Path(os.environ.get("TKBOX_TEST_IMAGE_HOME", "/var/tmp/tkbox-test-images"))


def _kernel_from_deb(deb: Path, out: Path) -> Path | None:
    """boot/vmlinuz-* from a linux-image .deb (streamed out of dpkg-deb's tar, nothing else unpacked)."""
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                if m.isfile() and m.name.lstrip("./").startswith("boot/vmlinuz-"):
                    out.write_bytes(tar.extractfile(m).read())
                    return out
    finally:
        proc.stdout.close()
        proc.kill()
        proc.wait()
    return None


@pytest.fixture(scope="module")
def real_vmlinuz(tmp_path_factory) -> Path:
    from tkbox_nb.backends.image import find_image
    image = find_image(QEMU_TEST_PACKAGES, home=IMAGE_HOME)
    if image is not None and image.kernel.is_file():
        return image.kernel
    built = sorted((IMAGE_HOME / "images").glob("*/vmlinuz"))
    if built:
        return built[-1]
    if shutil.which("dpkg-deb"):
        for deb in sorted(Path("/var/cache/apt/archives").glob("linux-image-*-cloud-amd64_*.deb")):
            found = _kernel_from_deb(deb, tmp_path_factory.mktemp("deb") / "vmlinuz")
            if found:
                return found
    pytest.skip(f"no Debian kernel here: no image in {IMAGE_HOME} (the QEMU tests build one) and no "
                f"linux-image-*-cloud-amd64 package in apt's cache")


def test_the_real_debian_kernel(real_vmlinuz, tmp_path):
    bz = real_vmlinuz.read_bytes()
    t0 = time.perf_counter()
    vmlinux = extract_vmlinux(bz)
    seconds = time.perf_counter() - t0
    info = elf_info(vmlinux)
    print(f"{real_vmlinuz}: {len(bz)} bytes -> vmlinux of {len(vmlinux)} bytes in {seconds:.2f} s; {info}")
    assert vmlinux[:4] == b"\x7fELF" and vmlinux[4] == 2 and struct.unpack_from("<H", vmlinux, 18)[0] == 62
    assert info.pvh_note and info.phys_start <= info.pvh_entry < info.phys_end
    assert info.phys_start <= info.entry < info.phys_end and info.entry >= MiB  # startup_64, above the first MiB
    assert info.load_segments >= 2 and 2 * len(bz) < len(vmlinux) < 256 * MiB
    assert seconds < 30

    image_dir = tmp_path / "image"
    image_dir.mkdir()
    shutil.copyfile(real_vmlinuz, image_dir / "vmlinuz")
    made = vmlinux_for(image_dir)
    assert made == image_dir / "vmlinux" and made.read_bytes() == vmlinux
    before = made.stat()
    time.sleep(0.05)
    again = vmlinux_for(image_dir)
    after = again.stat()
    assert again == made and (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
