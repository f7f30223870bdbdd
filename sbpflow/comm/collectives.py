"""Collectives on groups of ranks, with uneven pieces and named failures.

Every function takes ``group``: the tuple of member ranks in mesh order and the
process-group handle from ``_groups.group_of`` (``None`` for one rank). The
bytes move on the group's backend: gloo for CPU tensors, NCCL for CUDA tensors,
on one host or many. Pieces may be uneven (balanced splits); they are padded to
the largest piece for the wire and trimmed after. A failure (a timeout, a peer
that died) is re-raised as ``CollectiveError`` naming the operation and the
ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sbpflow_kernels import pad_chunks

from . import _functional
from ._compat import REDUCE_OPS, all_gather_single, reduce_scatter_single
from ._errors import CollectiveError, named
from ._meta import all_gather_meta, all_gather_object, gather_objects, same_on_every_rank
from ._p2p import exchange

Group = tuple[tuple[int, ...], "dist.ProcessGroup | None"]

__all__ = [
    "CollectiveError",
    "Group",
    "PendingCollective",
    "all_gather",
    "all_gather_async",
    "all_gather_meta",
    "all_gather_object",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "broadcast",
    "exchange",
    "gather_objects",
    "group_slots",
    "reduce_scatter",
    "reduce_scatter_async",
    "same_on_every_rank",
]


# NOTE [one copy at most]
# A layout change that is one collective costs that collective: the wire buffers are
# allocated once, in the collective's layout, and the data is copied only where the
# layout needs it. An even split along dim 0 in process-group order copies nothing
# outside the collective (the input piece is the send buffer, the receive buffer is the
# result; NOTE [gloo gathers and reductions] for what the collective does); an inner
# dim or an uneven split copies each element once on each side of the wire (the
# padding is zero-filled, not concatenated), never a cat followed by a contiguous.


def _dim_first_padded(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` with ``dim`` moved first, zero-padded to ``length`` along it, contiguous: one
    copy, or none for a contiguous piece that needs neither."""
    moved = t.movedim(dim, 0)
    if moved.shape[0] == length:
        return moved.contiguous()
    out = moved.new_empty((length, *moved.shape[1:]))
    out[: moved.shape[0]].copy_(moved)
    out[moved.shape[0] :].zero_()
    return out


def _packed_chunks(
    moved: torch.Tensor, sizes: Sequence[int], longest: int, members: Sequence[int]
) -> torch.Tensor:
    """The chunks of ``moved`` (``sizes[k]`` rows each, dim 0), chunk ``members[slot]`` at
    row ``slot * longest``, zero-padded to ``longest`` rows: one copy of each element."""
    out = moved.new_empty((len(sizes) * longest, *moved.shape[1:]))
    chunks = torch.split(moved, list(sizes), dim=0)
    for slot, k in enumerate(members):
        start = slot * longest
        out[start : start + sizes[k]].copy_(chunks[k])
        if sizes[k] < longest:
            out[start + sizes[k] : start + longest].zero_()
    return out


