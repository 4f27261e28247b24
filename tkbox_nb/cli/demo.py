"""`make demo`: the main job. Executes notebooks/01-quickstart.ipynb headlessly with the Tracekit Box kernel
(nbclient), so every cell runs in a box through the exec door; writes the executed notebook and the run's `.tkb`, and
verifies the bundle with `tkbox verify` and with Tracekit's own `tracekit verify`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

from tkbox_nb.bundle.verify import verify_bundle

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01-quickstart.ipynb"


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute_notebook(path: Path, out_dir: Path, timeout: int = 300) -> tuple[Path, Path]:
    """Run `path` with the Tracekit Box kernel; returns (executed notebook, bundle)."""
    from nbclient import NotebookClient
    from tkbox_nb.jupyter.kernel.install import SPEC_DIR

    nb = nbformat.read(path, as_version=4)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tkbox-demo-") as tmp:
        (Path(tmp) / "kernels").mkdir()
        (Path(tmp) / "kernels" / "tkbox").symlink_to(SPEC_DIR)  # the shipped kernelspec, installed or not
        bundles = Path(tmp) / "bundles"
        jupyter_path = os.pathsep.join(filter(None, [tmp, os.environ.get("JUPYTER_PATH")]))
        with _env(JUPYTER_PATH=jupyter_path, TKBOX_BUNDLE_DIR=str(bundles)):
            NotebookClient(nb, timeout=timeout, kernel_name="tkbox",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
        written = sorted(bundles.glob("*.tkb"))
        if len(written) != 1:
            raise RuntimeError(f"expected one bundle from the notebook's box, found {len(written)}")
        bundle = out_dir / (path.stem + ".tkb")
        os.replace(written[0], bundle)
    executed = out_dir / (path.stem + ".executed.ipynb")
    nbformat.write(nb, executed)
    return executed, bundle


def main() -> int:
    out = Path("out")
    executed, bundle = execute_notebook(NOTEBOOK, out)
    report = verify_bundle(bundle)
    print(f"tkbox verify:    {report.summary()}")
    from tkbox_nb.signing.signer import MachineSigner
    trust = MachineSigner().trust_path
    tk = subprocess.run([str(Path(sys.executable).parent / "tracekit"), "verify", str(bundle), "--trust", str(trust)],
                        capture_output=True, text=True)
    print("tracekit verify:", next((line for line in tk.stdout.splitlines() if line.startswith("Integrity")),
                                   tk.stdout[-200:]))
    print(f"notebook: {executed.resolve()}  (open with: jupyter lab {executed}; tkbox kernel install --sys-prefix "
          "to run it again)")
    print(f"bundle:   {bundle.resolve()}  (tkbox show {bundle})")
    print(f"trust:    {trust}")
    return 0 if report.valid and tk.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
