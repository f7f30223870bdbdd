"""Process groups per set of ranks, created once and cached (a placement's are made together by
its ``Mesh``: NOTE [meshes] in _mesh.py).

# NOTE [group creation order]
# ``torch.distributed.new_group`` must be entered by every rank of the world,
# members or not, in the same order. Every rank runs the same program and so
# asks for the same groups in the same order: callers pass *all* groups of a
# step (every group along a placement axis), and each rank creates the ones it
# has not seen yet, in the order given.
#
# NOTE [group agreement]
# torch names a group by how many groups the process made before it, so two
# ranks that create different groups at the same point (two models built on
# every rank but each called only on its own ranks; a branch on the rank around
# a global op) would both make "the n-th group" and rendezvous over the same
# store keys: a connect timeout on some ranks while others go on, or ranks
# connected to another group's peers. So before ``new_group`` each rank
# publishes on the store which group it creates as its n-th, and compares it
# with the n-th of every rank that has published one: any difference raises,
# naming what each rank created and where this rank is. The group's members
# first wait for each other's entry (they meet in the group's rendezvous
# anyway; a member that creates none within the collective timeout is named
# with its last call). The other ranks do not wait: ranks may make a group they
# are not in at different times (a group made by a transfer, which the ranks
# reach one after another), and a rank that waited for them
# there could wait for a rank that waits for it. So of two ranks that disagree,
# the later one raises at once; the earlier one raises when it next meets the
# later one, and never runs on a group made with the wrong peers. A member that
# went on to the group's rendezvous while another member raised there waits for
# it until the timeout, then compares again (the later rank's entry is there by
# then) and raises the same named error instead of torch's store timeout. Group
# creation is rare (once per group), so the store round trips cost nothing in a
# step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch.distributed as dist

from ._errors import CollectiveError, default_store, others_calls, user_site
from ._world import ensure_initialized, on_teardown, owned_group, timeout_delta, timeout_seconds

_groups: dict[tuple[str, tuple[int, ...], Hashable], dist.ProcessGroup | None] = {}
_created = [0]  # groups this rank has asked to create in this world (NOTE [group agreement])


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def group_of(
    device_type: str, groups: Sequence[tuple[int, ...]], rank: int, tag: Hashable = None
) -> tuple[tuple[int, ...], dist.ProcessGroup | None] | None:
    """Create (once) every group in ``groups``; return ``rank``'s group and its handle.

    Returns ``None`` when ``rank`` is in none of them. The handle is ``None`` for
    a group of one rank (nothing to communicate). A ``tag`` other than ``None``
    asks for a group of its own for the same ranks (NOTE [transfer tags] in _p2p.py).
    """
    ensure_initialized()
    backend = backend_for(device_type)
    mine = None
    for ranks in groups:
        key = (backend, tuple(ranks), tag)
        if key not in _groups:
            _groups[key] = _new_group(backend, ranks, tag)
        if rank in ranks:
            mine = (tuple(ranks), _groups[key])
    return mine


_world_handles: dict[str, dist.ProcessGroup | None] = {}


def _forget_groups() -> None:
    """Drop the cached groups so that they are freed now (NOTE [teardown])."""
    _groups.clear()
    _world_handles.clear()
    _created[0] = 0


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


def _new_group(backend: str, ranks: Sequence[int], tag: Hashable) -> dist.ProcessGroup | None:
    world_size = dist.get_world_size()
    if len(ranks) == 1 and backend == "gloo":
        return None
    world = tuple(range(world_size))
    own = tag is not None
    if not own and backend == "nccl" and tuple(ranks) == world and "nccl" in dist.get_backend():
        return dist.group.WORLD
    # gloo: a group of sbpflow's own even over the whole world, never the default
    # group, which sbpflow cannot free at exit (NOTE [teardown] in _world.py).
    return new_group(backend, ranks, tag)


def new_group(backend: str, ranks: Sequence[int], tag: Hashable = None) -> dist.ProcessGroup:
    """The one place sbpflow creates a process group: after the ranks agree on it (NOTE
    [group agreement]). ``tag`` names a group of its own for ranks that have one already
    (a tagged transfer group, the checks' control group, the checkpoints' storage group)."""
    group = _describe(backend, ranks, tag)
    n = _agree(group, ranks)
    try:
        return owned_group(ranks, backend)
    except (RuntimeError, OSError) as error:  # torch's rendezvous of the group timed out
        # A member that compared after another rank published a different group raised
        # before this rendezvous: look again, now that its entry is there.
        if n is not None:
            _check_same(n, group)
        raise CollectiveError(
            f"sbpflow: rank {dist.get_rank()} could not connect {group} at {user_site()} "
            f"within {timeout_seconds():.0f} s (SBPFLOW_TIMEOUT): a member did not join. "
            f"{_others_doing()}"
        ) from error


def _describe(backend: str, ranks: Sequence[int], tag: Hashable) -> str:
    own = "" if tag is None else f" (a group of its own, {tag!r})"
    return f"a {backend} group of ranks {list(ranks)}{own}"


def _agree(group: str, members: Sequence[int]) -> int | None:
    """Check the ranks that created their n-th group created ``group`` (NOTE [group agreement]);
    returns n (``None`` without a store to agree through)."""
    store = default_store()
    n = _created[0]
    _created[0] += 1
    if store is None:
        return None
    me, world_size = dist.get_rank(), dist.get_world_size()
    keys = _keys(n, world_size)
    store.set(keys[me], group)
    if me in members:  # the members meet in the group's rendezvous anyway
        try:
            store.wait([keys[rank] for rank in members], timeout_delta())
        except (RuntimeError, OSError) as error:  # DistStoreError subclasses RuntimeError
            missing = [rank for rank in members if not store.check([keys[rank]])]
            raise CollectiveError(
                f"sbpflow: rank {me} creates {group} at {user_site()}, but rank(s) {missing} "
                f"created no group for {timeout_seconds():.0f} s (SBPFLOW_TIMEOUT): every rank "
                "must make the same sbpflow calls in the same order, so look for a branch only "
                f"some ranks take. {_others_doing()}"
            ) from error
    _check_same(n, group)
    return n


def _keys(n: int, world_size: int) -> list[str]:
    return [f"sbpflow/group/{n}/{rank}" for rank in range(world_size)]


def _others_doing() -> str:
    doing = "; ".join(f"rank {r} was last in {c}" for r, c in sorted(others_calls().items()))
    return doing + "." if doing else ""


def _check_same(n: int, group: str) -> None:
    """Raise if a rank that has published its n-th group published another than ``group``."""
    store = default_store()
    assert store is not None
    keys = _keys(n, dist.get_world_size())
    created = {rank: store.get(key).decode() for rank, key in enumerate(keys) if store.check([key])}
    if any(other != group for other in created.values()):
        each = "; ".join(f"rank {rank} creates {other}" for rank, other in created.items())
        raise CollectiveError(
            f"sbpflow: the ranks create different groups at the same point ({each}); rank "
            f"{dist.get_rank()} is at {user_site()}. Every rank must make the same sbpflow calls "
            "in the same order (each rank makes every group, members or not): look for a branch "
            "only some ranks take, e.g. each model called only on its own ranks; call every "
            "graph and global op on every rank (the ranks outside a placement skip its work)."
        )
