"""Benchmarks and GPU checks, each run as `python -m scripts.bench.NAME`."""
