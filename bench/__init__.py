"""Benchmarks (scripts: ``python bench/<name>/run.py``); shared helpers live here."""
