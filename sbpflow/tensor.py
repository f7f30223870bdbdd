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

from . import _devices, _dispatch, _meta_check, _saving, _step_context
from ._bounded import BoundedDict
from ._compiling import graph_break
from ._global import GlobalTensor, as_global_grad, bind_dispatcher, is_global, keep_grad_layout
from ._layout import Layout, empty_local_shape, logical_shape_from_locals
from ._lazy_bits import resolved
from ._printing import global_format, global_repr, logical_value
from .boxing import tracing as _trace
from .boxing._redistribute import Redistribute, box_below_autograd
from .comm import _groups, collectives
from .comm._world import device_for, get_rank, get_world_size
from .placement import Placement
from .sbp import Broadcast, NdSbp, Partial, SbpParallel, Split, normalize, sbp_str

__all__ = ["GlobalTensor", "is_global", "keep_grad_layout", "to_global"]


# -- global -> global (boxing) and global -> local: methods of GlobalTensor ----------


def _to_global_method(
    self: GlobalTensor,
    placement: Placement | None = None,
    sbp: SbpParallel | Sequence[SbpParallel] | None = None,
    *,
    check_meta: bool = True,
) -> GlobalTensor:
    """Change the layout (boxing); the logical value stays the same. Differentiable."""
    if torch.compiler.is_compiling():
        return _box_between_graphs(self, placement, sbp, check_meta=check_meta)
    return _box(self, placement, sbp, check_meta=check_meta)


@graph_break(
    "sbpflow: to_global on a global tensor runs between graphs; the boxing the ops inside a "
    "compiled function need is compiled into its graph."
)
def _box_between_graphs(
    self: GlobalTensor,
    placement: Placement | None,
    sbp: SbpParallel | Sequence[SbpParallel] | None,
    *,
    check_meta: bool,
) -> GlobalTensor:
    return _box(self, placement, sbp, check_meta=check_meta)


def _box(
    self: GlobalTensor,
    placement: Placement | None,
    sbp: SbpParallel | Sequence[SbpParallel] | None,
    *,
    check_meta: bool,
) -> GlobalTensor:
    if placement is not None and not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}. Build one with sbpflow.placement('cpu', ranks)."
        )
    if placement is None:
        placement = self.placement
    if sbp is None:
        if placement.ndim != self.placement.ndim:
            raise ValueError(
                f"to_global(placement={placement}) changes the mesh from {self.placement.ndim} "
                f"to {placement.ndim} axes, so the SBP cannot be kept; pass sbp= as well."
            )
        sbp = self.sbp
    dst = Layout(placement, normalize(sbp, placement.ndim, self.ndim))
    if check_meta:
        _check_boxing_meta(self, dst)
    if dst == self._layout:
        return self
    if placement.type != self.placement.type:
        # NOTE [device moves] in _devices: the same ranks and SBP on the other device type
        # (a local copy, differentiable), then boxing between placements of one type.
        moved = cast(GlobalTensor, self.to(placement.type))
        return moved.to_global(placement, dst.sbp, check_meta=False)
    return Redistribute.apply(self, dst)


def _to_local_method(self: GlobalTensor) -> torch.Tensor:
    """This rank's piece (empty on a rank outside the placement). Differentiable."""
    return _ToLocal.apply(self)


def _tolist(self: GlobalTensor) -> Any:
    """The logical value as nested lists, on every rank (a collective)."""
    return logical_value(self, "tolist()").tolist()


def _numpy(self: GlobalTensor, *, force: bool = False) -> Any:
    """The logical value as a numpy array, on every rank (a collective)."""
    if self.requires_grad and not force:
        raise RuntimeError(
            "Can't call numpy() on a global tensor that requires grad; "
            "use t.detach().numpy() instead."
        )
    return logical_value(self, "numpy()").numpy(force=force)


def _repr(self: GlobalTensor, *, tensor_contents: Any = None) -> str:
    return global_repr(self)


