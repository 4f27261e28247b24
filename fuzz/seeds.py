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
    from tkbox_nb import protocol as p
    hello = p.encode_json(p.OPEN, 2, {"kind": "hello", "pid": 7, "python": "3.11.7"}) + p.encode(p.CLOSE, 2)
    command = (p.encode(p.DATA, 1, b"\x01out\n") + p.encode(p.DATA, 1, b"\x02err\n")
               + p.encode(p.WINDOW, 1, _u32(1 << 18)) + p.encode_json(p.CLOSE, 1, {"exit_code": 0}))
    egress = (p.encode_json(p.OPEN, 4, {"kind": "egress"}) + p.encode(p.WINDOW, 4, _u32(7 << 20))
              + p.encode(p.DATA, 4, b"\x04" + PROXY_REQUESTS[0]) + p.encode(p.CLOSE, 4))
    kernel = b"".join(p.encode(p.DATA, 3, b"\x03" + p.encode_message(m)) for m in KERNEL_MESSAGES[:4])
    return [hello, hello + command, hello + egress, hello + kernel, hello + p.encode(p.DATA, 1, b"")]


def messages() -> list[bytes]:
    from tkbox_nb import protocol as p
    return [b"".join(p.encode_message(m) for m in KERNEL_MESSAGES[i:i + 3]) for i in range(0, len(KERNEL_MESSAGES), 3)]


def make_seed_bundle(out_dir: Path = CORPUS) -> Path:
    """A real signed run with a throwaway signer (cells, a command, a refused command, refused egress, a host
    magic), written as `seed.tkb` beside the `trust.json` that pins that signer."""
    import os

    from tkbox_nb.policy import Policy
    from tkbox_nb.recorder import RunRecorder
    from tkbox_nb.signer import MachineSigner
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
