"""Feeding a global-tensor training loop: which samples each rank reads, and its global batch.

``DistributedSampler`` is PyTorch's sampler with the replicas taken from a placement's data
axis (ranks that share a coordinate on that axis read the same samples);
``to_global_batch`` turns each rank's loader batch into one logical batch split on dim 0::

    sampler = DistributedSampler(dataset, placement)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = to_global_batch((x, y), placement)
"""

from __future__ import annotations

from ._global_batch import to_global_batch
from ._sampler import DistributedSampler

__all__ = ["DistributedSampler", "to_global_batch"]
