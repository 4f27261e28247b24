"""`python -m bench [signer ...]`: run the named benchmarks (all by default) and print their ratios."""

from __future__ import annotations

import argparse
import sys

from . import bench_signer

TARGETS = {"signer": bench_signer.main}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    p.add_argument("targets", nargs="*", choices=[*TARGETS, []], default=[])
    p.add_argument("--n", type=int, default=None, help="operations per measurement (default: each target's own)")
    a = p.parse_args(argv)
    for name in a.targets or TARGETS:
        TARGETS[name](a.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
