"""The host's GPU facts, gathered on the host (never asked of a box), and the plan for a box's `[box] gpus`.

Only bubblewrap can give a box a GPU: its processes run on the host kernel, so binding /dev/nvidia* into the box
gives it the NVIDIA kernel driver's ioctl interface (docs/threat-model.md). A VM would need the GPU passed through
with VFIO (docs/backends.md), which is not built: `gpus` on the QEMU and Firecracker backends is refused, as is any
`gpus` this host cannot give, each with one line before any box starts (gpu_facts.py decides; this module reads).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

from tkbox_nb.backends.gpu_facts import (BIN_DIRS, KNOWN_DIRS, LIBRARIES, QUERY, GpuPlan, GpuRefused,
                                         parse_cuda_version, parse_information, parse_ldconfig, parse_query, plan,
                                         select)

BOX_ROOTS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/lib32", "/libx32")  # what bwrap.py binds anyway
SMI_TIMEOUT_S = 20


def _run(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, timeout=SMI_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GpuRefused(f"box.gpus: {argv[0]} did not answer ({type(e).__name__})") from None
    if r.returncode != 0:
        raise GpuRefused(f"box.gpus: {' '.join(argv[:2])} failed: "
                         f"{' '.join(r.stderr.decode('utf-8', 'replace').split())[:160]}")
    return r.stdout.decode("utf-8", "replace")


def nvidia_smi() -> str | None:
    return next((str(p) for d in BIN_DIRS if (p := Path(d) / "nvidia-smi").is_file()), None)


def nodes() -> set[str]:
    return {str(p) for p in Path("/dev").glob("nvidia*")}


def has_driver() -> bool:
    return Path("/dev/nvidiactl").exists() and nvidia_smi() is not None


def libraries() -> tuple[dict[str, str], set[str]]:
    """The driver's libraries ({soname: path}) as the container toolkit finds them: the ldconfig cache first, then
    the known folders; and the paths the cache names."""
    arch = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(platform.machine(), platform.machine())
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        cached = parse_ldconfig(subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=20).stdout,
                                arch)
    except (OSError, subprocess.TimeoutExpired):
        cached = {}
    found = dict(cached)
    for d in KNOWN_DIRS:
        for p in sorted(Path(d).glob("lib*.so.*")) if Path(d).is_dir() else ():
            if p.name.split(".so")[0] + ".so" in LIBRARIES and p.name.count(".") <= 3:  # sonames, not x.so.580.95.05
                found.setdefault(p.name, str(p))
    return found, set(cached.values())


def minors() -> dict[str, int]:
    out = {}
    for info in Path("/proc/driver/nvidia/gpus").glob("*/information"):
        try:
            got = parse_information(info.read_text()[:65536])
        except (OSError, GpuRefused):
            continue
        if got:
            out[got[0]] = got[1]
    return out


def host_gpus() -> tuple[list, str]:
    """The host's GPUs (nvidia-smi's CSV, parsed strictly) and its CUDA driver version; GpuRefused without any."""
    smi = nvidia_smi()
    if not Path("/dev/nvidiactl").exists() or smi is None:
        raise GpuRefused("box.gpus: this host has no NVIDIA GPU or driver (no /dev/nvidiactl or no nvidia-smi)")
    gpus = parse_query(_run([smi, f"--query-gpu={','.join(QUERY)}", "--format=csv,nounits"]))
    return gpus, parse_cuda_version(_run([smi, "-q"]))


def gpu_backend(policy, name: str) -> str:
    """The backend a box with this policy takes: "auto" with `gpus` is bwrap, the one backend that can give a box a
    GPU (a GPU box is a namespace box), unless box.isolation asks for a VM, which stays the minimum (and is then
    refused by gpu_plan, with one line, rather than lowered)."""
    if name == "auto" and policy.get("box", "gpus") is not None and policy.get("box", "isolation") != "vm":
        return "bwrap"
    return name


def gpu_plan(value, caps: bool, backend: str) -> GpuPlan:
    """What a box of `backend` gets for `[box] gpus = value` (None: nothing), or GpuRefused naming why not."""
    if value is None:
        return GpuPlan()
    if backend != "bwrap":
        raise GpuRefused(f"box.gpus: the {backend} backend cannot give a box GPUs (that needs VFIO passthrough, "
                         "not built: docs/backends.md); set box.backend = \"bwrap\"")
    gpus, cuda = host_gpus()
    libs, cached = libraries()
    return plan(select(value, gpus), cuda, minors(), nodes(), libs, cached, nvidia_smi(), BOX_ROOTS, caps)


def doctor_line() -> str:
    """`tkbox doctor`'s GPU line: what a box with `gpus` would get here, or why none."""
    if not has_driver():
        return "no  no NVIDIA GPU or driver here (no /dev/nvidiactl or no nvidia-smi): box.gpus is refused"
    try:
        gpus, cuda = host_gpus()
    except GpuRefused as e:
        return f"no  {e}"
    names = "; ".join(f"{g.index}: {g.name} {g.uuid} {g.memory_mib} MiB cc {g.compute_capability}" for g in gpus)
    return f"ok  driver {gpus[0].driver_version}, CUDA {cuda}; bwrap boxes only: {names}"[:600]


__all__ = ["GpuPlan", "GpuRefused", "doctor_line", "gpu_backend", "gpu_plan", "has_driver"]
