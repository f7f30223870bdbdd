"""A script that creates its own gloo group, as torch's tutorials do, and never destroys it.

Run on 4 ranks (``torchrun --nproc_per_node 4 tools/soak_jobs/own_group_boxing.py``): it
boxes every pair of 1-D SBPs (S(0), S(1), B, P) between placements of 1 to 4 ranks, for
uneven and empty shapes, checks each result against the logical tensor, prints one line
per rank and simply ends. ``tools/soak.py own-group`` runs it many times in a row.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import sbpflow
from sbpflow.sbp import broadcast, partial_sum, split

RANKS = [(0,), (3,), (0, 1), (1, 2, 3), (0, 1, 2, 3)]
SBPS = [split(0), split(1), broadcast, partial_sum]
SHAPES = [(13, 5), (2, 3), (0, 4)]  # uneven over 2-4 ranks; some ranks get empty pieces; empty


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit(f"run on 4 ranks, not {dist.get_world_size()}")
    wrong = []
    count = 0
    for shape in SHAPES:
        value = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        for src_ranks, dst_ranks in itertools.product(RANKS, RANKS):
            src_placement = sbpflow.placement("cpu", list(src_ranks))
            dst_placement = sbpflow.placement("cpu", list(dst_ranks))
            for src, dst in itertools.product(SBPS, SBPS):
                x = value.to_global(src_placement, broadcast).to_global(sbp=src)
                y = x.to_global(dst_placement, dst)
                whole = y.to_global(sbp=broadcast).to_local()
                if rank in dst_ranks and not torch.equal(whole, value):
                    wrong.append(f"{list(shape)} {src_ranks} {src} -> {dst_ranks} {dst}")
                count += 1
    if wrong:
        raise SystemExit(f"rank {rank}: {len(wrong)} of {count} boxings wrong: {wrong[:5]}")
    print(f"own-group job ok on rank {rank}: {count} boxings", flush=True)


if __name__ == "__main__":
    main()
