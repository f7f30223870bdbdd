"""One live pool per world size for the whole test session.

Tests of many modules share pools so that a CI run on 2 cores spawns each
world size once (DESIGN §7); a pool killed after a failure restarts itself on
its next job, so the cache never hands out a dead pool for good.
"""

from __future__ import annotations

import atexit
import time

from ._pool import DistributedPool

_pools: dict[int, DistributedPool] = {}
_atexit_registered = False


def get_pool(world_size: int, *, timeout: float = 120.0) -> DistributedPool:
    """The session's pool of ``world_size`` ranks, started on first request.

    ``timeout`` applies when the pool is created; later callers share its setting.
    """
    global _atexit_registered
    pool = _pools.get(world_size)
    if pool is None:
        pool = DistributedPool(world_size, timeout=timeout)
        _pools[world_size] = pool
        if not _atexit_registered:
            atexit.register(shutdown_all)
            _atexit_registered = True
    return pool


def shutdown_all() -> None:
    """Stop every cached pool (called at session end and at interpreter exit).

    All pools are asked to stop first and then reaped, so their workers'
    interpreter shutdowns (about 1.5 s each) overlap.
    """
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.request_stop()
    deadline = time.monotonic() + 3.0
    for pool in pools:
        pool.join_or_kill(deadline)
