"""Workloads and benchmarks; each benchmark runs as ``python -m minipaged.bench.NAME``."""
