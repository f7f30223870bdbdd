"""Test support: run a function on N spawned ranks that share a gloo process group.

``get_pool(n).run(fn, ...)`` runs a module-level ``fn`` on every rank and
returns the per-rank results in rank order, raising :class:`RankFailure` with
every failing rank's traceback. ``run_expect_errors`` returns per-rank
outcomes instead, for tests that a mistake becomes an error on every rank
rather than a hang.
"""

from __future__ import annotations

from ._errors import Outcomes, RankFailure, RankTimeout, RemoteError
from ._pool import DistributedPool
from ._registry import get_pool, shutdown_all
from ._transport import free_port

__all__ = [
    "DistributedPool",
    "Outcomes",
    "RankFailure",
    "RankTimeout",
    "RemoteError",
    "free_port",
    "get_pool",
    "shutdown_all",
]
