"""Which samples each rank reads: DistributedSampler on tiny data sets, and the global batch.

Run it on 2 ranks (CPU, gloo):

    python -m sbpflow.distributed.launch --nproc_per_node 2 examples/sampler.py

Each rank prints its share of data sets of 1, 2 and 3 items. The shares are PyTorch's
(``torch.utils.data.DistributedSampler``): without ``drop_last`` the data set is padded by
repeating its order until both ranks get the same count (3 items -> 2 each, item 0 twice;
1 item -> both ranks read item 0); with ``drop_last`` the uneven tail is dropped (3 items ->
1 each; 1 item -> nothing). ``set_epoch`` reshuffles the same way on every rank, from
``seed + epoch``, with no communication.

Then each rank loads one batch through a ``DataLoader`` and ``to_global_batch`` makes the
ranks' batches one logical batch, split along dim 0 (rank 0's rows first):

    sampler = DistributedSampler(dataset, placement)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    for x in loader:
        x = to_global_batch(x, placement)
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import sbpflow
from sbpflow.sbp import broadcast
from sbpflow.utils.data import DistributedSampler, to_global_batch


def main() -> None:
    rank = sbpflow.env.get_rank()
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))

    for num_items in (1, 2, 3):
        dataset = list(range(num_items))
        for shuffle, drop_last, epochs in ((False, False, 1), (False, True, 1), (True, False, 2)):
            sampler = DistributedSampler(dataset, placement, shuffle=shuffle, drop_last=drop_last)
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                print(
                    f"rank {rank}: data set of {num_items}, shuffle={shuffle}, "
                    f"drop_last={drop_last}, epoch {epoch} -> {list(sampler)}",
                    flush=True,
                )

    # One step of a training loop's input: the items are 10, 20, 30; each rank's loader
    # yields 2 of them (shuffled), and the global batch holds all 4: one item twice, padded.
    values = torch.tensor([10, 20, 30])
    loader = DataLoader(values, batch_size=2, sampler=DistributedSampler(values, placement))
    x = to_global_batch(next(iter(loader)), placement)
    logical = x.to_global(sbp=broadcast).to_local()  # every rank takes part in the gather
    if rank == 0:
        print(f"global batch {tuple(x.shape)} {x.sbp[0]}: {logical.tolist()}", flush=True)


if __name__ == "__main__":
    main()
