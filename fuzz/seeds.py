"""Seed inputs: well-formed examples of each input, so fuzzing starts from what really crosses and mutates from there.

The bundle seed is a real signed run (`fuzz/corpus/seed.tkb`, with the `trust.json` that pins its throwaway signer),
made by `python -m fuzz --make-seed-bundle` and kept in the repository, so the bundle targets need no signer.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

CORPUS = Path(__file__).parent / "corpus"
SEED_BUNDLE = CORPUS / "seed.tkb"
SEED_TRUST = CORPUS / "trust.json"

PH_A = "tkbox-ph-" + "a" * 32
PH_B = "tkbox-ph-" + "b" * 32
TOKEN_A, TOKEN_B = b"\xfe", b"\xfd"   # in a fuzz input, each stands for a binding's placeholder

HEADER = {"msg_id": "m1", "msg_type": "display_data", "session": "s", "username": "u",
          "date": "2026-12-01T00:00:00Z", "version": "5.3"}
PARENT = {"msg_id": "p1", "msg_type": "execute_request"}


def kernel_message(channel: str, msg_type: str, content: dict, buffers: list | None = None) -> dict:
    return {"channel": channel, "header": dict(HEADER, msg_type=msg_type), "parent_header": dict(PARENT),
            "metadata": {}, "content": content, "buffers": buffers or []}


KERNEL_MESSAGES = [
    kernel_message("iopub", "stream", {"name": "stdout", "text": "hello\n"}),
    kernel_message("iopub", "display_data", {"data": {"text/plain": "x", "text/html": "<b>x</b>",
                                                      "application/javascript": "alert(1)"}, "metadata": {},
                                             "transient": {"display_id": "d1"}}),
    kernel_message("iopub", "update_display_data", {"data": {"text/plain": "y"}, "metadata": {},
                                                    "transient": {"display_id": "d1"}}),
    kernel_message("iopub", "execute_result", {"data": {"text/plain": "42"}, "metadata": {}, "execution_count": 1}),
    kernel_message("iopub", "error", {"ename": "ValueError", "evalue": "bad", "traceback": ["line 1", "line 2"]}),
    kernel_message("iopub", "status", {"execution_state": "idle"}),
    kernel_message("iopub", "clear_output", {"wait": True}),
    kernel_message("iopub", "execute_input", {"code": "1 + 1", "execution_count": 1}),
    kernel_message("iopub", "comm_open", {"comm_id": "c1", "target_name": "jupyter.widget", "data": {"state": {}}}),
    kernel_message("iopub", "comm_msg", {"comm_id": "c1", "data": {"method": "update"}}, ["AAEC"]),
    kernel_message("iopub", "display_data", {"data": {"text/html": "<img src=x onerror=alert(1)><script>x</script>",
                                                      "text/markdown": "[a](javascript:x)", "image/svg+xml": "<svg/>",
                                                      "Text/HTML": "<b onclick=x>b</b>"}, "metadata": {}}),
    kernel_message("iopub", "comm_open", {"comm_id": "c2", "target_name": "jupyter.widget", "data": {"state": {
        "_model_name": "OutputModel", "description_allow_html": True, "outputs": [
            {"output_type": "display_data", "data": {"text/html": "<script>x</script>"}, "metadata": {}}]}}}),
    kernel_message("iopub", "comm_open", {"comm_id": "c3", "target_name": "jupyter.widget", "data": {"state": {
        "_model_name": "HTMLModel", "value": "<img src=x onerror=alert(1)>"}}}),
    kernel_message("shell", "execute_reply", {"status": "ok", "execution_count": 1, "payload": [
        {"source": "set_next_input", "text": "%%box_policy", "replace": False},
        {"source": "page", "data": {"text/plain": "help", "text/html": "<i>h</i>"}, "start": 0}]}),
    kernel_message("shell", "complete_reply", {"status": "ok", "matches": ["print"], "cursor_start": 0,
                                               "cursor_end": 2, "metadata": {}}),
    kernel_message("shell", "inspect_reply", {"status": "ok", "found": True, "data": {"text/plain": "doc"},
                                              "metadata": {}}),
    kernel_message("stdin", "input_request", {"prompt": "name? ", "password": False}),
    kernel_message("control", "shutdown_reply", {"status": "ok", "restart": False}),
    {"channel": "bridge", "header": {"msg_type": "ready"}, "parent_header": {}, "metadata": {},
     "content": {"status": "ok"}, "buffers": []},
]

PROXY_REQUESTS = [
    b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n",
    b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01",
    b"GET http://example.org/a?q=1 HTTP/1.1\r\nHost: example.org\r\nProxy-Connection: keep-alive\r\n"
    b"Proxy-Authorization: Basic eDp5\r\nAccept: */*\r\n\r\n",
    b"POST http://198.18.0.10:8080/up HTTP/1.1\r\nHost: 198.18.0.10:8080\r\nContent-Length: 3\r\n\r\nabc",
    b"CONNECT 2130706433:80 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET http://[::ffff:127.0.0.1]/ HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET http://b\xc3\xbccher.example/ HTTP/1.1\r\nHost: x\r\n\r\n",
]

HOSTS = [b"example.org", b"Example.ORG.", b"b\xc3\xbccher.example", b"xn--bcher-kva.example", b"127.1", b"0x7f.1",
         b"2130706433", b"0177.0.0.1", b"[::1]", b"[::ffff:169.254.169.254]", b"[fe80::1%25eth0]", b"1.2.3.256",
         b"a..b", b"metadata.google.internal", b"\xef\xbd\x85xample.org", b"_srv.example.org", b"x" * 260]

# spellings of bound hosts a box may write in a CONNECT: each must get the leaf of the one address (or name) dialled
BOUND_HOST_SPELLINGS = [b"198.18.7.2", b"198.18.7.2.", b"3323070210", b"0xc6.0x12.7.2", b"0306.022.07.02",
                        b"198.18.1794", b"[198.18.7.2]", b"[2001:db8::1]", b"[2001:DB8:0:0:0:0:0:1]",
                        b"[2001:db8::1%25eth0]",
                        b"[::ffff:198.18.7.2]", b"[64:ff9b::c612:702]", b"api.example.org", b"API.Example.org.",
                        b"_srv.example.org", b"a-b.c" + b".d" * 120]

POLICIES = [
    b"[box]\nbackend = \"auto\"\n\n[exec]\ncells = true\ncommands = [\"*\"]\ndeny_commands = []\ntimeout_s = 600\n",
    b"[exec]\ncells = false\ncommands = [\"python3\", \"ls\", \"py*\"]\ndeny_commands = [\"rm\", \"curl\"]\n"
    b"max_output_bytes = 1024\ntimeout_s = 2.5\n",
    b"[box]\nmemory_mib = 512\ncpus = 2\ncpu_time_s = 60\nmax_processes = 32\nworkspace_mib = 64\n",
    b"[egress]\nallow = [\"*.example.org:443\", \"pypi.org:*\"]\nallow_cidrs = [\"198.18.0.0/15\", \"2001:db8::/32\"]\n"
    b"nameservers = [\"198.18.0.2\"]\nconnect_timeout_s = 5\n",
    b"[egress]\nallow = [\"api.example.org:443\"]\n\n[secrets.API_KEY]\nhosts = [\"api.example.org\"]\n"
    b"header = \"Authorization\"\nformat = \"Bearer {value}\"\nsource = \"env:API_KEY\"\nmisuse = \"refuse\"\n",
]

SANITIZER_FILES = [b"# volatile values\n\\d+ ms\t<MS>\nrun-[0-9]+\n", b"(?P<x>a+)b\t\\g<x>\n", b"[\t<X>\n"]


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


def frames() -> list[bytes]:
    """Byte streams a guest really sends: hello, a command's output and exit, an egress stream, kernel messages."""
    from tkbox_nb.guest import protocol as p
    hello = p.encode_json(p.OPEN, 2, {"kind": "hello", "pid": 7, "python": "3.11.7"}) + p.encode(p.CLOSE, 2)
    command = (p.encode(p.DATA, 1, b"\x01out\n") + p.encode(p.DATA, 1, b"\x02err\n")
               + p.encode(p.WINDOW, 1, _u32(1 << 18)) + p.encode_json(p.CLOSE, 1, {"exit_code": 0}))
    egress = (p.encode_json(p.OPEN, 4, {"kind": "egress"}) + p.encode(p.WINDOW, 4, _u32(7 << 20))
              + p.encode(p.DATA, 4, b"\x04" + PROXY_REQUESTS[0]) + p.encode(p.CLOSE, 4))
    kernel = b"".join(p.encode(p.DATA, 3, b"\x03" + p.encode_message(m)) for m in KERNEL_MESSAGES[:4])
    return [hello, hello + command, hello + egress, hello + kernel, hello + p.encode(p.DATA, 1, b"")]


