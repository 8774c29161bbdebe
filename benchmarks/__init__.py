"""Benchmarks: side-by-side runs and figures (run as modules: python -m benchmarks.<name>)."""
