"""Data parallelism: gradients reduced in buckets that overlap backward.

- ``sync_gradients(module)`` for a global model (parameters broadcast, batch split);
- ``DistributedDataParallel(module)`` for a model that keeps local tensors.

Both run on one engine, ``GradientSync`` (NOTE [bucketed gradient sync] in ``_reducer``).
"""

from ._reducer import GradientSync
from .distributed import DistributedDataParallel
from .sync import sync_gradients

__all__ = ["DistributedDataParallel", "GradientSync", "sync_gradients"]
