"""Benchmarks: each measures one thing side by side in one run and prints JSON (BENCHMARKS.md holds the results)."""
