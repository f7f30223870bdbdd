"""Global tensors: a ``torch.Tensor`` subclass holding this rank's piece of a logical tensor.

``x.to_global(placement, sbp)`` turns a local tensor into a global one;
``g.to_global(...)`` on a global tensor changes its layout (boxing);
``g.to_local()`` returns this rank's piece. Gradients cross the local/global
boundary with the dual layout (see NOTE [gradient duals]).

# NOTE [gradient duals]
# For ``local.to_global(P, sbp)`` the ranks' local gradients are read as
#   split -> split, broadcast -> partial_sum, partial_sum -> broadcast,
# and ``g.to_local()`` reads its local gradients back the same way. The
# backward of boxing boxes the gradient, from whatever layout it arrives in,
# back to the forward input's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from . import _meta_check
from ._compiling import graph_break
from ._global import GlobalTensor, as_global_grad, is_global, keep_grad_layout
from ._layout import Layout, dual_sbp, empty_local_shape, logical_shape_from_locals
from ._lazy_bits import resolved
from .boxing import tracing as _trace
from .comm import collectives
from .comm._mesh import MESHES
from .comm._world import device_for, get_rank, get_world_size
from .placement import Placement
from .sbp import Broadcast, NdSbp, SbpParallel, Split, normalize, sbp_str

__all__ = ["GlobalTensor", "is_global", "keep_grad_layout", "to_global"]


# -- local -> global -----------------------------------------------------------------


class _FromLocal(torch.autograd.Function):
    """Forward: local -> global. Backward: the gradient boxed to the dual layout, its local piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> GlobalTensor:
        ctx.layout = layout
        ctx.input_shape, ctx.input_device = x.shape, x.device
        local = _materialise(x, layout)
        return GlobalTensor(local, layout, shape)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[torch.Tensor, None, None]:
        grad = as_global_grad(grad, "to_global")
        layout = ctx.layout
        dual = dual_sbp(layout.sbp)
        boxed = cast(GlobalTensor, grad.detach()).to_global(
            layout.placement, dual, check_meta=False
        )
        local = boxed._local
        if get_rank() not in layout.placement:
            local = local.new_zeros(ctx.input_shape, device=ctx.input_device)
        return local, None, None


# NOTE [own storage]
# A broadcast global tensor made from a local one gets pieces that own their storage,
# contiguous from offset 0: the rank that sends (or, on a placement of one rank, the only
# one) copies a local tensor that is a view into a larger storage or not contiguous, as the
# ranks that receive get fresh buffers anyway. Storage ops (NOTE [storage ops] in
# sbpflow/ops/storage.py) then find the same storage on every rank: only a global tensor
# that is a view of another has a piece in a larger storage, on every rank alike.
def _own_storage(local: torch.Tensor) -> torch.Tensor:
    owns = (
        local.is_contiguous()
        and local.storage_offset() == 0
        and local.untyped_storage().nbytes() == local.numel() * local.element_size()
    )
    return local if owns else local.clone(memory_format=torch.contiguous_format)


