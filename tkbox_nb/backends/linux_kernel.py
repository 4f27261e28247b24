"""The guest kernel as Firecracker boots it: the uncompressed ELF `vmlinux` inside the image's bzImage `vmlinuz`.

On x86_64 Firecracker loads only an ELF vmlinux (through its PVH entry when the ELF carries Xen's PHYS32_ENTRY
note), while a guest image holds the bzImage that Debian ships and QEMU boots. This module takes the ELF out of the
bzImage: it reads the x86 boot setup header, finds the compressed payload, decompresses it (gzip, xz, lzma, LZ4 in
its legacy frame format, as Debian's cloud kernel is, or zstd) and checks that what comes out is an x86-64
executable ELF, all within bounds. The kernel file comes from a Debian package, but it is a file on disk that
something else could have replaced, so nothing in it is trusted: every offset and length is checked against the
data, output is bounded (a decompression bomb is refused before it is inflated past the bound), and anything wrong
is one KernelImageError naming what is wrong.

`extract_vmlinux` and `elf_info` are pure (bytes in, results out) so that they can be fuzzed (fuzz/targets.py);
`vmlinux_for` is the one function with I/O: it makes an image's vmlinux once and caches it beside the vmlinuz.
"""

from __future__ import annotations

import contextlib
import fcntl
import lzma
import mmap
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tkbox_nb.core.errors import TkboxError

MAX_OUT = 512 << 20  # no kernel is near this; a payload inflating past it is refused
CHUNK = 1 << 20  # the most output asked of a streaming decompressor at a time
LZMA_MEMLIMIT = 256 << 20  # an xz/lzma dictionary needing more is refused (kernels use 32 or 64 MiB)

# x86 boot protocol (Documentation/arch/x86/boot.rst): offsets in the real-mode setup header
SETUP_SECTS, BOOT_FLAG, HDRS_MAGIC, VERSION, PAYLOAD_OFFSET, PAYLOAD_LENGTH = 0x1F1, 0x1FE, 0x202, 0x206, 0x248, 0x24C
HEADER_END = 0x250  # the setup header up to payload_length, all a 2.08 header must have
MIN_VERSION = 0x0208  # the first protocol with payload_offset/payload_length

LZ4_LEGACY_MAGIC = 0x184C2102
LZ4_BLOCK_OUT = 8 << 20  # each legacy block decompresses to at most 8 MiB
LZ4_BLOCK_MAX = LZ4_BLOCK_OUT + LZ4_BLOCK_OUT // 255 + 16  # LZ4_compressBound(8 MiB): no valid block is longer
ZSTD_BLOCK_MAX = 128 << 10  # a zstd block's compressed or regenerated size is never more
ZSTD_WINDOW_MAX = 1 << 27  # zstd's own default limit for a decoder (the kernel builds with level 22, window 2^27)

ELF_HEADER, PHDR = struct.Struct("<16sHHIQQQIHHHHHH"), struct.Struct("<IIQQQQQQ")
ET_EXEC, EM_X86_64, PT_LOAD, PT_NOTE = 2, 62, 1, 4
XEN_ELFNOTE_PHYS32_ENTRY = 18


class KernelImageError(TkboxError, ValueError):
    """A kernel file that is not what it must be; the message names the fault in one line."""


@dataclass(frozen=True)
class ElfInfo:
    """What Firecracker needs to know of a vmlinux, from its ELF header and program headers."""

    entry: int  # e_entry (on x86 vmlinux a physical address: startup_64)
    load_segments: int  # PT_LOAD program headers
    mem_size: int  # the PT_LOAD segments' p_memsz summed
    phys_start: int  # lowest p_paddr of a PT_LOAD segment
    phys_end: int  # highest p_paddr + p_memsz
    pvh_note: bool  # a Xen PHYS32_ENTRY note: Firecracker boots it through the PVH entry
    pvh_entry: int | None  # the address that note names


def _u16(data, at: int) -> int:
    return int.from_bytes(data[at:at + 2], "little")


def _u32(data, at: int) -> int:
    return int.from_bytes(data[at:at + 4], "little")


