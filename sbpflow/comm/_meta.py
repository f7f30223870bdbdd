"""Small collectives over the world, for the metadata check, on a gloo group of their own.

# NOTE [meta check collectives]
# Every checked ``to_global`` makes one of these calls, so each is a single
# small collective, chosen by timing the candidates (bench/meta_check/run.py
# --candidates, 2 and 4 gloo ranks on one 2-core host; medians):
#   - ``same_on_every_rank`` (global -> global: the whole vector must match)
#     all-reduces ``[h, -h]`` with MAX for a hash ``h`` of the vector: the
#     ranks agree iff max(h) == min(h). Against an all_to_all of one int64 it
#     is a little slower on 2 ranks (0.18-0.21 ms against 0.13-0.18 ms) and
#     2-4x faster on 4 (0.8-1.1 ms against 2.1-4.0 ms); all_gather was slower
#     than both. Its payload does not grow with the world.
#   - ``all_gather_meta`` (local -> global: the ranks' shapes may differ, so
#     every vector is needed) is an all_to_all of the vector repeated once per
#     rank: one message to each peer, all at once, where gloo's ring
#     all_gather takes world - 1 hops in sequence; it beat all_gather and an
#     all_reduce (SUM) of a world x width table with one row set per rank.
# Both are bounded by the group's timeout (SBPFLOW_TIMEOUT). Only a mismatch
# pays for ``all_gather_object`` (pickles), to word the error.
#
# NOTE [control group]
# These checks run on a gloo group of their own over the world (the control
# group, made on every rank when the world is set up), not on the world group
# that boxing uses. gloo pairs the k-th collective of one rank with the k-th of
# its peers on the same group, whatever they are: two ranks in collectives of
# different sizes on one group make gloo abort the process
# ("op.preamble.length <= op.nbytes"), with no message. A rank in a check
# (``loss.item()`` under ``if rank == 0``) while a peer boxes an op's inputs
# then only waits, on another group, and both fail cleanly at the timeout.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._compat import all_gather_single
from ._errors import named
from ._world import ensure_initialized, new_group, on_teardown, on_world_ready

_control: dict[str, dist.ProcessGroup | None] = {}


def _make_control_group() -> None:
    world = dist.get_world_size()
    _control["cpu"] = None if world == 1 else new_group(range(world), "gloo")


on_world_ready(_make_control_group)
on_teardown(_control.clear)  # NOTE [teardown]


def control_group() -> dist.ProcessGroup | None:
    """The checks' gloo group over every rank (NOTE [control group]); None in a world of one."""
    if "cpu" not in _control:
        ensure_initialized()  # runs _make_control_group on first use (NOTE [world ready])
    return _control.get("cpu")


def all_gather_meta(values: Sequence[int]) -> list[list[int]]:
    """Gather one vector of int64 values per world rank, in rank order."""
    handle = control_group()
    if handle is None:
        return [list(values)]
    world = dist.get_world_size()
    width = len(values)
    vector = torch.tensor(values, dtype=torch.int64)
    out = vector.new_empty(world * width)
    with named("metadata check (all_gather)", range(world)):
        dist.all_to_all_single(out, vector.repeat(world), group=handle)
    return out.view(world, width).tolist()


def same_on_every_rank(value: int) -> bool:
    """Whether every world rank passed the same int64 ``value`` (a hash of its metadata).

    One all_reduce (MAX) of ``[value, -value]``: it gives the largest value
    and minus the smallest, equal on every rank, and they match only if
    every rank passed the same value.
    """
    handle = control_group()
    if handle is None:
        return True
    pair = torch.tensor([value, -value], dtype=torch.int64)
    with named("metadata check (all_reduce)", range(dist.get_world_size())):
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=handle)
    largest, minus_smallest = pair.tolist()
    return largest == -minus_smallest


def all_gather_object(obj: object) -> list:
    """Gather one picklable object per world rank (slow path, for error reports)."""
    handle = control_group()
    if handle is None:
        return [obj]
    with named("metadata check (all_gather_object)", range(dist.get_world_size())):
        return gather_objects(obj, handle)


def gather_objects(obj: object, handle: dist.ProcessGroup) -> list:
    """``torch.distributed.all_gather_object`` without numpy (not a dependency; torch's needs it).

    Two fixed-shape all_gathers over ``handle``: the pickled sizes, then the
    pickles padded to the longest.
    """
    world = dist.get_world_size(handle)
    payload = pickle.dumps(obj)
    mine = torch.zeros(1, dtype=torch.int64)
    mine[0] = len(payload)
    sizes = mine.new_empty(world)
    all_gather_single(sizes, mine, group=handle)
    lengths = sizes.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = padded.new_empty((world, padded.numel()))
    all_gather_single(rows.view(-1), padded, group=handle)
    return [pickle.loads(bytes(rows[r, :n].tolist())) for r, n in enumerate(lengths)]
