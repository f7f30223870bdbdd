"""Joining the benchmark's world from a spawned worker."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import sbpflow


def join_world(rank: int, world: int, port: int) -> None:
    """Become rank ``rank`` of ``world`` gloo ranks on this host, one thread each (2 cores)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    sbpflow.env.ensure_initialized()


def slowest_rank_times(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each sample replaced by the slowest rank's (every rank passes the same names and counts)."""
    out = {}
    for name, samples in times.items():
        slowest = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = slowest.tolist()
    return out