# -- the ELF --------------------------------------------------------------------------------------------------------
def elf_info(vmlinux: bytes) -> ElfInfo:
    """Check that `vmlinux` is an x86-64 executable ELF whose program headers and segments lie within it, with at
    least one PT_LOAD, and report what it loads and whether it has a PVH entry note. KernelImageError otherwise."""
    n = len(vmlinux)
    if n < ELF_HEADER.size:
        raise KernelImageError(f"not an ELF: {n} bytes, shorter than an ELF64 header")
    (ident, e_type, e_machine, e_version, e_entry, e_phoff, _shoff, _flags, e_ehsize, e_phentsize, e_phnum,
     *_rest) = ELF_HEADER.unpack_from(vmlinux, 0)
    if ident[:4] != b"\x7fELF":
        raise KernelImageError(f"not an ELF: magic {ident[:4].hex()}, expected 7f454c46")
    if ident[4] != 2:
        raise KernelImageError(f"not an ELF64: EI_CLASS {ident[4]} (expected 2)")
    if ident[5] != 1:
        raise KernelImageError(f"not a little-endian ELF: EI_DATA {ident[5]} (expected 1)")
    if ident[6] != 1 or e_version != 1:
        raise KernelImageError(f"unknown ELF version {ident[6]}/{e_version} (expected 1)")
    if e_machine != EM_X86_64:
        raise KernelImageError(f"ELF for the wrong machine: e_machine {e_machine} (expected EM_X86_64, 62)")
    if e_type != ET_EXEC:
        raise KernelImageError(f"ELF is not an executable: e_type {e_type} (expected ET_EXEC, 2)")
    if e_ehsize != ELF_HEADER.size or e_phentsize != PHDR.size:
        raise KernelImageError(f"ELF header or program header size {e_ehsize}/{e_phentsize} (expected 64/56)")
    if e_phnum == 0 or e_phnum == 0xFFFF:  # 0xFFFF (PN_XNUM) moves the count to a section header: no kernel does
        raise KernelImageError(f"ELF has {e_phnum} program headers")
    if e_phoff < ELF_HEADER.size or e_phoff + e_phnum * PHDR.size > n:
        raise KernelImageError(f"ELF program headers (offset {e_phoff}, {e_phnum} of 56 bytes) are outside the "
                               f"{n}-byte file")
    loads, mem, lo, hi, pvh = 0, 0, None, 0, None
    for i in range(e_phnum):
        p_type, _pflags, off, vaddr, paddr, filesz, memsz, _align = PHDR.unpack_from(vmlinux, e_phoff + i * PHDR.size)
        if off + filesz > n:
            kind = "PT_LOAD segment" if p_type == PT_LOAD else f"segment (type {p_type:#x})"
            raise KernelImageError(f"ELF program header {i}: {kind} at offset {off} of {filesz} bytes runs past the "
                                   f"end of the {n}-byte file")
        if p_type == PT_LOAD:
            if filesz > memsz:
                raise KernelImageError(f"ELF program header {i}: PT_LOAD p_filesz {filesz} is more than p_memsz "
                                       f"{memsz}")
            if paddr + memsz > 1 << 64 or vaddr + memsz > 1 << 64:
                raise KernelImageError(f"ELF program header {i}: PT_LOAD at {paddr:#x} of {memsz} bytes wraps "
                                       f"around the address space")
            loads, mem = loads + 1, mem + memsz
            lo, hi = paddr if lo is None else min(lo, paddr), max(hi, paddr + memsz)
        elif p_type == PT_NOTE:
            found = _pvh_note(vmlinux[off:off + filesz], i)
            if found is not None:
                if pvh is not None:
                    raise KernelImageError("ELF has two PVH entry notes")
                pvh = found
    if not loads:
        raise KernelImageError("ELF has no PT_LOAD segment")
    return ElfInfo(entry=e_entry, load_segments=loads, mem_size=mem, phys_start=lo, phys_end=hi,
                   pvh_note=pvh is not None, pvh_entry=pvh)


def _align4(x: int) -> int:
    return (x + 3) & ~3


