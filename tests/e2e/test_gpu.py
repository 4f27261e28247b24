"""GPUs in real bubblewrap boxes (docs/backends.md): a box with `[box] gpus` runs a CUDA computation on exactly the
GPUs it was given and its signed start names them; a box without `gpus` sees no GPU; a count past the host's is
refused before any box starts. Needs an NVIDIA GPU and driver (/dev/nvidiactl); the computation needs torch or
CuPy importable by the box's interpreter (this one's)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tkbox_nb import Box, Policy, open_run
from tkbox_nb.backends import gpus as host
from tkbox_nb.backends import memory_limit
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.backends.gpu_facts import GpuRefused

pytestmark = [pytest.mark.skipif(not Path("/dev/nvidiactl").exists(),
                                 reason="no /dev/nvidiactl: this host has no NVIDIA GPU driver"),
              pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])]

TORCH = ("import torch\na = torch.ones(1024, 1024, device='cuda')\nprint(int((a @ a).sum().item()), "
         "torch.cuda.device_count(), torch.cuda.get_device_name(0))\n")
CUPY = ("import cupy\na = cupy.ones((1024, 1024), dtype=cupy.float32)\nprint(int((a @ a).sum()), "
        "cupy.cuda.runtime.getDeviceCount(), cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())\n")
LIB = next((m for m in ("torch", "cupy") if importlib.util.find_spec(m)), None)


def _policy(extra: str = "") -> Policy:
    return Policy.from_toml(f"[box]\nbackend = \"bwrap\"\nmemory_mib = 16384\n{extra}")


def test_a_box_given_one_gpu_computes_on_it_and_its_start_names_it(signer, tmp_path):
    if LIB is None:
        pytest.skip(f"neither torch nor CuPy is importable by the box's interpreter ({sys.executable})")
    if memory_limit.mechanism() != memory_limit.CGROUP:
        pytest.skip("no memory cgroup can be made here: under RLIMIT_AS = memory_mib CUDA cannot reserve its "
                    "address space (docs/backends.md)")
    first = host.host_gpus()[0][0]
    with Box(policy=_policy("gpus = 1\n"), backend="bwrap", bundle_path=tmp_path / "g.tkb") as b:
        r = b.run(["python3", "-c", TORCH if LIB == "torch" else CUPY], timeout=300)
        smi = b.run(["nvidia-smi", "-L"])
    assert r.exit_code == 0, r.stderr[-2000:]
    total, count, name = r.stdout.decode().split(" ", 2)
    assert (int(total), int(count), name.strip()) == (1024 ** 3, 1, first.name)
    assert smi.exit_code == 0 and smi.stdout.count(b"GPU ") == 1 and first.uuid.encode() in smi.stdout
    [gpu] = json.loads(open_run(tmp_path / "g.tkb").box["gpus"])
    assert (gpu["uuid"], gpu["name"], gpu["driver_version"]) == (first.uuid, first.name, first.driver_version)
    assert gpu["cuda_driver_version"] and gpu["memory_mib"] == first.memory_mib


def test_a_box_without_gpus_sees_no_gpu(signer, tmp_path):
    with Box(policy=_policy(), backend="bwrap", bundle_path=tmp_path / "n.tkb") as b:
        r = b.run(["sh", "-c", "ls /dev/nvidia* 2>&1; echo ${CUDA_VISIBLE_DEVICES:-unset}"])
        probe = b.run(["python3", "-c", "import torch; print(torch.cuda.is_available())"]) if LIB == "torch" else None
    assert b"No such file" in r.stdout and r.stdout.endswith(b"unset\n"), r.stdout
    assert probe is None or probe.stdout.strip() == b"False", probe
    assert "gpus" not in open_run(tmp_path / "n.tkb").box


def test_more_gpus_than_the_host_has_are_refused_before_any_box_starts(signer, tmp_path):
    n = len(host.host_gpus()[0])
    box = Box(policy=_policy(f"gpus = {n + 1}\n"), backend="bwrap", bundle_path=tmp_path / "r.tkb")
    with pytest.raises(GpuRefused, match=f"this host has {n} GPU"):
        box.start()
    assert box.recorder is None
