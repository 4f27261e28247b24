"""`tkbox kernel install`: the kernelspec, installed with jupyter_client's KernelSpecManager like any other.

kernel.json names `python`, which jupyter_client replaces with the Python that starts the kernel; install writes the
absolute path of this interpreter instead, so frontends running under another Python (VS Code, a system JupyterLab)
still start the kernel where tkbox-nb is installed.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

SPEC_DIR = Path(__file__).resolve().parent / "spec"
KERNEL_NAME = "tkbox"


def install(user: bool = False, prefix: str | None = None, sys_prefix: bool = False) -> str:
    from jupyter_client.kernelspec import KernelSpecManager
    if sys_prefix:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / KERNEL_NAME
        shutil.copytree(SPEC_DIR, staged)
        spec = json.loads((staged / "kernel.json").read_text())
        spec["argv"][0] = sys.executable
        (staged / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
        return KernelSpecManager().install_kernel_spec(str(staged), KERNEL_NAME, user=user, prefix=prefix)
