"""Benchmarks: each prints a table of ratios measured side by side and exits 1 on a MISS.

Run one as a module from the repository root: `python -m bench.autoscale_sim`."""
