"""Benchmarks run from the checkout: ``python -m benchmarks.<name>``."""