def messages() -> list[bytes]:
    from tkbox_nb.guest import protocol as p
    return [b"".join(p.encode_message(m) for m in KERNEL_MESSAGES[i:i + 3]) for i in range(0, len(KERNEL_MESSAGES), 3)]


def make_seed_bundle(out_dir: Path = CORPUS) -> Path:
    """A real signed run with a throwaway signer (cells, a command, a refused command, refused egress, a host
    magic), written as `seed.tkb` beside the `trust.json` that pins that signer."""
    import os

    from tkbox_nb.policy import Policy
    from tkbox_nb.signing.recorder import RunRecorder
    from tkbox_nb.signing.signer import MachineSigner
    home = Path(tempfile.mkdtemp(prefix="tkfz-", dir="/tmp"))
    old = os.environ.get("TKBOX_HOME")
    os.environ["TKBOX_HOME"] = str(home)
    signer = MachineSigner(home).ensure()
    try:
        policy = Policy.from_toml(POLICIES[1].decode() + "[egress]\nallow = [\"*.example.org:443\"]\n")
        rec = RunRecorder(signer, policy, {"backend": "none", "isolation": "none", "image_digest": "none"}).open()
        for i, code in enumerate(["print('hi')\n", "x = 1\nx * 2\n"], 1):
            c = rec.decide("exec", "cell", {}, {"code": code.encode()})
            rec.complete(c, "ok", {"execution_count": i}, {"outputs": json.dumps(
                [{"output_type": "stream", "name": "stdout", "text": "hi\n"},
                 {"output_type": "execute_result", "data": {"text/plain": "2"}, "metadata": {},
                  "execution_count": i}]).encode()})
        rec.set_policy(Policy.from_toml(POLICIES[0].decode()))
        c = rec.decide("exec", "command", {"argv": ["ls", "-l"]}, {"stdin": b"in"})
        rec.complete(c, "ok", {"exit_code": 0}, {"stdout": b"out\n", "stderr": b""})
        rec.decide("exec", "command", {"argv": []})
        rec.decide("egress", "connect", {"host": "metadata.google.internal", "port": 80, "addresses": [],
                                         "address": ""})
        c = rec.decide("host", "magic", {"magic": "box_status", "line": ""})
        rec.complete(c, "ok", {})
        rec.close("seed done")
        out_dir.mkdir(parents=True, exist_ok=True)
        rec.write_bundle(out_dir / "seed.tkb")
        shutil.copy(signer.trust_path, out_dir / "trust.json")
    finally:
        signer.stop()
        if old is None:
            os.environ.pop("TKBOX_HOME", None)
        else:
            os.environ["TKBOX_HOME"] = old
        shutil.rmtree(home, ignore_errors=True)
    return out_dir / "seed.tkb"