def _pvh_note(seg: bytes, index: int) -> int | None:
    """The PHYS32_ENTRY address in this PT_NOTE segment's notes, if one has it. Each note is a 12-byte header
    (namesz, descsz, type), the owner's name and the descriptor, each padded to 4 bytes, all within the segment."""
    n, pos, entry = len(seg), 0, None
    while pos < n:
        if pos + 12 > n:
            raise KernelImageError(f"ELF program header {index}: note header at {pos} runs past the segment end ({n})")
        namesz, descsz, ntype = struct.unpack_from("<III", seg, pos)
        desc = _align4(pos + 12 + namesz)
        end = _align4(desc + descsz)
        if end > n:
            raise KernelImageError(f"ELF program header {index}: note at {pos} (name {namesz}, descriptor {descsz} "
                                   f"bytes) runs past the segment end ({n})")
        name = seg[pos + 12:pos + 12 + namesz]
        if namesz and name[-1] != 0:
            raise KernelImageError(f"ELF program header {index}: note at {pos} has an owner name not ending in NUL")
        if name == b"Xen\0" and ntype == XEN_ELFNOTE_PHYS32_ENTRY:
            if descsz not in (4, 8):
                raise KernelImageError(f"ELF PVH entry note descriptor of {descsz} bytes (expected 4 or 8)")
            value = int.from_bytes(seg[desc:desc + descsz], "little")
            if value >> 32:
                raise KernelImageError(f"ELF PVH entry {value:#x} is past 4 GiB (a 32-bit entry)")
            if entry is not None:
                raise KernelImageError("ELF has two PVH entry notes")
            entry = value
        pos = end
    return entry


# -- the bzImage ----------------------------------------------------------------------------------------------------
def _payload(bzimage: bytes) -> bytes:
    """The compressed kernel in a bzImage, located by the boot setup header (protocol 2.08 or later)."""
    n = len(bzimage)
    if n < HEADER_END:
        raise KernelImageError(f"not a bzImage: {n} bytes, shorter than the setup header ({HEADER_END})")
    if bzimage[HDRS_MAGIC:HDRS_MAGIC + 4] != b"HdrS":
        raise KernelImageError("not a bzImage: no HdrS magic at 0x202")
    if _u16(bzimage, BOOT_FLAG) != 0xAA55:
        raise KernelImageError("not a bzImage: no 0xAA55 boot flag at 0x1fe")
    version = _u16(bzimage, VERSION)
    if version < MIN_VERSION:
        raise KernelImageError(f"boot protocol {version >> 8}.{version & 0xFF:02d} at 0x206 is older than 2.08 (no "
                               f"payload_offset)")
    setup_sects = bzimage[SETUP_SECTS] or 4
    pm = (setup_sects + 1) * 512
    if pm >= n:
        raise KernelImageError(f"setup_sects {setup_sects} puts the protected-mode code at {pm:#x}, past the end of "
                               f"the {n}-byte file")
    offset, length = _u32(bzimage, PAYLOAD_OFFSET), _u32(bzimage, PAYLOAD_LENGTH)
    start = pm + offset
    if length == 0:
        raise KernelImageError("bzImage payload_length at 0x24c is 0")
    if start + length > n:
        raise KernelImageError(f"bzImage payload (offset {offset:#x} from {pm:#x}, {length} bytes) runs past the end "
                               f"of the {n}-byte file")
    return bzimage[start:start + length]


def _bomb(kind: str, max_out: int) -> KernelImageError:
    return KernelImageError(f"{kind} payload decompresses past the limit of {max_out} bytes")


def _check_trailer(kind: str, rest: bytes, out_len: int) -> None:
    """What may follow the stream: nothing, or the u32 LE uncompressed size the kernel build appends."""
    if not rest:
        return
    if len(rest) != 4:
        raise KernelImageError(f"{kind} payload has {len(rest)} bytes after the end of the stream")
    said = _u32(rest, 0)
    if said != out_len & 0xFFFFFFFF:
        raise KernelImageError(f"{kind} payload's size trailer says {said} bytes, the stream gave {out_len}")


