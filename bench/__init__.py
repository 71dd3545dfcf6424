"""Benchmarks (bench/README.md); run from the checkout root as ``python -m bench.<name>``."""