# -- kernel images (tkbox_nb/backends/linux_kernel.py): a tiny vmlinux, wrapped in a bzImage, compressed each way ------
KERNEL_BASE = 0x1000000  # where Linux's x86-64 vmlinux loads (CONFIG_PHYSICAL_START)
COMPRESSIONS = ("gzip", "xz", "lzma", "lz4", "zstd")


def elf_note(owner: bytes, ntype: int, desc: bytes) -> bytes:
    """One ELF note: namesz, descsz, type, then the owner's name (NUL-ended) and the descriptor, each padded to 4."""
    name = owner + b"\0"
    pad = lambda b: b + b"\0" * (-len(b) % 4)  # noqa: E731
    return struct.pack("<III", len(name), len(desc), ntype) + pad(name) + pad(desc)


def tiny_vmlinux(machine: int = 62, e_type: int = 2, code: bytes = b"\xf4" * 64, notes: bytes | None = None,
                 load_filesz: int | None = None, note_filesz: int | None = None, pvh_entry: int = 0x40) -> bytes:
    """A minimal vmlinux-shaped ELF64 x86-64 executable: one PT_LOAD over the whole file at KERNEL_BASE and one
    PT_NOTE holding Xen's PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY, 18). The arguments break it on purpose."""
    if notes is None:
        notes = elf_note(b"GNU", 3, b"\x01" * 20) + elf_note(b"Xen", 18, struct.pack("<I", KERNEL_BASE + pvh_entry))
    phoff, phnum = 64, 2
    note_off = phoff + phnum * 56
    code_off = note_off + len(notes)
    size = code_off + len(code)
    ehdr = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + bytes(9), e_type, machine, 1,
                       KERNEL_BASE + code_off, phoff, 0, 0, 64, 56, phnum, 64, 0, 0)
    load = struct.pack("<IIQQQQQQ", 1, 7, 0, 0xFFFFFFFF80000000 + KERNEL_BASE, KERNEL_BASE,
                       size if load_filesz is None else load_filesz, size + 0x1000, 0x200000)
    note = struct.pack("<IIQQQQQQ", 4, 4, note_off, 0, 0, len(notes) if note_filesz is None else note_filesz, 0, 4)
    return ehdr + load + note + notes + code


