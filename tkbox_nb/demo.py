"""`make demo`: the main job, end to end on this machine, with both verifiers run on its bundle.

Until the box backends land this records a signed run of host-side crossings only (the box manifest says so:
backend "none"); later it executes a notebook in a box.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .policy import Policy
from .recorder import RunRecorder
from .signer import MachineSigner
from .verify import verify_bundle


def main() -> int:
    out = Path("out")
    out.mkdir(exist_ok=True)
    signer = MachineSigner().ensure()
    rec = RunRecorder(signer, Policy.default(), {"backend": "none", "isolation": "none",
                                                 "image_digest": "none"}).open()
    code = b"print('hello from the demo')\n"
    c = rec.decide("exec", "cell", {}, {"code": code})
    rec.complete(c, "ok", {"execution_count": 1},
                 {"outputs": b'[{"name": "stdout", "output_type": "stream", "text": "hello from the demo\\n"}]'})
    rec.close("demo done")
    bundle = rec.write_bundle(out / "demo.tkb")
    report = verify_bundle(bundle)
    print(f"tkbox verify: {report.summary()}")
    tk = subprocess.run([str(Path(sys.executable).parent / "tracekit"), "verify", str(bundle), "--trust",
                         str(signer.trust_path)], capture_output=True, text=True)
    print("tracekit verify:", next((l for l in tk.stdout.splitlines() if l.startswith("Integrity")), tk.stdout[-200:]))
    print(f"bundle: {bundle.resolve()}\ntrust:  {signer.trust_path}")
    return 0 if report.valid and tk.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
