"""Fuzz targets over everything that parses box or bundle input, run two ways from one registry.

`fuzz.targets.TARGETS` maps a name to one function of bytes that asserts the contract of one parser (only its
documented exceptions, its limits, its round trips). `tests/test_fuzz_targets.py` runs each for a few hundred
hypothesis examples in CI; `python -m fuzz TARGET --time S` runs the same function under atheris (coverage-guided
libFuzzer) for longer. fuzz/README.md records how long each ran and what it found.

Nothing here imports tkbox_nb at package import time, so the atheris runner can instrument it as it loads.
"""
