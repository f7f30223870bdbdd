"""The process group that checkpoints coordinate on, and the small agreements they need.

# NOTE [storage group]
# ``torch.distributed.checkpoint`` coordinates a save or load with object
# collectives (plans gathered to a coordinator, results scattered back). They
# run on a gloo group of their own over the world, made the first time a
# checkpoint is written or read, not on the world group that boxing uses:
# an async save runs DCP's collectives, the final barrier and the rename in a
# background thread while training boxes tensors on the world group, and gloo
# pairs the k-th collective of one rank with the k-th of its peers on the same
# group (NOTE [control group] in _meta.py), so the two must never share one.
# One checkpoint at a time uses the group: sbpflow.checkpoint waits for a
# pending async save before it starts the next save or load.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ._errors import named
from ._meta import gather_objects
from ._world import ensure_initialized, new_group, on_teardown

_storage: dict[str, dist.ProcessGroup] = {}


def storage_group() -> dist.ProcessGroup:
    """The checkpoints' gloo group over every rank (NOTE [storage group]).

    Collective the first time: every rank must ask for it at the same point of
    the program, as every rank calls ``sbpflow.save`` and ``sbpflow.load``.
    """
    if "cpu" not in _storage:
        ensure_initialized()
        world = dist.get_world_size()
        _storage["cpu"] = new_group(range(world), "gloo")
    return _storage["cpu"]


on_teardown(_storage.clear)  # NOTE [teardown] in _world.py


def gather_from_every_rank(obj: Any, what: str) -> list[Any]:
    """One picklable object per world rank, in rank order, on every rank.

    Used to agree before and after a checkpoint's storage step: a problem one
    rank found (a missing file, a failed rename) becomes an error on every rank.
    """
    group = storage_group()
    if dist.get_world_size(group) == 1:
        return [obj]
    with named(f"checkpoint ({what})", range(dist.get_world_size())):
        return gather_objects(obj, group)
