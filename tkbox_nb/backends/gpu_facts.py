"""Which GPUs a bubblewrap box gets, and what it is given for them: a pure function of the host's facts.

The facts (gathered by gpus.py on the host, never read from a box): `nvidia-smi --query-gpu=... --format=csv`, the
CUDA driver version from `nvidia-smi -q`, each GPU's device minor from /proc/driver/nvidia/gpus/*/information, the
/dev/nvidia* nodes that exist, and the driver's user-space libraries found as the NVIDIA container toolkit finds
them (the ldconfig cache, then a few known directories). Each parser is strict and bounded: a shape it does not know
is a refusal naming it, never a guess. From them: the device nodes bound into the box (`--dev-bind`), the libraries
and `nvidia-smi` bound read-only where the box would not otherwise see them, the box's CUDA_VISIBLE_DEVICES (the
UUIDs bound, so CUDA's numbering cannot disagree with the nodes), and the facts its signed box.start commits to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tkbox_nb.core.errors import TkboxError

QUERY = ("index", "uuid", "name", "driver_version", "memory.total", "compute_cap", "pci.bus_id")
MAX_GPUS = 64
MAX_TEXT = 1 << 20
CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm")  # without these no CUDA program runs
OPTIONAL = ("/dev/nvidia-uvm-tools",)  # bound where the host has it (profilers use it)
CAPS = "/dev/nvidia-caps"  # MIG and other capabilities: only when the policy asks (box.gpu_caps)
LIBRARIES = ("libcuda.so", "libcudadebugger.so", "libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-ptxjitcompiler.so",
             "libnvidia-nvvm.so", "libnvidia-gpucomp.so", "libnvidia-opencl.so", "libnvidia-allocator.so",
             "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so", "libnvidia-fatbinaryloader.so")
KNOWN_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib64", "/usr/lib/x86_64-linux-gnu",
              "/usr/lib/aarch64-linux-gnu", "/lib64", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
BIN_DIRS = ("/usr/bin", "/usr/local/nvidia/bin", "/usr/local/bin", "/bin")

_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_FIELD = {"index": re.compile(r"[0-9]{1,3}"), "uuid": _UUID, "name": re.compile(r"[A-Za-z0-9 ._()/+-]{1,96}"),
          "driver_version": re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}"), "memory.total": re.compile(r"[0-9]{1,9}"),
          "compute_cap": re.compile(r"[0-9]{1,2}\.[0-9]{1,2}"),
          "pci.bus_id": re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")}
_LDCONFIG = re.compile(r"\t(lib[A-Za-z0-9_.+-]+\.so[0-9.]*) \(([^)]{1,80})\) => (/[A-Za-z0-9_./+-]{1,400})")


class GpuRefused(TkboxError):
    """A `[box] gpus` this host or backend cannot give: one line, before any box starts."""


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    driver_version: str
    memory_mib: int
    compute_capability: str
    pci_bus_id: str


@dataclass
class GpuPlan:
    """What a box gets for its GPUs; empty (no GPU) when the policy names none."""

    devices: list[str] = field(default_factory=list)   # --dev-bind, same path in the box
    ro_binds: list[str] = field(default_factory=list)  # --ro-bind, same path in the box
    env: dict[str, str] = field(default_factory=dict)
    facts: dict[str, str] = field(default_factory=dict)  # signed in box.start


def _text(text: str, what: str) -> list[str]:
    if not isinstance(text, str) or len(text) > MAX_TEXT or "\x00" in text:
        raise GpuRefused(f"box.gpus: {what} is not text this parser takes (over {MAX_TEXT} bytes, or binary)")
    return text.splitlines()


def parse_query(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=<QUERY> --format=csv,nounits`: a header naming exactly QUERY (units in brackets
    allowed), then one line per GPU whose every field has the shape it must. Anything else refuses."""
    lines = [ln for ln in _text(text, "nvidia-smi's CSV") if ln.strip()]
    if not lines:
        raise GpuRefused("box.gpus: nvidia-smi listed no GPU")
    header = [re.sub(r"\s*\[[^\]]*\]$", "", h.strip()) for h in lines[0].split(",")]
    if header != list(QUERY):
        raise GpuRefused(f"box.gpus: nvidia-smi's CSV header is not the one asked for: {lines[0][:120]!r}")
    if len(lines) - 1 > MAX_GPUS:
        raise GpuRefused(f"box.gpus: nvidia-smi listed more than {MAX_GPUS} GPUs")
    gpus: list[Gpu] = []
    for n, line in enumerate(lines[1:], 2):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(QUERY):
            raise GpuRefused(f"box.gpus: nvidia-smi's CSV line {n} has {len(cells)} fields, not {len(QUERY)}")
        row = dict(zip(QUERY, cells))
        for key, pattern in _FIELD.items():
            if not pattern.fullmatch(row[key]):
                raise GpuRefused(f"box.gpus: nvidia-smi's CSV line {n}: {key} {row[key][:60]!r} is not a value it has")
        gpus.append(Gpu(int(row["index"]), row["uuid"], row["name"], row["driver_version"], int(row["memory.total"]),
                        row["compute_cap"], row["pci.bus_id"]))
    for key in ("index", "uuid", "pci_bus_id"):
        if len({getattr(g, key) for g in gpus}) != len(gpus):
            raise GpuRefused(f"box.gpus: nvidia-smi listed one GPU {key} twice")
    if len({g.driver_version for g in gpus}) != 1:
        raise GpuRefused("box.gpus: nvidia-smi listed GPUs of different driver versions")
    return sorted(gpus, key=lambda g: g.index)


