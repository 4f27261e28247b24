"""`python -m fuzz TARGET --time S`: one target under atheris (libFuzzer) for S seconds; `--list` lists targets.

The target's seeds start the corpus (kept under .fuzz-work/TARGET, outside git); a crash is written to
fuzz/crashes/TARGET-crash-<sha1> and its traceback printed. Without atheris installed (it is the optional `fuzz`
extra), the same target runs on random mutations of its seeds for S seconds instead, and says so.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTRUMENT = ["tkbox_nb", "fuzz", "h11", "idna", "tomllib", "ipaddress", "zipfile", "json", "tracekit"]


def _load_targets(instrument: bool):
    if instrument:
        import atheris
        with atheris.instrument_imports(include=INSTRUMENT):
            import tracekit.format.canon  # noqa: F401  (imported lazily by tkbox_nb.bundle.verify)
            import tracekit.verify.v2  # noqa: F401
            from fuzz.targets import TARGETS
    else:
        from fuzz.targets import TARGETS
    return TARGETS


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        at = rng.randint(0, len(b))
        if op == 0 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2 and b:
            del b[at:at + rng.randint(1, 8)]
        else:
            b[at:at] = bytes(b[rng.randint(0, len(b)):][:rng.randint(1, 16)])
    return bytes(b)


def run_random(t, seconds: float, seed: int = 0) -> int:
    """The fallback engine: random mutations of the seeds (no coverage feedback)."""
    rng, pool, runs = random.Random(seed), t.seeds() or [b""], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        data = _mutate(rng, rng.choice(pool))
        try:
            t.fn(data)
        except Exception:
            traceback.print_exc()
            path = _save_crash(t.name, data)
            print(f"fuzz {t.name}: crash after {runs} runs, input in {path}", file=sys.stderr)
            return 1
        pool.append(data) if len(pool) < 2000 and rng.random() < 0.05 else None
        runs += 1
    print(f"fuzz {t.name}: {runs} runs in {seconds:g}s (random mutation, no coverage), no crash")
    return 0


def _save_crash(name: str, data: bytes) -> Path:
    import hashlib
    out = ROOT / "fuzz" / "crashes"
    out.mkdir(exist_ok=True)
    path = out / f"{name}-crash-{hashlib.sha1(data).hexdigest()}"
    path.write_bytes(data)
    return path


def _keep_going(t):
    """The target, but a crash is saved (once per place it was raised) and fuzzing goes on."""
    seen = set()

    def fn(data: bytes) -> None:
        try:
            t.fn(data)
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)[-1]
            where = (type(e).__name__, tb.filename, tb.lineno)
            if where not in seen:
                seen.add(where)
                path = _save_crash(t.name, data)
                print(f"\n=== crash {type(e).__name__}: {str(e)[:200]} at {tb.filename}:{tb.lineno}; input {path}",
                      flush=True)
                traceback.print_exc()
    return fn


def run_atheris(t, seconds: float, extra: list[str], keep_going: bool = False) -> int:
    import atheris
    work = ROOT / ".fuzz-work" / t.name
    work.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(t.seeds()):
        (work / f"seed-{i:03d}").write_bytes(s)
    (ROOT / "fuzz" / "crashes").mkdir(exist_ok=True)
    argv = [sys.argv[0], str(work), f"-max_total_time={int(seconds)}", "-timeout=20", "-rss_limit_mb=3072",
            f"-artifact_prefix={ROOT / 'fuzz' / 'crashes'}/{t.name}-", "-print_final_stats=1", *extra]
    atheris.Setup(argv, _keep_going(t) if keep_going else t.fn)
    atheris.Fuzz()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.splitlines()[0],
                                 epilog="Extra libFuzzer flags go after --, e.g. -- -max_len=65536")
    ap.add_argument("target", nargs="?", help="a target name (see --list)")
    ap.add_argument("--time", type=float, default=60.0, help="seconds to run (default 60)")
    ap.add_argument("--list", action="store_true", help="list the targets")
    ap.add_argument("--engine", choices=("atheris", "random"), default=None,
                    help="atheris (default when installed) or random mutation of the seeds")
    ap.add_argument("--keep-going", action="store_true",
                    help="save each distinct crash and go on fuzzing (atheris stops at the first otherwise)")
    ap.add_argument("--replay", metavar="FILE", help="run the target once on FILE (a saved crash) and show the result")
    ap.add_argument("--make-seed-bundle", action="store_true",
                    help="write fuzz/corpus/seed.tkb and trust.json with a throwaway signer")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.libfuzzer_args = extra
    if a.make_seed_bundle:
        from fuzz.seeds import make_seed_bundle
        print(make_seed_bundle())
        return 0
    try:
        import atheris  # noqa: F401
        have_atheris = True
    except ImportError:
        have_atheris = False
    engine = a.engine or ("atheris" if have_atheris else "random")
    if engine == "atheris" and not have_atheris:
        print("python -m fuzz: atheris is not installed (pip install -e '.[fuzz]')", file=sys.stderr)
        return 2
    targets = _load_targets(instrument=engine == "atheris" and not a.list and not a.replay)
    if a.list or not a.target:
        for name, t in sorted(targets.items()):
            print(f"{name:18s} {t.doc}")
        return 0 if a.list else 2
    if a.target not in targets:
        print(f"python -m fuzz: no target {a.target!r} (see --list)", file=sys.stderr)
        return 2
    t = targets[a.target]
    if a.replay:
        t.fn(Path(a.replay).read_bytes())
        print(f"fuzz {t.name}: {a.replay} passes")
        return 0
    if engine == "random":
        if not have_atheris:
            print("python -m fuzz: atheris is not installed; running random mutations of the seeds instead",
                  file=sys.stderr)
        return run_random(t, a.time)
    return run_atheris(t, a.time, a.libfuzzer_args, a.keep_going)


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
