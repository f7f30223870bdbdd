"""This process's place in the world: rank, world size, local rank; printing once.

The default process group is created lazily from the environment on first
use (see ``sbpflow.comm``); these functions never block.
"""

from __future__ import annotations

from typing import Any

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
    "print0",
    "set_timeout",
    "timeout_seconds",
]


def print0(*args: Any, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on global rank 0 only; the other ranks print nothing.

    The arguments are evaluated on every rank before the call, so a global value in them
    (``print0(f"loss {loss:.4f}")``, whose formatting gathers the logical value, a
    collective) is computed everywhere and the ranks stay in step. Output is flushed
    unless ``flush`` is given, so lines from a launched job appear as they are printed.
    """
    if get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