def parse_cuda_version(text: str) -> str:
    """The CUDA driver version from `nvidia-smi -q` ("CUDA Version : 13.0"), stated once (or the same each time)."""
    found = {m.group(1) for ln in _text(text, "nvidia-smi -q")
             if (m := re.fullmatch(r"\s*CUDA Version\s*:\s*([0-9]{1,3}\.[0-9]{1,3})\s*", ln))}
    if len(found) != 1:
        raise GpuRefused("box.gpus: nvidia-smi -q does not state one CUDA driver version")
    return found.pop()


def parse_information(text: str) -> tuple[str, int] | None:
    """(UUID, device minor) from /proc/driver/nvidia/gpus/<bus id>/information; None when either is missing."""
    uuid = minor = None
    for ln in _text(text, "the driver's GPU information"):
        key, _, value = ln.partition(":")
        if key.strip() == "GPU UUID" and _UUID.fullmatch(value.strip()):
            uuid = value.strip()
        elif key.strip() == "Device Minor" and re.fullmatch(r"[0-9]{1,3}", value.strip()):
            minor = int(value.strip())
    return (uuid, minor) if uuid is not None and minor is not None else None


def parse_ldconfig(text: str, arch: str = "x86-64") -> dict[str, str]:
    """The driver libraries in `ldconfig -p`: {soname: path} for LIBRARIES of this architecture (`arch` is the
    tag ldconfig prints: x86-64, AArch64); the first entry of a name wins, as in the dynamic linker."""
    out: dict[str, str] = {}
    for ln in _text(text, "ldconfig -p"):
        m = _LDCONFIG.fullmatch(ln)
        if m and arch in m.group(2).split(",") and ".." not in m.group(3).split("/") \
                and m.group(1).split(".so")[0] + ".so" in LIBRARIES:
            out.setdefault(m.group(1), m.group(3))
    return out


def select(value, gpus: list[Gpu]) -> list[Gpu]:
    """The GPUs `[box] gpus` names: "all", a count (the first N by index), or a list of indexes and UUIDs."""
    if not gpus:
        raise GpuRefused("box.gpus: this host has no NVIDIA GPU")
    if value == "all":
        return list(gpus)
    if isinstance(value, int) and not isinstance(value, bool):
        if value > len(gpus):
            raise GpuRefused(f"box.gpus = {value}: this host has {len(gpus)} GPU{'s' * (len(gpus) != 1)}")
        return gpus[:value]
    picked: list[Gpu] = []
    for item in value:
        match = [g for g in gpus if item in (str(g.index), g.uuid)]
        if not match:
            raise GpuRefused(f"box.gpus: no GPU {item!r} on this host (it has {', '.join(str(g.index) for g in gpus)})")
        if match[0] in picked:
            raise GpuRefused(f"box.gpus names GPU {match[0].index} twice")
        picked.append(match[0])
    return picked


def _visible(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def plan(picked: list[Gpu], cuda: str, minors: dict[str, int], nodes: set[str], libraries: dict[str, str],
         ld_cached: set[str], smi: str | None, box_roots: tuple[str, ...], caps: bool = False) -> GpuPlan:
    """The binds, environment and signed facts for the GPUs `picked`. `minors` maps UUID to device minor (where the
    driver says; else the nvidia-smi index is taken as the minor, as on every host without MIG); `nodes` the
    /dev/nvidia* paths the host has; `libraries` soname -> host path; `ld_cached` the paths the box's ld.so.cache
    (the host's) names; `box_roots` the host folders the box sees anyway (bwrap.py binds /usr, /lib, ...)."""
    devices = []
    for g in picked:
        node = f"/dev/nvidia{minors.get(g.uuid, g.index)}"
        if node not in nodes:
            raise GpuRefused(f"box.gpus: GPU {g.index} ({g.uuid}) has no device node {node} on this host")
        devices.append(node)
    for node in CONTROL:
        if node not in nodes:
            raise GpuRefused(f"box.gpus: this host has no {node} (is the NVIDIA driver's module loaded?)")
    devices += list(CONTROL) + [n for n in OPTIONAL if n in nodes]
    if caps:
        if CAPS not in nodes:
            raise GpuRefused(f"box.gpu_caps: this host has no {CAPS}")
        devices.append(CAPS)
    if not any(name.startswith("libcuda.so") for name in libraries):
        raise GpuRefused("box.gpus: the NVIDIA driver's libcuda.so was not found (ldconfig cache, known dirs)")
    paths = sorted(set(libraries.values()) | ({smi} if smi else set()))
    ro_binds = [p for p in paths if not _visible(p, box_roots)]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in picked)}
    extra = sorted({p.rsplit("/", 1)[0] for p in libraries.values() if p not in ld_cached})
    if extra:  # found in a known folder the box's ld.so.cache does not list: the dynamic linker is told
        env["LD_LIBRARY_PATH"] = ":".join(extra)
    facts = [{"index": g.index, "name": g.name, "uuid": g.uuid, "driver_version": g.driver_version,
              "cuda_driver_version": cuda, "memory_mib": g.memory_mib, "compute_capability": g.compute_capability,
              "device": node} for g, node in zip(picked, devices)]
    return GpuPlan(devices, ro_binds, env, {"gpus": json.dumps(facts, sort_keys=True, separators=(",", ":"))})