def _materialise(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's local tensor for ``x.to_global(layout)`` (broadcast sends from group heads)."""
    rank = get_rank()
    pl = layout.placement
    b_axes = [a for a, s in enumerate(layout.sbp) if isinstance(s, Broadcast) and pl.shape[a] > 1]
    local = x.detach()
    if rank in pl and all(isinstance(s, Broadcast) for s in layout.sbp):
        local = _own_storage(local)  # NOTE [own storage]
    # From the first rank along the broadcast axes: along all of them at once, or along one
    # after another where the mesh has no group of them together (``Mesh.lines``).
    lines = MESHES.of(pl, "to_global").lines(b_axes) if b_axes else []
    for line_axes, found in lines:
        ranks, _ = found
        # The head only sends (dist.broadcast leaves its buffer untouched).
        buffer = (
            local.contiguous()
            if rank == ranks[0]
            else torch.empty_like(local, memory_format=torch.contiguous_format)
        )
        local = collectives.broadcast(buffer, ranks[0], found)
        _trace.record(None, ["broadcast"], [tuple(b_axes) if len(lines) == 1 else line_axes])
    if rank not in pl:  # empty, on this rank's device of the placement's type
        return local.new_empty(empty_local_shape(local.dim()), device=device_for(pl.type))
    return local


def to_global(
    x: torch.Tensor,
    placement: Placement | None = None,
    sbp: SbpParallel | Sequence[SbpParallel] | None = None,
    *,
    check_meta: bool = True,
    shape: Sequence[int] | None = None,
) -> GlobalTensor:
    """``x.to_global(placement, sbp)`` as a function (see ``torch.Tensor.to_global``)."""
    if isinstance(x, GlobalTensor):
        return x.to_global(placement, sbp, check_meta=check_meta)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_global expects a torch.Tensor, got {type(x).__name__}.")
    if x.layout != torch.strided:
        # Every rank runs this call with the same kind of tensor, so every rank raises here,
        # before any collective (a rank whose data is ignored must not wait for the others).
        raise TypeError(
            f"to_global expects a dense (strided) tensor, got a {x.layout} one. Convert it with "
            "x.to_dense() first: global tensors hold dense local pieces."
        )
    return _from_local(x, placement, sbp, check_meta=check_meta, shape=shape)


_LOCAL_TO_GLOBAL_BREAKS = (
    "sbpflow: a global tensor made from local ones exchanges the ranks' shapes and broadcasts "
    "data, which a graph cannot hold; convert inputs before calling the compiled function."
)


@graph_break(_LOCAL_TO_GLOBAL_BREAKS)
def _from_local(
    x: torch.Tensor,
    placement: Placement | None,
    sbp: SbpParallel | Sequence[SbpParallel] | None,
    *,
    check_meta: bool,
    shape: Sequence[int] | None,
) -> GlobalTensor:
    x = resolved(x)  # NOTE [lazy bits]: a conj/neg view's flag would not reach the locals
    if placement is None or sbp is None:
        raise ValueError(
            "converting a local tensor needs both placement and sbp, e.g. "
            "x.to_global(sbpflow.placement('cpu', [0, 1]), sbpflow.sbp.split(0))."
        )
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: {placement!r}. "
            "Build one with sbpflow.placement('cpu', ranks)."
        )
    rank, world_size = get_rank(), get_world_size()
    error, nd_sbp = _validate_local_args(x, placement, sbp, world_size)
    in_placement = rank in placement
    if in_placement and error is None:
        device = device_for(placement.type)
        if x.device != device:
            x = x.to(device)
    needs_shapes = shape is None and (
        any(isinstance(s, Split) for s in nd_sbp) or placement.num_ranks != world_size
    )
    if check_meta or needs_shapes:
        mine = _meta_check.RankMeta(
            error=error,
            dtype=x.dtype,
            shape=tuple(x.shape),
            placement=repr(placement),
            sbp=sbp_str(nd_sbp) if error is None else repr(sbp),
            in_placement=in_placement,
        )
        gathered = _meta_check.exchange(mine, "to_global", compare_shapes=False)
        if shape is None:
            local_shapes = {r: gathered.shapes[r] for r in placement.flat_ranks}
            shape = logical_shape_from_locals(local_shapes, placement, nd_sbp)
    elif error is not None:
        raise ValueError(error)
    logical = tuple(shape) if shape is not None else tuple(x.shape)
    layout = Layout(placement, nd_sbp)
    MESHES.of(placement, "to_global")  # its groups, made up front on every rank (NOTE [meshes])
    return _FromLocal.apply(x, layout, logical)


def _validate_local_args(
    x: torch.Tensor, placement: Placement, sbp: Any, world_size: int
) -> tuple[str | None, NdSbp]:
    """Errors found in this rank's own arguments (reported on every rank by the meta check)."""
    outside = [r for r in placement.flat_ranks if r >= world_size]
    if outside:
        return (
            f"{placement} names rank(s) {outside} but the world has {world_size} "
            f"rank{'s' if world_size != 1 else ''} "
            f"(0..{world_size - 1}); use ranks that exist or launch more processes.",
            (),
        )
    try:
        return None, normalize(sbp, placement.ndim, x.dim())
    except (TypeError, ValueError) as error:
        return str(error), ()


@graph_break(_LOCAL_TO_GLOBAL_BREAKS)
def tensor_to_global(
    self: torch.Tensor,
    placement: Placement | None = None,
    sbp: SbpParallel | Sequence[SbpParallel] | None = None,
    *,
    check_meta: bool = True,
    shape: Sequence[int] | None = None,
) -> GlobalTensor:
    # ``torch.Tensor.to_global`` (NOTE [what import sbpflow adds to torch] in _install).
    return to_global(self, placement, sbp, check_meta=check_meta, shape=shape)


tensor_to_global.__doc__ = to_global.__doc__
