"""Data parallelism: gradients reduced in buckets that overlap backward.

- a global model (parameters broadcast, batch split) with nothing to call: its gradients
  join buckets after the first backward pass (NOTE [data parallel by default] in
  ``_default``); ``sync_gradients(module, bucket_cap_mb=...)`` chooses the buckets and
  ``no_sync(module)`` holds them for gradient accumulation;
- ``DistributedDataParallel(module)`` for a model that keeps local tensors.

All run on one engine, ``GradientSync`` (NOTE [bucketed gradient sync] in ``_reducer``).
``fully_shard(module)`` shards parameters, gradients and optimizer state on the data axis
instead (fully sharded data parallelism, ``fsdp``).
"""

from ._reducer import GradientSync
from .distributed import DistributedDataParallel
from .fsdp import FSDPModule, MixedPrecisionPolicy, ShardedState, fully_shard
from .sync import no_sync, sync_gradients

__all__ = [
    "DistributedDataParallel",
    "FSDPModule",
    "GradientSync",
    "MixedPrecisionPolicy",
    "ShardedState",
    "fully_shard",
    "no_sync",
    "sync_gradients",
]