def _check_boxing_meta(x: GlobalTensor, dst: Layout) -> None:
    """Every rank must box the same (layout, shape, dtype) to the same destination."""
    if _step_context.current.get() is not None:
        return  # inside a pipelined step (NOTE [no agreement in a pipelined step])
    key = (x._layout, dst, tuple(x.shape), x.dtype)
    mine = _boxing_metas.get(key)
    if mine is None:
        mine = _meta_check.RankMeta(
            error=None,
            dtype=x.dtype,
            shape=tuple(x.shape),
            placement=f"{x.placement} -> {dst.placement}",
            sbp=f"{sbp_str(x.sbp)} -> {sbp_str(dst.sbp)}",
            in_placement=False,  # differs by rank and is not compared: keep vectors equal
        )
        _boxing_metas[key] = mine
    _meta_check.agree(mine, "to_global (boxing)")


# The encoded metadata of boxing calls seen before: a training loop repeats the
# same conversions, and encoding (string hashing) costs more than the exchange.
BOXING_METAS_BOUND = 1024
_boxing_metas: BoundedDict[Any, _meta_check.RankMeta] = BoundedDict(
    "boxing meta checks", BOXING_METAS_BOUND
)


# -- local -> global -----------------------------------------------------------------


def _dual(sbp: NdSbp) -> NdSbp:
    return tuple(
        Partial("sum") if isinstance(s, Broadcast) else Broadcast() if isinstance(s, Partial) else s
        for s in sbp
    )


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
        dual = _dual(layout.sbp)
        boxed = cast(GlobalTensor, grad.detach()).to_global(
            layout.placement, dual, check_meta=False
        )
        local = boxed._local
        if get_rank() not in layout.placement:
            local = local.new_zeros(ctx.input_shape, device=ctx.input_device)
        return local, None, None


class _ToLocal(torch.autograd.Function):
    """Forward: this rank's piece. Backward: local gradients read with the dual layout."""

    @staticmethod
    def forward(ctx: Any, g: GlobalTensor) -> torch.Tensor:
        ctx.layout = g._layout
        ctx.shape = tuple(g.shape)
        return g._local.view_as(g._local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> GlobalTensor:
        layout: Layout = ctx.layout
        return GlobalTensor(
            grad.contiguous(), Layout(layout.placement, _dual(layout.sbp)), ctx.shape
        )


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
    if b_axes:
        groups = pl.groups_along(b_axes)
        found = _groups.group_of(pl.type, groups, rank)
        if found is not None:
            ranks, _ = found
            # The head only sends (dist.broadcast leaves its buffer untouched).
            buffer = (
                local.contiguous()
                if rank == ranks[0]
                else torch.empty_like(local, memory_format=torch.contiguous_format)
            )
            local = collectives.broadcast(buffer, ranks[0], found)
            _trace.record(None, ["broadcast"], [tuple(b_axes)])
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
def _tensor_to_global(
    self: torch.Tensor,
    placement: Placement | None = None,
    sbp: SbpParallel | Sequence[SbpParallel] | None = None,
    *,
    check_meta: bool = True,
    shape: Sequence[int] | None = None,
) -> GlobalTensor:
    return to_global(self, placement, sbp, check_meta=check_meta, shape=shape)


_tensor_to_global.__doc__ = to_global.__doc__
torch.Tensor.to_global = _tensor_to_global  # type: ignore[attr-defined]
torch.Tensor.is_global = property(lambda self: False)  # type: ignore[attr-defined]

# GlobalTensor's methods that box or read values (NOTE [tensor layers] in _global).
for _name, _method in {
    "to_global": _to_global_method,
    "to_local": _to_local_method,
    "tolist": _tolist,
    "numpy": _numpy,
    "to": _devices.to_method,
    "cuda": _devices.cuda_method,
    "__repr__": _repr,
    "__format__": global_format,
    "__reduce_ex__": _saving.reduce_global,  # NOTE [torch.save of global tensors]
    "__copy__": _saving.copy_global,
}.items():
    setattr(GlobalTensor, _name, _method)
bind_dispatcher(_dispatch.dispatch, box_below_autograd)
_saving.install_torch_save_check()
