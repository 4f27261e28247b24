"""Benchmarks (`python -m bench [TARGET ...]`): each prints tkbox's figure beside a baseline measured in the same
run."""
