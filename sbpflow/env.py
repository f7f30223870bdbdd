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


def print0(*args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None,
           flush: bool = True) -> None:  # fmt: skip
    """``print(*args, ...)`` on global rank 0 only; every rank formats the arguments.

    Every rank runs ``str()`` on each argument, so a global tensor among them (whose
    printed value is gathered: a collective) is formatted everywhere and the ranks stay
    in step: ``print0("loss", loss)`` and ``print0(f"loss {loss:.4f}")`` both work. Only
    rank 0 prints. Output is flushed unless ``flush=False``, so lines from a launched job
    appear as they are printed.
    """
    text = (" " if sep is None else sep).join(str(arg) for arg in args)
    if get_rank() == 0:
        print(text, end=end, file=file, flush=flush)
