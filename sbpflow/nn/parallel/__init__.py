"""Data parallelism: gradients reduced in buckets that overlap backward.

- ``sync_gradients(module)`` for a global model (parameters broadcast, batch split);
- ``DistributedDataParallel(module)`` for a model that keeps local tensors.

Both run on one engine, ``GradientSync`` (NOTE [bucketed gradient sync] in ``_reducer``).
``fully_shard(module)`` shards parameters, gradients and optimizer state on the data axis
instead (fully sharded data parallelism, ``fsdp``).
"""

from ._reducer import GradientSync
from .distributed import DistributedDataParallel
from .fsdp import FSDPModule, MixedPrecisionPolicy, ShardedState, fully_shard
from .sync import sync_gradients

__all__ = [
    "DistributedDataParallel",
    "FSDPModule",
    "GradientSync",
    "MixedPrecisionPolicy",
    "ShardedState",
    "fully_shard",
    "sync_gradients",
]
