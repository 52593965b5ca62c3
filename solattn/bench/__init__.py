"""Benchmark and verification CLI (``solattn bench``)."""