def all_gather(local: torch.Tensor, dim: int, group: Group, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate the members' pieces along ``dim`` (piece ``k`` has ``sizes[k]``)."""
    ranks, handle = group
    if handle is None:
        return local
    num = len(ranks)
    longest = max(sizes)
    even = all(s == longest for s in sizes)
    slots = _group_slots(ranks)
    if dim != 0 and slots is None and even:
        return _all_gather_inner(local, dim, group)
    piece = _dim_first_padded(local, dim, longest)
    out = piece.new_empty((num * longest, *piece.shape[1:]))
    out = _all_gather_into(out, piece, group)
    if slots is None and even:
        return out if dim == 0 else _merge_leading(out, num, dim)
    # Trim the padding and put the pieces in mesh order: one copy, into the result.
    shape = list(local.shape)
    shape[dim] = sum(sizes)
    result = out.new_empty(shape)
    rows, start = result.movedim(dim, 0), 0
    for k, s in enumerate(sizes):
        slot = k if slots is None else slots[k]
        rows[start : start + s].copy_(out[slot * longest : slot * longest + s])
        start += s
    return result


# NOTE [inner-dim collectives]
# Even all_gather / reduce_scatter along an inner dim (dim > 0) put the pieces
# on the wire in their own layout and interleave them with one copy whose
# contiguous runs are whole rows (prod(shape[dim:]) elements), instead of
# transposing the tensor to put ``dim`` first and back (two element-wise copies).


def _all_gather_inner(local: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    num = len(group[0])
    piece = local.contiguous()
    out = piece.new_empty((num, *piece.shape))  # (member, *local.shape)
    out = _all_gather_into(out, piece, group)
    shape = list(piece.shape)
    shape[dim] *= num
    return out.movedim(0, dim).reshape(shape)  # (..., member, n, ...) -> (..., member * n, ...)


def _reduce_scatter_inner(
    block: torch.Tensor, dim: int, group: Group, reduce_op: str
) -> torch.Tensor:
    num = len(group[0])
    shape = list(block.shape)
    shape[dim : dim + 1] = [num, shape[dim] // num]
    src = block.reshape(shape).movedim(dim, 0).contiguous()  # (member, ..., n, ...)
    out = src.new_empty(src.shape[1:])
    return _reduce_scatter_into(out, src, group, reduce_op)


def _merge_leading(out: torch.Tensor, num: int, dim: int) -> torch.Tensor:
    # out is (num * n, rest...) with dim moved to the front; put the member
    # index next to `dim` and merge them.
    n = out.shape[0] // num
    stacked = out.view(num, n, *out.shape[1:])  # (num, n, rest...)
    moved = stacked.movedim(1, dim + 1).movedim(0, dim)  # (..., num, n, ...)
    shape = list(moved.shape)
    shape[dim : dim + 2] = [num * n]
    return moved.reshape(shape)


def all_reduce(local: torch.Tensor, group: Group, reduce_op: str, inplace: bool) -> torch.Tensor:
    if group[1] is None:
        return local
    if _exchanges_all_reduce(local, group):  # decided the same way on every member
        return _all_reduce_exchanged(local.contiguous(), group, reduce_op)
    if inplace and local.is_contiguous():
        out = local
    else:  # one copy, even from a non-contiguous view
        out = local.clone(memory_format=torch.contiguous_format)
    return _all_reduce_in_place(out, group, reduce_op)


def same_in_group(value: int, group: Group, device: torch.device) -> bool:
    """Whether every rank of ``group`` passed the same int64 ``value``: one all_reduce (MAX)
    of ``[value, -value]`` gives the largest value and minus the smallest, equal only if every
    rank's value is (as ``_meta.same_on_every_rank`` does over the world)."""
    pair = torch.tensor([value, -value], dtype=torch.int64, device=device)
    largest, minus_smallest = all_reduce(pair, group, "max", inplace=True).tolist()
    return largest == -minus_smallest


class PendingCollective:
    """A collective launched with ``async_op=True``; ``wait()`` finishes it and returns its tensor.

    A failure surfaces at ``wait()`` as ``CollectiveError`` naming the operation and the ranks.
    """

    def __init__(self, op: str, ranks: Sequence[int], tensor: torch.Tensor, work: Any) -> None:
        self.op, self.ranks, self.tensor, self._work = op, tuple(ranks), tensor, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with named(self.op, self.ranks):
                self._work.wait()
            self._work = None
        return self.tensor


def all_reduce_async(tensor: torch.Tensor, group: Group, reduce_op: str) -> PendingCollective:
    """Start reducing ``tensor`` (contiguous) in place over the group; returns its handle."""
    ranks, handle = group
    if not tensor.is_contiguous():
        raise ValueError("all_reduce_async reduces in place: pass a contiguous tensor.")
    if handle is None:
        return PendingCollective("all_reduce", ranks, tensor, None)
    with named("all_reduce", ranks):
        work = dist.all_reduce(tensor, op=REDUCE_OPS[reduce_op], group=handle, async_op=True)
    return PendingCollective("all_reduce", ranks, tensor, work)


# NOTE [flat collectives]
# ``all_gather_async`` and ``reduce_scatter_async`` move one flat buffer per call, laid out
# as one row per member in process-group order (``group_slots`` maps a member, in mesh
# order, to its row), every row the same length: the caller packs its tensors into its row
# (or the rows) and unpacks them after ``wait()``. Fully sharded data parallelism gathers a
# block's parameters and reduces its gradients this way, one collective per block, while
# the block before (or after) it computes. A gather may run in place: ``piece`` is then
# the member's own row of ``out`` (the member's copy onto itself is a no-op).


def group_slots(ranks: Sequence[int]) -> list[int]:
    """The row of each member (``ranks``, mesh order) in a flat collective's buffer."""
    return _group_slots(ranks) or list(range(len(ranks)))


def all_gather_async(out: torch.Tensor, piece: torch.Tensor, group: Group) -> PendingCollective:
    """Start gathering every member's ``piece`` into the rows of ``out`` (members x
    ``piece.numel()``, process-group order; both contiguous); ``wait()`` returns ``out``."""
    ranks, handle = group
    _functional.refuse_traced("a fully sharded module's all_gather", piece)
    _check_rows(out, piece, len(ranks), "all_gather_async")
    if handle is None:
        out.view(-1).copy_(piece.view(-1))
        return PendingCollective("all_gather", ranks, out, None)
    with named("all_gather", ranks):
        work = all_gather_single(out.view(-1), piece.view(-1), group=handle, async_op=True)
    return PendingCollective("all_gather", ranks, out, work)


def reduce_scatter_async(
    out: torch.Tensor, block: torch.Tensor, group: Group, reduce_op: str
) -> PendingCollective:
    """Start reducing the members' ``block`` (members x ``out.numel()``, process-group order;
    both contiguous): this member's ``out`` gets the reduction of its row of every
    member's block; ``wait()`` returns ``out``."""
    ranks, handle = group
    _functional.refuse_traced("a fully sharded module's reduce_scatter", block)
    _check_rows(block, out, len(ranks), "reduce_scatter_async")
    if handle is None:
        out.view(-1).copy_(block.view(-1))
        return PendingCollective("reduce_scatter", ranks, out, None)
    with named("reduce_scatter", ranks):
        work = reduce_scatter_single(
            out.view(-1), block.view(-1), op=REDUCE_OPS[reduce_op], group=handle, async_op=True
        )
    return PendingCollective("reduce_scatter", ranks, out, work)


def _check_rows(rows: torch.Tensor, row: torch.Tensor, num: int, what: str) -> None:
    if not (rows.is_contiguous() and row.is_contiguous()) or rows.numel() != num * row.numel():
        raise ValueError(
            f"{what} moves contiguous buffers of one row per member: got {rows.numel()} and "
            f"{row.numel()} elements for {num} members."
        )


def reduce_scatter(
    block: torch.Tensor, dim: int, group: Group, sizes: Sequence[int], reduce_op: str
) -> torch.Tensor:
    """Reduce the members' blocks and give member ``k`` chunk ``k`` along ``dim``."""
    ranks, handle = group
    if handle is None:
        return block
    index = _my_index(ranks)
    longest = max(sizes)
    order = _group_order(ranks)
    if dim != 0 and order is None and all(s == longest for s in sizes):
        return _reduce_scatter_inner(block, dim, group, reduce_op)
    moved = block.movedim(dim, 0)
    if order is None and all(s == longest for s in sizes):
        src = moved.contiguous()  # dim 0 here: no copy of a contiguous block
    elif order is None and dim == 0 and block.is_cuda:
        src = pad_chunks(moved, sizes)  # one kernel with CuPy (sbpflow_kernels)
    else:
        src = _packed_chunks(moved, sizes, longest, order or range(len(ranks)))
    out = src.new_empty((longest, *src.shape[1:]))
    out = _reduce_scatter_into(out, src, group, reduce_op)
    out = out[: sizes[index]]
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_to_all(
    local: torch.Tensor,
    src_dim: int,
    dst_dim: int,
    group: Group,
    src_sizes: Sequence[int],
    dst_sizes: Sequence[int],
) -> torch.Tensor:
    """Turn a split along ``src_dim`` into a split along ``dst_dim`` within the group.

    Member ``k`` holds piece ``k`` along ``src_dim`` (``src_sizes[k]`` long) and
    ends with chunk ``k`` along ``dst_dim`` (``dst_sizes[k]`` long) of the whole.
    """
    ranks, handle = group
    if handle is None:
        return local
    index = _my_index(ranks)
    order = _group_order(ranks)
    members = order or list(range(len(ranks)))  # member at each process-group slot
    chunks = torch.split(local, list(dst_sizes), dim=dst_dim)
    send_chunks = [chunks[k] for k in members]
    if order is None and local.is_contiguous() and all(n == 1 for n in local.shape[:dst_dim]):
        send = local.view(-1)  # the chunks lie one after another already: no copy
    else:
        send = _pack(send_chunks, local)
    recv_shapes = []
    for k in members:
        shape = list(local.shape)
        shape[src_dim] = src_sizes[k]
        shape[dst_dim] = dst_sizes[index]
        recv_shapes.append(shape)
    recv_numels = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = local.new_empty(sum(recv_numels))
    send_numels = [c.numel() for c in send_chunks]
    recv = _all_to_all_into(recv, send, recv_numels, send_numels, group)
    if src_dim == 0 and order is None:
        shape = list(recv_shapes[0])
        shape[0] = sum(src_sizes)
        return recv.view(shape)
    received = [p.view(s) for p, s in zip(torch.split(recv, recv_numels), recv_shapes, strict=True)]
    pieces = [received[slot] for slot in _group_slots(ranks) or range(len(ranks))]
    return torch.cat(pieces, dim=src_dim)


def _pack(chunks: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The chunks flattened one after another into a new buffer: one copy.

    (``torch.cat`` of ``c.reshape(-1)`` would copy a non-contiguous chunk twice.)
    """
    send = like.new_empty(sum(c.numel() for c in chunks))
    offset = 0
    for c in chunks:
        send[offset : offset + c.numel()].view(c.shape).copy_(c)
        offset += c.numel()
    return send


def broadcast(buffer: torch.Tensor, src_rank: int, group: Group) -> torch.Tensor:
    """Overwrite ``buffer`` on every member with ``src_rank``'s (in place)."""
    ranks, handle = group
    if handle is None:
        return buffer
    if _functional.traced(buffer):
        return _functional.broadcast(buffer, src_rank, handle)
    with named("broadcast", ranks):
        dist.broadcast(buffer, src=src_rank, group=handle)
    return buffer


# -- the process-group calls (pieces in process-group order, tensors contiguous) ---------
# Each fills its ``out`` buffer and returns it; inside a torch.compile trace it
# returns the functional collective's new tensor instead (NOTE [traced collectives]).


def _all_gather_into(out: torch.Tensor, piece: torch.Tensor, group: Group) -> torch.Tensor:
    """``out`` (members x ``piece``, in process-group order) gets every member's ``piece``."""
    ranks, handle = group
    assert handle is not None
    if _functional.traced(piece):
        return _functional.all_gather(piece.view(-1), handle).view(out.shape)
    if len(ranks) == 2 and piece.device.type == "cpu" and piece.numel():
        # NOTE [gloo gathers and reductions]
        rows, slot = out.view(2, -1), handle.rank()
        splits = [piece.numel() * (k != slot) for k in range(2)]
        _exchange_rows(rows[1 - slot], piece.view(-1), splits, group, "all_gather")
        with torch.no_grad():  # a collective, not differentiable: as gloo's own gather
            rows[slot].copy_(piece.view(-1))
        return out
    with named("all_gather", ranks):
        all_gather_single(out.view(-1), piece.view(-1), group=handle)
    return out


def _reduce_scatter_into(
    out: torch.Tensor, block: torch.Tensor, group: Group, reduce_op: str
) -> torch.Tensor:
    """``out`` gets the reduction of this member's piece (process-group order) of every ``block``."""
    ranks, handle = group
    assert handle is not None
    if _functional.traced(block):
        return _functional.reduce_scatter(block.view(-1), handle, reduce_op).view(out.shape)
    if block.device.type == "cpu":  # NOTE [gloo gathers and reductions]
        return _reduce_scatter_exchanged(out, block, group, reduce_op)
    with named("reduce_scatter", ranks):
        reduce_scatter_single(out.view(-1), block.view(-1), op=REDUCE_OPS[reduce_op], group=handle)
    return out


# NOTE [gloo gathers and reductions]
# torch's gloo backend has no reduce_scatter of its own: ``reduce_scatter_tensor`` clones
# the whole block, all_reduces the clone (every element crosses the wire twice) and copies
# this member's chunk out of it. Its ``all_gather_into_tensor`` gathers into a flat buffer
# of its own and copies that into the output. On gloo (CPU tensors) sbpflow runs both as
# one ``all_to_all_single``, whose pairwise exchanges read and write the tensors given:
# - reduce_scatter: each member sends every other member that member's row of its block
#   and receives their rows for its own; it reduces them, in process-group order, into
#   ``out``. (p - 1) / p of the block crosses the wire, once, and nothing is cloned. A
#   member whose row lies between two others' sends the whole block, its own row included
#   (gloo copies that one locally), so that the rows it sends stay one buffer.
# - all_gather of two members: each sends its piece to the other, received straight into
#   the other's row of ``out``, and copies its own piece into its row. (With more
#   members the send buffer would hold the piece once per peer: gloo's gather runs.)
# - all_reduce of two members into a new tensor, from ``EXCHANGED_ALL_REDUCE_BYTES`` up: a
#   reduce_scatter and an all_gather, both exchanges inside the result. The other
#   member's partial of this member's half lands in the result's other half, is reduced
#   with this member's partial into this half, and the other half is then overwritten by
#   the other member's reduced half: no clone of the source (which gloo's in-place
#   all_reduce needs to leave it as it was), and fewer bytes touched.
# NCCL's collectives, and the functional ones inside a trace, run as they are.

# Below this size the second collective's latency costs more than the clone it saves
# (2 gloo ranks over loopback on a busy 2-core machine, fastest of 40: 1 MiB 1.0 ms with
# the clone vs 1.4 ms exchanged, 4 MiB 4.4 vs 3.7 ms; at 64 MiB 7-22% less CPU time).
EXCHANGED_ALL_REDUCE_BYTES = 4 * 2**20


def _exchanges_all_reduce(local: torch.Tensor, group: Group) -> bool:
    """Whether ``all_reduce`` runs as two exchanges into a new tensor (NOTE [gloo gathers
    and reductions]): two members on gloo, a tensor in two equal halves, large. Only facts
    every member shares decide it (not whether this rank may write into its tensor, nor
    its strides): members running different protocols would hang."""
    return (
        len(group[0]) == 2
        and local.device.type == "cpu"
        and local.numel() % 2 == 0
        and local.numel() * local.element_size() >= EXCHANGED_ALL_REDUCE_BYTES
        and not _functional.traced(local)
    )


def _all_reduce_exchanged(local: torch.Tensor, group: Group, reduce_op: str) -> torch.Tensor:
    handle = group[1]
    assert handle is not None
    slot = handle.rank()
    other = 1 - slot
    out = local.new_empty(local.shape)
    rows, partial = out.view(2, -1), local.view(2, -1)  # one half per member, group order
    splits = [rows.shape[1] * (k != slot) for k in range(2)]
    _exchange_rows(rows[other], partial[other], splits, group, "all_reduce")
    with torch.no_grad():  # a collective, not differentiable: as gloo's own reduction
        _REDUCE[reduce_op](partial[slot], rows[other], out=rows[slot])
    _exchange_rows(rows[other], rows[slot], splits, group, "all_reduce")
    return out


_REDUCE: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "max": torch.maximum}


def _reduce_scatter_exchanged(
    out: torch.Tensor, block: torch.Tensor, group: Group, reduce_op: str
) -> torch.Tensor:
    ranks, handle = group
    assert handle is not None
    num, slot, n = len(ranks), handle.rank(), out.numel()
    if n == 0:  # every member's row is empty (the rows are equally long): nothing to move
        return out
    rows = block.view(num, n)  # one row per member, process-group order
    own_apart = slot in (0, num - 1)  # the other members' rows lie one after another
    send = (rows[1:] if slot == 0 else rows[:-1]) if own_apart else rows
    splits = [n * (k != slot or not own_apart) for k in range(num)]
    received = block.new_empty((send.shape[0], n))
    _exchange_rows(received.view(-1), send.reshape(-1), splits, group, "reduce_scatter")
    parts = list(received.unbind(0))
    if own_apart:
        parts.insert(slot, rows[slot])
    reduce, flat = _REDUCE[reduce_op], out.view(-1)
    with torch.no_grad():  # a collective, not differentiable: as gloo's own reduction
        reduce(parts[0], parts[1], out=flat)
        for part in parts[2:]:
            reduce(flat, part, out=flat)
    return out


def _exchange_rows(
    recv: torch.Tensor, send: torch.Tensor, splits: list[int], group: Group, op: str
) -> None:
    """Element ``splits[k]``-long slice ``k`` of flat ``send`` to the member at process-group
    slot ``k``, and as long a slice from it into ``recv`` (``splits`` is the same both ways)."""
    ranks, handle = group
    with named(op, ranks):
        dist.all_to_all_single(recv, send, splits, splits, group=handle)


def _all_reduce_in_place(tensor: torch.Tensor, group: Group, reduce_op: str) -> torch.Tensor:
    ranks, handle = group
    assert handle is not None
    if _functional.traced(tensor):
        return _functional.all_reduce(tensor, handle, reduce_op)
    with named("all_reduce", ranks):
        dist.all_reduce(tensor, op=REDUCE_OPS[reduce_op], group=handle)
    return tensor


def _all_to_all_into(
    recv: torch.Tensor,
    send: torch.Tensor,
    recv_numels: list[int],
    send_numels: list[int],
    group: Group,
) -> torch.Tensor:
    """Piece ``k`` of ``send`` to member ``k`` (process-group order)."""
    ranks, handle = group
    assert handle is not None
    if _functional.traced(send):
        return _functional.all_to_all(send, recv_numels, send_numels, handle)
    with named("all_to_all", ranks):
        dist.all_to_all_single(recv, send, recv_numels, send_numels, group=handle)
    return recv


# NOTE [member order]
# ``ranks`` lists a group's members in mesh order, which is the order pieces
# are concatenated in. ``torch.distributed.new_group`` numbers its ranks in
# sorted order instead, so for a mesh like [[2, 3], [0, 1]] the process-group
# slot of a member differs from its position; the helpers below translate.


def _group_order(ranks: Sequence[int]) -> list[int] | None:
    """The member (mesh position) at each process-group slot; ``None`` when they agree."""
    order = sorted(range(len(ranks)), key=lambda k: ranks[k])
    return None if order == list(range(len(ranks))) else order


def _group_slots(ranks: Sequence[int]) -> list[int] | None:
    """The process-group slot of each member; ``None`` when they agree."""
    order = _group_order(ranks)
    if order is None:
        return None
    slots = [0] * len(ranks)
    for slot, member in enumerate(order):
        slots[member] = slot
    return slots


def _my_index(ranks: Sequence[int]) -> int:
    return list(ranks).index(dist.get_rank())
