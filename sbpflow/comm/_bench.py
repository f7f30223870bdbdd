"""Timing collectives for ``sbpflow.boxing.calibrate``, and agreeing on the results.

Every world rank calls every function here in the same order (group creation
and the agreement steps are collective over the world, see NOTE [group
creation order]); ranks outside the timed groups just take part.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import collectives
from ._errors import named
from ._groups import group_of, world_group
from ._world import device_for, ensure_initialized

TIMED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def time_collective(
    op: str,
    num_bytes: int,
    device_type: str,
    groups: Sequence[tuple[int, ...]],
    *,
    repeats: int,
    warmup: int = 1,
) -> float:
    """Fastest of ``repeats`` runs of ``op`` on this rank's group, in seconds.

    A run lasts until the group's slowest member finishes it.

    ``num_bytes`` is the block the group handles together, as in cost.py: the
    tensor each member all-reduces or reduce-scatters, the tensor an
    all-gather produces, the whole tensor an all-to-all re-splits (each
    member holds ``1/num`` of it). Every group in
    ``groups`` runs at once, as a boxing step does. Returns 0.0 on a rank in
    none of them.
    """
    if op not in TIMED_OPS:
        raise ValueError(f"can only time {TIMED_OPS}, got {op!r}.")
    ensure_initialized()
    rank = dist.get_rank()
    found = group_of(device_type, groups, rank)
    if found is None:
        return 0.0
    ranks, handle = found
    if handle is None:
        return 0.0
    device = device_for(device_type)
    num = len(ranks)
    numel = max(num_bytes // 4 // num, 1) * num  # float32, a multiple of the group size
    block = torch.ones(numel, dtype=torch.float32, device=device)
    piece = block[: numel // num].clone()
    fence = torch.zeros(1, device=device)

    # all_to_all: the piece cut in ``num``, as even as it gets
    splits = [piece.numel() // num] * num
    splits[-1] += piece.numel() - sum(splits)

    # Out of place, as boxing runs them (the same calls, NOTE [gloo gathers and reductions]):
    # every run writes a fresh buffer, so first-touch page faults of large outputs are part
    # of the time.
    def run() -> None:
        if op == "all_reduce":
            collectives.all_reduce(block, found, "sum", inplace=False)
        elif op == "all_gather":
            collectives._all_gather_into(torch.empty_like(block), piece, found)
        elif op == "reduce_scatter":
            collectives._reduce_scatter_into(torch.empty_like(piece), block, found, "sum")
        else:
            recv = torch.empty_like(piece)
            dist.all_to_all_single(recv, piece, splits, splits, group=handle)

    best = float("inf")
    elapsed = torch.zeros(1, dtype=torch.float64, device=device)
    with named(f"calibration ({op})", ranks):
        for i in range(warmup + repeats):
            dist.all_reduce(fence, group=handle)  # start together
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            elapsed.fill_(time.perf_counter() - start)
            # A run takes as long as its slowest member: that is what a boxing step waits for.
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=handle)
            if i >= warmup:
                best = min(best, float(elapsed.item()))
    return best


def max_over_world(values: Sequence[float], device_type: str = "cpu") -> list[float]:
    """Elementwise maximum of ``values`` over every world rank (the slowest rank decides)."""
    return _reduce_floats(values, device_type, dist.ReduceOp.MAX)


def broadcast_from_first(values: Sequence[float], device_type: str = "cpu") -> list[float]:
    """World rank 0's ``values`` on every rank (float64, so bit-identical everywhere)."""
    ensure_initialized()
    handle = world_group(device_type)
    if handle is None:
        return list(values)
    buffer = torch.tensor(list(values), dtype=torch.float64, device=device_for(device_type))
    with named("calibration (broadcast)", range(dist.get_world_size())):
        dist.broadcast(buffer, src=0, group=handle)
    return [float(v) for v in buffer.tolist()]


def barrier() -> None:
    """Wait until every world rank gets here (e.g. until a shared file is written)."""
    max_over_world([0.0])


def _reduce_floats(values: Sequence[float], device_type: str, op: Any) -> list[float]:
    ensure_initialized()
    handle = world_group(device_type)
    if handle is None:
        return list(values)
    buffer = torch.tensor(list(values), dtype=torch.float64, device=device_for(device_type))
    with named("calibration (all_reduce)", range(dist.get_world_size())):
        dist.all_reduce(buffer, op=op, group=handle)
    return [float(v) for v in buffer.tolist()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
