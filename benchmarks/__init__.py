"""Benchmarks: run each module as a script (python -m benchmarks.bench_machine)."""
