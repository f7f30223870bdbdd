"""CUDA tests (NCCL, CuPy); skipped by ``tests/conftest.py`` when CUDA is absent."""
