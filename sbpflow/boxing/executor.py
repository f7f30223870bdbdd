"""Runs a boxing plan on this rank's local tensor. The only boxing code that communicates.

Every rank runs every step of the same plan (ranks outside a step's groups
still take part in creating the groups, see NOTE [group creation order]), so
ranks never diverge in which collectives they enter.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .._layout import Layout, box_shape, empty_local_shape, member_sizes, relative
from ..comm import _functional, collectives
from ..comm._mesh import MESHES
from ..sbp import Partial, Split
from . import tracing as _trace
from ._transfer import transfer_pieces
from .plan import BoxingPlan, BoxingStep


def execute(
    plan: BoxingPlan, local: torch.Tensor, rank: int, lane: tuple[Hashable, int] | None = None
) -> torch.Tensor:
    """Turn this rank's ``local`` piece of ``plan.src`` into its piece of ``plan.dst``.

    ``local`` is never modified in place. Transfers between placements go on
    ``lane`` (NOTE [lanes] in sbpflow/comm/_p2p.py).
    """
    owned = False  # whether `local` is a buffer this plan made (safe to reuse)
    ran: list[str] = []
    ran_axes: list[tuple[int, ...]] = []
    for step in plan.steps:
        before = local
        local, took_part = _run_step(step, plan.shape, local, rank, owned, lane)
        # A slice is a view: of the caller's tensor until some step made a buffer.
        owned = owned or (local is not before and step.op != "slice")
        if took_part:
            ran.append(step.op)
            ran_axes.append(step.axes)
    if not _functional.traced(local):  # a compiled graph records nothing (docs/compile.md)
        _trace.record(plan, ran, ran_axes)
    if not plan.steps or not owned:
        # No step produced a fresh buffer (identity plan, or only views): the
        # result must not alias the caller's tensor.
        local = local.clone() if local.numel() else local
    if rank not in plan.dst.placement:
        local = local.new_empty(empty_local_shape(len(plan.shape)))
    return local


def _run_step(
    step: BoxingStep,
    shape: tuple[int, ...],
    local: torch.Tensor,
    rank: int,
    owned: bool,
    lane: tuple[Hashable, int] | None = None,
) -> tuple[torch.Tensor, bool]:
    if not step.axes:  # send_recv or copy between placements
        return _run_transfer(step, shape, local, rank, lane), True
    src, dst = step.src, step.dst
    pl = src.placement
    # One group per combination of the other axes' coordinates; with several
    # axes (NOTE [merged axes] in planner.py) members are in row-major mesh order.
    found = MESHES.of(pl, "boxing").group(step.axes)
    if found is None:
        return local, False
    group = found
    members = group[0]
    before, after = src.sbp[step.axes[0]], dst.sbp[step.axes[0]]
    op = step.op
    if op == "all_gather":
        assert isinstance(before, Split)
        sizes = member_sizes(shape, src, members, before.dim)
        return collectives.all_gather(local, before.dim, group, sizes), True
    if op == "all_reduce":
        assert isinstance(before, Partial)
        return collectives.all_reduce(local, group, before.reduce_op, inplace=owned), True
    if op == "reduce_scatter":
        assert isinstance(before, Partial) and isinstance(after, Split)
        sizes = member_sizes(shape, dst, members, after.dim)
        return collectives.reduce_scatter(local, after.dim, group, sizes, before.reduce_op), True
    if op == "all_to_all":
        assert isinstance(before, Split) and isinstance(after, Split)
        src_sizes = member_sizes(shape, src, members, before.dim)
        dst_sizes = member_sizes(shape, dst, members, after.dim)
        out = collectives.all_to_all(local, before.dim, after.dim, group, src_sizes, dst_sizes)
        return out, True
    if op == "slice":
        return local[relative(dst.box(shape, rank), src.box(shape, rank))], True
    if op == "zero":
        return _zero(shape, local, src, dst, step.axes, rank), True
    raise AssertionError(f"unknown boxing op {op!r}")


def _zero(
    shape: tuple[int, ...],
    local: torch.Tensor,
    src: Layout,
    dst: Layout,
    axes: tuple[int, ...],
    rank: int,
) -> torch.Tensor:
    """B -> P keeps the data on the group's first rank; S -> P zero-pads the shard."""
    after = dst.sbp[axes[0]]
    assert isinstance(after, Partial)
    fill = after.identity(local.dtype)
    coords = src.placement.coords_of(rank)
    if isinstance(src.sbp[axes[0]], Split):
        src_box, dst_box = src.box(shape, rank), dst.box(shape, rank)
        out = local.new_full(box_shape(dst_box), fill)
        out[relative(src_box, dst_box)] = local
        return out
    if after.reduce_op == "max" or all(coords[a] == 0 for a in axes):
        return local
    return torch.zeros_like(local)


def _run_transfer(
    step: BoxingStep,
    shape: tuple[int, ...],
    local: torch.Tensor,
    rank: int,
    lane: tuple[Hashable, int] | None = None,
) -> torch.Tensor:
    src, dst = step.src, step.dst
    _functional.refuse_traced(f"boxing from {src.describe()} to {dst.describe()}", local)
    if src.placement.type != dst.placement.type:
        raise NotImplementedError(
            f"the executor boxes between placements of one device type, got {src.placement} -> "
            f"{dst.placement}; GlobalTensor.to_global moves the tensor to the other type first "
            "(g.to(device_type): the same ranks and SBP, a local copy) and then boxes it."
        )
    pieces = transfer_pieces(shape, src, dst)
    src_box = src.box(shape, rank) if rank in src.placement else None
    dst_box = dst.box(shape, rank) if rank in dst.placement else None
    out = local.new_zeros(box_shape(dst_box)) if dst_box is not None else None
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor, tuple[slice, ...]]] = []
    for piece in pieces:
        if rank == piece.src_rank:
            assert src_box is not None
            data = local[relative(piece.box, src_box)]
            if rank == piece.dst_rank:
                assert out is not None and dst_box is not None
                out[relative(piece.box, dst_box)] = data
            else:
                sends.append((piece.dst_rank, data))
        elif rank == piece.dst_rank:
            assert out is not None and dst_box is not None
            target = relative(piece.box, dst_box)
            whole = box_shape(piece.box) == tuple(out.shape)
            recvs.append(
                (piece.src_rank, out if whole else out.new_empty(box_shape(piece.box)), target)
            )
    involved = set(src.placement.flat_ranks) | set(dst.placement.flat_ranks)
    buffers = [(peer, buffer) for peer, buffer, _ in recvs]
    collectives.exchange(sends, buffers, dst.placement.type, sorted(involved), lane)
    for _, buffer, target in recvs:
        if buffer is not out:
            assert out is not None
            out[target] = buffer
    if out is None:
        return local.new_empty(empty_local_shape(len(shape)))
    return out