def bzimage(payload: bytes, version: int = 0x020F, setup_sects: int = 1, payload_offset: int = 0x40,
            payload_length: int | None = None, magic: bytes = b"HdrS") -> bytes:
    """An x86 bzImage around a compressed payload: a real-mode sector with the setup header (boot flag, "HdrS",
    protocol version, setup_sects, payload_offset and payload_length), then the protected-mode code, which holds
    the payload `payload_offset` bytes in."""
    setup = bytearray(((setup_sects or 4) + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x1FE:0x200] = b"\x55\xaa"
    setup[0x202:0x206] = magic
    struct.pack_into("<H", setup, 0x206, version)
    struct.pack_into("<II", setup, 0x248, payload_offset, len(payload) if payload_length is None else payload_length)
    return bytes(setup) + b"\x90" * payload_offset + payload + b"\xcc" * 32


def kernel_compress(kind: str, data: bytes, trailer: bool = True, lz4_block: int = 8 << 20) -> bytes:
    """`data` compressed as the kernel build does it: the stream, then the u32 LE uncompressed size. LZ4 is the
    legacy frame (magic 0x184C2102, then a u32 LE length and a raw LZ4 block per `lz4_block` bytes of input)."""
    import gzip
    import lzma
    if kind == "gzip":
        out = gzip.compress(data, 9, mtime=0)
    elif kind == "xz":
        out = lzma.compress(data, lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    elif kind == "lzma":
        out = lzma.compress(data, lzma.FORMAT_ALONE)
    elif kind == "lz4":
        import lz4.block
        out = struct.pack("<I", 0x184C2102)
        for i in range(0, len(data), lz4_block):
            block = lz4.block.compress(data[i:i + lz4_block], store_size=False)
            out += struct.pack("<I", len(block)) + block
    elif kind == "zstd":
        import zstandard
        out = zstandard.ZstdCompressor(level=19, write_checksum=True).compress(data)
    else:
        raise ValueError(kind)
    return out + (struct.pack("<I", len(data) & 0xFFFFFFFF) if trailer else b"")


def bzimages() -> list[bytes]:
    """The tiny vmlinux as a bzImage in each compression the reader takes (and LZ4 in several blocks)."""
    elf = tiny_vmlinux()
    return [bzimage(kernel_compress(k, elf)) for k in COMPRESSIONS] + [bzimage(kernel_compress("lz4", elf,
                                                                                               lz4_block=96))]
