"""Moving a group's bytes: through a shared-memory arena on one host, else the process group.

The tensor-in, tensor-out primitives that ``collectives`` builds on (pieces
in process-group order, tensors contiguous), and ``gather_objects``, which
always talks through the process group.

# NOTE [collective transports]
# On the CPU, a group whose members share one host moves data through a
# shared-memory arena (NOTE [shared-memory collectives]); every other group,
# and CUDA tensors, go through the process group (gloo, NCCL). The arena of a
# group is set up at the group's first collective, by a collective over the
# group, and regrown (up to ``_shared_arena.MAX_SLOT_BYTES`` per slot) when a
# collective needs more: what it needs is computed from sizes every member
# knows, so the members agree on when to regrow without talking.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator

import torch
import torch.distributed as dist

from . import _shared_arena
from ._errors import named
from ._world import timeout_seconds

Group = tuple[tuple[int, ...], "dist.ProcessGroup | None"]

# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

_arenas: dict[tuple[int, ...], _shared_arena.SharedArena | None] = {}
_process_group_only = False


@contextlib.contextmanager
def process_group_only() -> Iterator[None]:
    """Within: every collective goes through the process group, arena or not.

    Every rank must enter and leave it at the same points (the transport of a
    collective must be the same on all its members). Benchmarks use it to
    time both transports in one run.
    """
    global _process_group_only
    before, _process_group_only = _process_group_only, True
    try:
        yield
    finally:
        _process_group_only = before


def _arena_for(group: Group, like: torch.Tensor, need: int) -> _shared_arena.SharedArena | None:
    """The group's arena, grown to hold ``need`` bytes per member; ``None``: use the group."""
    ranks, handle = group
    if like.device.type != "cpu" or _process_group_only or handle is None:
        return None
    key = tuple(sorted(ranks))
    arena = _arenas.get(key, ...)
    if arena is None:
        return None
    slot_bytes = _shared_arena.slot_bytes_for(need)
    if arena is ... or arena.slot_bytes < slot_bytes:
        grown = _shared_arena.open_for_group(handle, key, slot_bytes, gather_objects)
        if arena is not ...:
            arena.close()
        _arenas[key] = arena = grown
    return arena


def all_gather_into(out: torch.Tensor, piece: torch.Tensor, group: Group) -> None:
    """``out`` (members x ``piece``, in process-group order) gets every member's ``piece``."""
    ranks, handle = group
    with named("all_gather", ranks):
        arena = _arena_for(group, piece, piece.numel() * piece.element_size())
        if arena is not None:
            arena.all_gather(out, piece, timeout_seconds())
        else:
            _all_gather_single(out.view(-1), piece.view(-1), group=handle)


def reduce_scatter_into(
    out: torch.Tensor, block: torch.Tensor, group: Group, reduce_op: str
) -> None:
    """``out`` gets the reduction of this member's piece (process-group order) of every ``block``."""
    ranks, handle = group
    with named("reduce_scatter", ranks):
        need = _shared_arena.segmented_need(len(ranks), out.numel() * out.element_size())
        arena = _arena_for(group, block, need)
        if arena is not None:
            arena.reduce_scatter(out, block, reduce_op, timeout_seconds())
        else:
            op = _REDUCE_OPS[reduce_op]
            _reduce_scatter_single(out.view(-1), block.view(-1), op=op, group=handle)


def all_reduce_in_place(tensor: torch.Tensor, group: Group, reduce_op: str) -> None:
    ranks, handle = group
    with named("all_reduce", ranks):
        arena = _arena_for(group, tensor, tensor.numel() * tensor.element_size())
        if arena is not None:
            arena.all_reduce(tensor, reduce_op, timeout_seconds())
        else:
            dist.all_reduce(tensor, op=_REDUCE_OPS[reduce_op], group=handle)


def all_to_all_into(
    recv: torch.Tensor,
    send: torch.Tensor,
    recv_numels: list[int],
    send_numels: list[int],
    largest: int,
    group: Group,
) -> None:
    """Piece ``k`` of ``send`` to member ``k``; ``largest``: the most items any member sends
    to any other (the same on every member, unlike the numels)."""
    ranks, handle = group
    with named("all_to_all", ranks):
        need = _shared_arena.segmented_need(len(ranks), largest * send.element_size())
        arena = _arena_for(group, send, need)
        if arena is not None:
            arena.all_to_all(recv, send, recv_numels, send_numels, timeout_seconds())
        else:
            dist.all_to_all_single(recv, send, recv_numels, send_numels, group=handle)


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
    _all_gather_single(sizes, mine, group=handle)
    lengths = sizes.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = padded.new_empty((world, padded.numel()))
    _all_gather_single(rows.view(-1), padded, group=handle)
    return [pickle.loads(bytes(rows[r, :n].tolist())) for r, n in enumerate(lengths)]
