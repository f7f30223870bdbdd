"""This process's place in the world: rank, world size, local rank.

The default process group is created lazily from the environment on first
use (see ``sbpflow.comm``); these functions never block.
"""

from __future__ import annotations

from .comm._world import (
    ensure_initialized,
    get_local_rank,
    get_rank,
    get_world_size,
    set_timeout,
    timeout_seconds,
)

__all__ = [
    "ensure_initialized",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "set_timeout",
    "timeout_seconds",
]