def _gunzip(data: bytes, max_out: int) -> bytearray:
    d, out, buf = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS), bytearray(), data
    try:
        while True:
            chunk = d.decompress(buf, min(CHUNK, max_out + 1 - len(out)))
            out += chunk
            if len(out) > max_out:
                raise _bomb("gzip", max_out)
            if d.eof:
                break
            buf = d.unconsumed_tail
            if not buf and not chunk:
                raise KernelImageError("gzip payload is truncated: the stream does not end")
    except zlib.error as e:
        raise KernelImageError(f"gzip payload is corrupt: {e}") from None
    _check_trailer("gzip", d.unused_data, len(out))
    return out


def _unlzma(kind: str, fmt: int, data: bytes, max_out: int) -> bytearray:
    d, out, buf = lzma.LZMADecompressor(fmt, memlimit=LZMA_MEMLIMIT), bytearray(), data
    try:
        while not d.eof:
            chunk = d.decompress(buf, min(CHUNK, max_out + 1 - len(out)))
            buf = b""
            out += chunk
            if len(out) > max_out:
                raise _bomb(kind, max_out)
            if not d.eof and d.needs_input:
                raise KernelImageError(f"{kind} payload is truncated: the stream does not end")
    except lzma.LZMAError as e:
        raise KernelImageError(f"{kind} payload is corrupt: {e}") from None
    _check_trailer(kind, d.unused_data, len(out))
    return out


def _unlz4_legacy(data: bytes, max_out: int) -> bytearray:
    """LZ4's legacy frame: the magic, then blocks (a u32 LE length, then an LZ4 block of at most 8 MiB output);
    the magic may appear again in place of a length (concatenated frames, as the kernel's own reader allows)."""
    import lz4.block
    n, pos, out = len(data), 4, bytearray()
    while pos < n:
        if n - pos == 4:  # the size trailer (a block would need a length and at least one byte)
            _check_trailer("lz4", data[pos:], len(out))
            break
        if n - pos < 4:
            raise KernelImageError(f"lz4 payload is truncated: {n - pos} bytes where a block length was due")
        size = _u32(data, pos)
        pos += 4
        if size == LZ4_LEGACY_MAGIC:
            continue
        if not 0 < size <= LZ4_BLOCK_MAX:
            raise KernelImageError(f"lz4 payload has a block length of {size} at {pos - 4} (at most {LZ4_BLOCK_MAX})")
        if pos + size > n:
            raise KernelImageError(f"lz4 payload is truncated: a block of {size} bytes at {pos} runs past its end "
                                   f"({n})")
        block, pos = data[pos:pos + size], pos + size
        try:  # into a whole block's room (8 MiB, what a block may give), then counted against the bound
            piece = lz4.block.decompress(block, uncompressed_size=LZ4_BLOCK_OUT)
        except lz4.block.LZ4BlockError:
            raise KernelImageError(f"lz4 payload has a corrupt block at {pos - size}") from None
        if len(out) + len(piece) > max_out:
            raise _bomb("lz4", max_out)
        out += piece
    return out


