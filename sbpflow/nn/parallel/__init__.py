"""Data parallelism: gradients reduced in buckets that overlap backward.

- a global model (parameters broadcast, batch split) with nothing to call: its gradients
  join buckets after the first backward pass (NOTE [data parallel by default] in
  ``_default``); ``sync_gradients(module, bucket_cap_mb=...)`` chooses the buckets and
  ``no_sync(module)`` holds them for gradient accumulation;
- ``DistributedDataParallel(module)`` for a model that keeps local tensors.

All run on one engine, ``GradientSync`` (NOTE [bucketed gradient sync] in ``_reducer``).
"""

from . import _default  # noqa: F401  (binds the default buckets to global leaves' hooks)
from ._reducer import GradientSync
from .distributed import DistributedDataParallel
from .sync import no_sync, sync_gradients

__all__ = ["DistributedDataParallel", "GradientSync", "no_sync", "sync_gradients"]
