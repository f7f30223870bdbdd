"""Caches keyed by shapes stay under their bounds when shapes keep changing (NOTE [bounded caches]).

Variable sequence lengths give every step new shapes: 5,000 distinct shapes go
through ``to_global`` (local -> S(0), then boxing S(0) -> B with the meta check)
and an add, and afterwards every cache is at most its bound. The
values are compared with plain single-process PyTorch computed in the same job.
Filling every cache past its bound takes most of a minute on a 2-core machine, so that
run is a soak (``python -m pytest -m soak``). The default suite runs 40 shapes with every
``BoundedDict`` (and the planner's hot plans) cut to a bound of 8, so the shapes overflow
them: each cache the loop fills ends exactly at its bound, having dropped its oldest
entries, and the values stay right; every other cache keyed by shapes has a bound.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow import _bounded, _decisions, _dispatch, _dispatch_pointwise, _global, _printing
from sbpflow.boxing import _redistribute, _transfer, executor, planner
from sbpflow.ops import _foreach, views
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool

NUM_SHAPES = 5000


def cache_sizes() -> dict[str, tuple[int, int]]:
    """Every cache keyed by shapes: name -> (entries now, bound). The one list of them."""
    bounded = [
        (_global._metas, _global.METAS_BOUND),
        (_redistribute._boxing_metas, _redistribute.BOXING_METAS_BOUND),
        (_printing._reading_metas, _printing.READING_METAS_BOUND),
        (_global.GlobalTensor._op_dispatcher.propagator.decisions, _decisions.DECISIONS_BOUND),
        (_global.GlobalTensor._op_dispatcher.fast, _dispatch.FAST_BOUND),
        (executor._routes, executor.ROUTES_BOUND),
        (_foreach._plans, _foreach.PLANS_BOUND),
        (_dispatch_pointwise._qualifies, _dispatch_pointwise.QUALIFIES_BOUND),
    ]
    sizes = {cache.name: (len(cache), bound) for cache, bound in bounded}
    # A BoundedDict added later must be listed here too, with its module's named bound.
    assert set(sizes) == set(_bounded.bounded_caches()), sorted(_bounded.bounded_caches())
    sizes["planner hot plans"] = (len(planner._hot), planner._HOT_LIMIT)
    for fn in (
        planner._cached_plan,
        _transfer.flat_boxes,
        _transfer._pieces,
        views._pieces_line_up,
    ):
        info = fn.cache_info()
        sizes[fn.__qualname__] = (info.currsize, info.maxsize)
    return sizes


def _many_shapes(first: int, stop: int) -> list[int]:
    """Shapes (k, 4) per rank for k in [first, stop); returns the k whose values were wrong."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    wrong = []
    for k in range(first, stop):
        local = torch.arange(k * 4.0).reshape(k, 4) + 1000 * rank
        # The logical shape is given, so only the boxing below runs a meta check.
        x = local.to_global(placement, split(0), shape=(world * k, 4), check_meta=False)
        y = x.to_global(sbp=broadcast)  # the meta check, then all_gather
        total = torch.stack([y, y]).sum(0)  # new decisions (and fast-path entries) per shape
        if k % 500 == 0 or k == 1:  # the values, on a sample of the shapes
            pieces = [torch.arange(k * 4.0).reshape(k, 4) + 1000 * r for r in range(world)]
            if not torch.equal(total.to_local(), 2 * torch.cat(pieces)):
                wrong.append(k)
    return wrong


# The caches the loop of ``_many_shapes`` adds to with every new shape.
FILLED = ("interned metas", "boxing meta checks", "dispatch decisions", "dispatch fast path")
SMALL_BOUND = 8


def _many_shapes_under_small_bounds(first: int, stop: int) -> tuple[list[int], dict]:
    """``_many_shapes`` with every BoundedDict emptied and cut to ``SMALL_BOUND`` entries (and
    the planner's hot plans to as many); the wrong shapes and each cache's (entries, bound).
    The bounds are put back after."""
    caches = _bounded.bounded_caches()
    bounds = {name: cache.bound for name, cache in caches.items()}
    hot_limit = planner._HOT_LIMIT
    try:
        for cache in caches.values():
            cache.clear()
            cache.bound = SMALL_BOUND
        planner._hot.clear()
        planner._HOT_LIMIT = SMALL_BOUND
        wrong = _many_shapes(first, stop)
        sizes = {name: (len(cache), cache.bound) for name, cache in caches.items()}
        sizes["planner hot plans"] = (len(planner._hot), planner._HOT_LIMIT)
    finally:
        for name, cache in caches.items():
            cache.bound = bounds[name]
        planner._HOT_LIMIT = hot_limit
    return wrong, sizes


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_every_cache_keyed_by_shapes_has_a_bound(dist_pool: DistributedPool) -> None:
    """40 new shapes through caches cut to 8 entries: right values, each filled cache full
    at its bound (it dropped entries), none past it; every cache is listed with its bound."""
    for wrong, sizes in dist_pool.run(_many_shapes_under_small_bounds, 1, 41):
        assert wrong == []
        for name, (size, bound) in sizes.items():
            assert bound == SMALL_BOUND and size <= bound, f"{name}: {size} entries, bound {bound}"
        for name in FILLED:
            assert sizes[name][0] == SMALL_BOUND, (name, sizes[name])
    for sizes in dist_pool.run(cache_sizes):
        for name, (size, bound) in sizes.items():
            assert bound is not None and size <= bound, f"{name}: {size} entries, bound {bound}"


@pytest.mark.soak
@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_caches_stay_bounded_under_changing_shapes(dist_pool: DistributedPool) -> None:
    chunk = 1000  # one job per chunk keeps each well inside the pool's timeout
    for first in range(1, NUM_SHAPES + 1, chunk):
        assert dist_pool.run(_many_shapes, first, min(first + chunk, NUM_SHAPES + 1)) == [[], []]
    # The first shapes' metas, decisions and fast entries were dropped long ago: still right.
    assert dist_pool.run(_many_shapes, 1, 2) == [[], []]
    for sizes in dist_pool.run(cache_sizes):
        for name, (size, bound) in sizes.items():
            assert size <= bound, f"{name}: {size} entries, bound {bound}"
        # Each of these saw more new keys than its bound: it was full and dropped entries.
        for name in FILLED:
            assert sizes[name][0] == sizes[name][1], (name, sizes[name])
