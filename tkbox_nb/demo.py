"""`make demo`: the main job. Executes notebooks/01-quickstart.ipynb in a box, writes the executed notebook and the
run's `.tkb`, and verifies the bundle with `tkbox verify` and with Tracekit's own `tracekit verify`.

The cells run through the exec door of a bubblewrap box (the Jupyter kernel that does the same from JupyterLab is
the kernel issue's work).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat

from .box import Box
from .verify import verify_bundle

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "01-quickstart.ipynb"


def execute_notebook(path: Path, out_dir: Path) -> tuple[Path, Path]:
    nb = nbformat.read(path, as_version=4)
    bundle = out_dir / (path.stem + ".tkb")
    with Box(bundle_path=bundle) as box:
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            result = box.execute(cell.source)
            cell.outputs = [nbformat.from_dict({**o, **({"execution_count": result.execution_count}
                                                        if o["output_type"] == "execute_result" else {})})
                            for o in result.outputs]
            cell.execution_count = result.execution_count
        nb.metadata["tkbox"] = {"run_id": box.run_id, "box_id": box.box_id, "backend": box.backend.name}
    executed = out_dir / (path.stem + ".executed.ipynb")
    nbformat.write(nb, executed)
    return executed, bundle


def main() -> int:
    out = Path("out")
    out.mkdir(exist_ok=True)
    executed, bundle = execute_notebook(NOTEBOOK, out)
    report = verify_bundle(bundle)
    print(f"tkbox verify:    {report.summary()}")
    from .signer import MachineSigner
    trust = MachineSigner().trust_path
    tk = subprocess.run([str(Path(sys.executable).parent / "tracekit"), "verify", str(bundle), "--trust", str(trust)],
                        capture_output=True, text=True)
    print("tracekit verify:", next((line for line in tk.stdout.splitlines() if line.startswith("Integrity")),
                                   tk.stdout[-200:]))
    print(f"notebook: {executed.resolve()}  (open with: jupyter lab {executed})")
    print(f"bundle:   {bundle.resolve()}  (tkbox show {bundle})")
    print(f"trust:    {trust}")
    return 0 if report.valid and tk.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
