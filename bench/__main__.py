"""`python -m bench [signer ...]`: run the named benchmarks (all by default) and print their ratios."""

from __future__ import annotations

import argparse
import sys

from . import (bench_audit, bench_batch, bench_box, bench_egress, bench_environment, bench_gpu, bench_jobs,
               bench_kernel, bench_load, bench_mounts, bench_packages, bench_patch, bench_signer)

TARGETS = {"signer": bench_signer.main, "box": bench_box.main, "kernel": bench_kernel.main,
           "egress": bench_egress.main, "patch": bench_patch.main,
           "load": bench_load.main, "batch": bench_batch.main, "mounts": bench_mounts.main,
           "environment": bench_environment.main, "audit": bench_audit.main, "gpu": bench_gpu.main,
           "jobs": bench_jobs.main, "packages": bench_packages.main}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    p.add_argument("targets", nargs="*", default=[])
    p.add_argument("--n", type=int, default=None, help="operations per measurement (default: each target's own)")
    p.add_argument("--backend", choices=["bwrap", "qemu"], default=None, help="the box backend (box target only)")
    p.add_argument("--parallel", type=int, default=None, help="jobs at once, for jobs/s (jobs target only)")
    p.add_argument("--index-delay-ms", type=int, default=None,
                   help="the modelled index distance, ms per request (packages target only; default 20)")
    a = p.parse_args(argv)
    if a.index_delay_ms is not None and (a.index_delay_ms < 1 or any(t != "packages" for t in a.targets or TARGETS)):
        p.error("--index-delay-ms N (N >= 1) applies to the packages target only: "
                "python -m bench packages --index-delay-ms 20")
    if a.parallel is not None and (a.parallel < 1 or any(t != "jobs" for t in a.targets or TARGETS)):
        p.error("--parallel N (N >= 1) applies to the jobs target only: python -m bench jobs --parallel 4")
    if a.backend and any(t != "box" for t in a.targets or TARGETS):
        p.error("--backend applies to the box target only: python -m bench box --backend qemu")
    unknown = [t for t in a.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown target {unknown[0]!r} (known: {', '.join(TARGETS)})")
    for name in a.targets or TARGETS:
        if a.backend:
            TARGETS[name](a.n, backend=a.backend)
        elif a.parallel:
            TARGETS[name](a.n, parallel=a.parallel)
        elif a.index_delay_ms is not None:
            TARGETS[name](a.n, index_delay_ms=a.index_delay_ms)
        else:
            TARGETS[name](a.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
