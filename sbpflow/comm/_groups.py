"""Process groups per set of ranks, created once and cached (a placement's are made together by
its ``Mesh``: NOTE [meshes] in _mesh.py).

# NOTE [group creation order]
# ``torch.distributed.new_group`` must be entered by every rank of the world,
# members or not, in the same order. Every rank runs the same program and so
# asks for the same groups in the same order: callers pass *all* groups of a
# step (every group along a placement axis), and each rank creates the ones it
# has not seen yet, in the order given.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch.distributed as dist

from ._world import ensure_initialized, on_teardown, timeout_delta

_groups: dict[tuple[str, tuple[int, ...], Hashable], dist.ProcessGroup | None] = {}


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def group_of(
    device_type: str, groups: Sequence[tuple[int, ...]], rank: int, lane: Hashable = None
) -> tuple[tuple[int, ...], dist.ProcessGroup | None] | None:
    """Create (once) every group in ``groups``; return ``rank``'s group and its handle.

    Returns ``None`` when ``rank`` is in none of them. The handle is ``None`` for
    a group of one rank (nothing to communicate). A ``lane`` other than ``None``
    asks for a group of its own for the same ranks (NOTE [lanes] in _p2p.py).
    """
    ensure_initialized()
    backend = backend_for(device_type)
    mine = None
    for ranks in groups:
        key = (backend, tuple(ranks), lane)
        if key not in _groups:
            _groups[key] = _new_group(backend, ranks, own=lane is not None)
        if rank in ranks:
            mine = (tuple(ranks), _groups[key])
    return mine


_world_handles: dict[str, dist.ProcessGroup | None] = {}


def _forget_groups() -> None:
    """Drop the cached groups so that they are freed now (NOTE [teardown])."""
    _groups.clear()
    _world_handles.clear()


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


def _new_group(backend: str, ranks: Sequence[int], own: bool = False) -> dist.ProcessGroup | None:
    world_size = dist.get_world_size()
    if len(ranks) == 1 and backend == "gloo":
        return None
    world = tuple(range(world_size))
    if not own and backend == "nccl" and tuple(ranks) == world and "nccl" in dist.get_backend():
        return dist.group.WORLD
    # gloo: a group of sbpflow's own even over the whole world, never the default
    # group, which sbpflow cannot free at exit (NOTE [teardown] in _world.py).
    return dist.new_group(list(ranks), backend=backend, timeout=timeout_delta())
