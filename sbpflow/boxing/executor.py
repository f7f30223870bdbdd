"""Runs a boxing plan on this rank's local tensor. The only boxing code that communicates.

Every rank runs every step of the same plan (ranks outside a step's groups
still take part in creating the groups, see NOTE [group creation order]), so
ranks never diverge in which collectives they enter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._bounded import BoundedDict
from .._layout import Layout, box_shape, empty_local_shape, member_sizes, relative
from ..comm import _functional, collectives
from ..comm._mesh import MESHES
from ..sbp import Partial, Split
from . import tracing as _trace
from ._transfer import transfer_pieces
from .plan import BoxingPlan, BoxingStep

# NOTE [transports]
# A change of placement hands its messages to a transport: called with the sends
# ``(peer, tensor)``, the receives ``(peer, buffer)``, the device type and every rank of
# both placements, it returns once each buffer holds its message (a send may still be in
# flight, if the transport keeps the tensor alive until it completes). Every rank calls
# it, with or without pieces to move. The default is ``collectives.exchange`` (one batch
# on a group of those ranks); a caller that orders its messages itself passes another.
Transport = Callable[
    [Sequence[tuple[int, torch.Tensor]], Sequence[tuple[int, torch.Tensor]], str, tuple[int, ...]],
    None,
]


def execute(
    plan: BoxingPlan, local: torch.Tensor, rank: int, transport: Transport | None = None
) -> torch.Tensor:
    """Turn this rank's ``local`` piece of ``plan.src`` into its piece of ``plan.dst``.

    ``local`` is never modified in place. Transfers between placements go through
    ``transport`` (NOTE [transports]).
    """
    owned = False  # whether `local` is a buffer this plan made (safe to reuse)
    ran: list[str] = []
    ran_axes: list[tuple[int, ...]] = []
    for step in plan.steps:
        before = local
        local, took_part = _run_step(step, plan.shape, local, rank, owned, transport)
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
    transport: Transport | None = None,
) -> tuple[torch.Tensor, bool]:
    if not step.axes:  # send_recv or copy between placements
        return _run_transfer(step, shape, local, rank, transport), True
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


# NOTE [transfer routes]
# What a rank sends and receives in one transfer depends only on the two layouts, the
# logical shape and the rank: which slices of its piece go to which peers, which boxes
# arrive from which peers and where they land. A training loop makes the same transfers
# step after step, so that geometry is worked out once and kept as a ``_Route``; a
# transfer then only slices, allocates and hands the messages to its transport.
# The buffer a rank receives into is filled with zeros first unless one message covers
# all of it (a partial-sum destination's other ranks keep zeros, NOTE in _transfer.py).


@dataclass(frozen=True)
class _Route:
    out_shape: tuple[int, ...] | None  # this rank's piece of dst; None: not in dst
    copies: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]  # (from src, into out)
    sends: tuple[tuple[int, tuple[slice, ...]], ...]  # (peer, slice of this rank's piece)
    # (peer, the box's shape, where it lands in out; None: the box is all of out)
    recvs: tuple[tuple[int, tuple[int, ...], tuple[slice, ...] | None], ...]
    members: tuple[int, ...]  # every rank of both placements, sorted

    @property
    def fills_out(self) -> bool:
        """Whether the messages write every element of out (no zeros needed)."""
        return not self.copies and len(self.recvs) == 1 and self.recvs[0][2] is None


ROUTES_BOUND = 4096
_routes: BoundedDict[tuple[Any, ...], _Route] = BoundedDict("transfer routes", ROUTES_BOUND)


def _route(src: Layout, dst: Layout, shape: tuple[int, ...], rank: int) -> _Route:
    key = (src, dst, shape, rank)
    found = _routes.get(key)
    if found is not None:
        return found
    src_box = src.box(shape, rank) if rank in src.placement else None
    dst_box = dst.box(shape, rank) if rank in dst.placement else None
    out_shape = box_shape(dst_box) if dst_box is not None else None
    copies, sends, recvs = [], [], []
    for piece in transfer_pieces(shape, src, dst):
        if rank == piece.src_rank:
            assert src_box is not None
            taken = relative(piece.box, src_box)
            if rank == piece.dst_rank:
                assert dst_box is not None
                copies.append((taken, relative(piece.box, dst_box)))
            else:
                sends.append((piece.dst_rank, taken))
        elif rank == piece.dst_rank:
            assert dst_box is not None
            whole = box_shape(piece.box) == out_shape
            recvs.append(
                (
                    piece.src_rank,
                    box_shape(piece.box),
                    None if whole else relative(piece.box, dst_box),
                )
            )
    members = tuple(sorted(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks)))
    route = _routes[key] = _Route(out_shape, tuple(copies), tuple(sends), tuple(recvs), members)
    return route


def _run_transfer(
    step: BoxingStep,
    shape: tuple[int, ...],
    local: torch.Tensor,
    rank: int,
    transport: Transport | None = None,
) -> torch.Tensor:
    src, dst = step.src, step.dst
    if _functional.traced(local):  # the message only then: describing layouts costs
        _functional.refuse_traced(f"boxing from {src.describe()} to {dst.describe()}", local)
    if src.placement.type != dst.placement.type:
        raise NotImplementedError(
            f"the executor boxes between placements of one device type, got {src.placement} -> "
            f"{dst.placement}; GlobalTensor.to_global moves the tensor to the other type first "
            "(g.to(device_type): the same ranks and SBP, a local copy) and then boxes it."
        )
    route = _route(src, dst, tuple(shape), rank)  # NOTE [transfer routes]
    out = None
    if route.out_shape is not None:
        make = local.new_empty if route.fills_out else local.new_zeros
        out = make(route.out_shape)
        for taken, placed in route.copies:
            out[placed] = local[taken]
    sends = [(peer, local[taken]) for peer, taken in route.sends]
    buffers: list[tuple[int, torch.Tensor]] = []
    landing: list[tuple[tuple[slice, ...], torch.Tensor]] = []  # received elsewhere than out
    for peer, box, into in route.recvs:
        assert out is not None
        if into is None:
            buffers.append((peer, out))
        else:
            buffers.append((peer, local.new_empty(box)))
            landing.append((into, buffers[-1][1]))
    (transport or collectives.exchange)(sends, buffers, dst.placement.type, route.members)
    for into, buffer in landing:
        assert out is not None
        out[into] = buffer
    if out is None:
        return local.new_empty(empty_local_shape(len(shape)))
    return out
