"""Joining the benchmark's world from a spawned worker."""

from __future__ import annotations

import os

import torch

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