def _unzstd(data: bytes, max_out: int) -> bytearray:
    """One zstd frame, fed to the decoder a block at a time so that no call gives more than one block's output
    (128 KiB): the block headers are walked here to find the frame's end (and so any trailer)."""
    import zstandard
    try:
        start = zstandard.frame_header_size(data)
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise KernelImageError(f"zstd payload has a bad frame header: {e}") from None
    if params.dict_id:
        raise KernelImageError(f"zstd payload needs dictionary {params.dict_id}")
    if params.window_size > ZSTD_WINDOW_MAX:
        raise KernelImageError(f"zstd payload's window of {params.window_size} bytes is over {ZSTD_WINDOW_MAX}")
    d = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW_MAX).decompressobj()
    n, pos, fed, out = len(data), start, 0, bytearray()
    while True:
        if pos + 3 > n:
            raise KernelImageError(f"zstd payload is truncated: no block header at {pos}")
        head = int.from_bytes(data[pos:pos + 3], "little")
        last, btype, bsize = head & 1, head >> 1 & 3, head >> 3
        if btype == 3:
            raise KernelImageError(f"zstd payload has a block of the reserved type at {pos}")
        if bsize > ZSTD_BLOCK_MAX:
            raise KernelImageError(f"zstd payload has a block of {bsize} bytes at {pos} (at most {ZSTD_BLOCK_MAX})")
        pos += 3 + (1 if btype == 1 else bsize)  # an RLE block is one byte, repeated bsize times
        if last and params.has_checksum:
            pos += 4
        if pos > n:
            raise KernelImageError(f"zstd payload is truncated: a block runs past its end ({n})")
        try:
            out += d.decompress(data[fed:pos])
        except zstandard.ZstdError as e:
            raise KernelImageError(f"zstd payload is corrupt: {e}") from None
        fed = pos
        if len(out) > max_out:
            raise _bomb("zstd", max_out)
        if last:
            break
    if not d.eof:
        raise KernelImageError("zstd payload's frame does not end after its last block")
    _check_trailer("zstd", data[pos:], len(out))
    return out


def extract_vmlinux(bzimage: bytes, max_out: int = MAX_OUT) -> bytes:
    """The ELF vmlinux inside an x86 bzImage: the setup header read strictly, the payload decompressed (gzip, xz,
    lzma, LZ4 legacy or zstd, by its magic) to at most `max_out` bytes, and the result checked by `elf_info`.
    KernelImageError, naming the fault, for anything else."""
    data = _payload(bzimage)
    if data[:2] == b"\x1f\x8b":
        out = _gunzip(data, max_out)
    elif data[:6] == b"\xfd7zXZ\x00":
        out = _unlzma("xz", lzma.FORMAT_XZ, data, max_out)
    elif data[:3] == b"\x5d\x00\x00":
        out = _unlzma("lzma", lzma.FORMAT_ALONE, data, max_out)
    elif data[:4] == LZ4_LEGACY_MAGIC.to_bytes(4, "little"):
        out = _unlz4_legacy(data, max_out)
    elif data[:4] == b"\x28\xb5\x2f\xfd":
        out = _unzstd(data, max_out)
    elif data[:3] == b"BZh" or data[:4] == b"\x89LZO":
        raise KernelImageError(f"bzImage payload is {'bzip2' if data[:1] == b'B' else 'lzo'}-compressed, which this "
                               f"reader does not take (gzip, xz, lzma, lz4, zstd)")
    else:
        raise KernelImageError(f"bzImage payload has an unknown compression (magic {data[:6].hex()})")
    vmlinux = bytes(out)
    del out
    elf_info(vmlinux)
    return vmlinux


# -- the cache beside the image -------------------------------------------------------------------------------------
def _cached(path: Path) -> bool:
    """A vmlinux made earlier: a non-empty file whose ELF headers parse (mapped, not read)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return False
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                elf_info(m)
        return True
    except (OSError, ValueError):  # KernelImageError is a ValueError
        return False


def vmlinux_for(image_dir: Path) -> Path:
    """The image's vmlinux (for Firecracker), made from `image_dir/vmlinuz` the first time and cached beside it:
    written to a temporary file in that directory, fsynced, then renamed, under a lock so that a concurrent caller
    waits and then finds it. KernelImageError if the vmlinuz is missing or not a kernel this module reads."""
    image_dir = Path(image_dir)
    out = image_dir / "vmlinux"
    if _cached(out):
        return out
    with open(image_dir / ".vmlinux.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _cached(out):  # made by the caller we waited for
            return out
        src = image_dir / "vmlinuz"
        try:
            bzimage = src.read_bytes()
        except FileNotFoundError:
            raise KernelImageError(f"no kernel at {src}") from None
        try:
            vmlinux = extract_vmlinux(bzimage)
        except KernelImageError as e:
            raise KernelImageError(f"{src}: {e}") from None
        del bzimage
        fd, tmp = tempfile.mkstemp(prefix=".vmlinux-", dir=image_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(vmlinux)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dfd = os.open(image_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself survives a crash
        finally:
            os.close(dfd)
    return out
