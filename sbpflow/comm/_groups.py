"""Process groups per set of ranks, created once and cached.

# NOTE [group creation order]
# ``torch.distributed.new_group`` must be entered by every rank of the world,
# members or not, in the same order. Every rank runs the same program and so
# asks for the same groups in the same order: callers pass *all* groups of a
# step (every group along a placement axis), and each rank creates the ones it
# has not seen yet, in the order given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ._world import ensure_initialized, on_teardown, timeout_delta

_groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup | None] = {}


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def group_of(
    device_type: str, groups: Sequence[tuple[int, ...]], rank: int
) -> tuple[tuple[int, ...], dist.ProcessGroup | None] | None:
    """Create (once) every group in ``groups``; return ``rank``'s group and its handle.

    Returns ``None`` when ``rank`` is in none of them. The handle is ``None`` for
    a group of one rank (nothing to communicate).
    """
    ensure_initialized()
    backend = backend_for(device_type)
    mine = None
    for ranks in groups:
        key = (backend, tuple(ranks))
        if key not in _groups:
            _groups[key] = _new_group(backend, ranks)
        if rank in ranks:
            mine = (tuple(ranks), _groups[key])
    return mine


_prepared: set[Any] = set()


def ensure_placement_groups(placement: Any, rank: int) -> None:
    """Create, on every rank, the groups along every set of ``placement``'s axes.

    Op rules may communicate inside their local computation, which ranks
    outside the placement skip; creating the groups up front (a collective
    over the whole world, see NOTE [group creation order]) keeps those ranks
    from being missed when such a group is first needed.
    """
    if placement in _prepared:
        return
    for count in range(1, placement.ndim + 1):
        for axes in itertools.combinations(range(placement.ndim), count):
            group_of(placement.type, placement.groups_along(axes), rank)
    _prepared.add(placement)


_along: dict[tuple[Any, tuple[int, ...]], tuple[tuple[int, ...], dist.ProcessGroup | None]] = {}


def group_along(
    placement: Any, axes: tuple[int, ...], rank: int
) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
    """``rank``'s group along ``axes`` of ``placement`` (a member), looked up once.

    For callers that run per step: they ask here each time instead of keeping
    the handle, so that comm holds every group handle (NOTE [teardown]).
    """
    key = (placement, axes)
    found = _along.get(key)
    if found is None:
        mine = group_of(placement.type, placement.groups_along(axes), rank)
        assert mine is not None, f"rank {rank} is not in {placement}"
        found = _along[key] = mine
    return found


_world_handles: dict[str, dist.ProcessGroup | None] = {}


def _forget_groups() -> None:
    """Drop the cached groups so that they are freed now (NOTE [teardown])."""
    _groups.clear()
    _along.clear()
    _world_handles.clear()
    _prepared.clear()


on_teardown(_forget_groups)


def world_group(device_type: str) -> dist.ProcessGroup | None:
    """The group of every rank for ``device_type``'s backend (looked up once; it runs per call)."""
    if device_type in _world_handles and dist.is_initialized():
        return _world_handles[device_type]
    ensure_initialized()
    world = tuple(range(dist.get_world_size()))
    found = group_of(device_type, [world], dist.get_rank())
    assert found is not None
    _world_handles[device_type] = found[1]
    return found[1]


def _new_group(backend: str, ranks: Sequence[int]) -> dist.ProcessGroup | None:
    world_size = dist.get_world_size()
    if len(ranks) == 1 and backend == "gloo":
        return None
    world = tuple(range(world_size))
    if backend == "nccl" and tuple(ranks) == world and "nccl" in dist.get_backend():
        return dist.group.WORLD
    # gloo: a group of sbpflow's own even over the whole world, never the default
    # group, which sbpflow cannot free at exit (NOTE [teardown] in _world.py).
    return dist.new_group(list(ranks), backend=backend, timeout=timeout_delta())
