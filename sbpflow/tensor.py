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

import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch

from . import _meta_check
from ._layout import Layout, empty_local_shape, logical_shape_from_locals
from ._lazy_bits import resolved
from .boxing import executor
from .boxing import tracing as _trace
from .boxing.planner import plan as _plan
from .comm import _groups, collectives
from .comm._world import device_for, get_rank, get_world_size
from .placement import Placement
from .sbp import Broadcast, NdSbp, Partial, SbpParallel, Split, normalize, sbp_str

__all__ = ["GlobalTensor", "is_global", "keep_grad_layout", "to_global"]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class _Meta:
    """A global tensor's (layout, logical shape, dtype), interned: one object per value.

    Compared and hashed by identity, so the dispatch fast path builds and looks
    up its cache key (NOTE [fast path] in ``_dispatch``) without hashing layouts.
    """

    __slots__ = ("dtype", "layout", "shape", "strides")

    def __init__(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.layout, self.shape, self.dtype = layout, shape, dtype
        self.strides = _contiguous_strides(shape)

    def __reduce__(self) -> Any:  # pickling and deepcopy re-intern
        return (_meta_of, (self.layout, self.shape, self.dtype))


_metas: dict[tuple[Any, ...], _Meta] = {}


def _meta_of(layout: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> _Meta:
    key = (layout, shape, dtype)
    meta = _metas.get(key)
    if meta is None:
        meta = _metas[key] = _Meta(layout, shape, dtype)
    return meta


def _wrap(
    local: torch.Tensor, meta: _Meta, requires_grad: bool = False, cls: type | None = None
) -> GlobalTensor:
    """``GlobalTensor(local, meta.layout, meta.shape)`` from interned metadata (the fast path)."""
    self: GlobalTensor = _make_wrapper_subclass(
        cls or GlobalTensor,
        meta.shape,
        strides=meta.strides,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=requires_grad,
    )
    self._local = local
    self._meta = meta
    return self


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


class GlobalTensor(torch.Tensor):
    """A logical tensor spread over a placement. ``.shape``/``.dtype`` are logical."""

    _local: torch.Tensor
    _meta: _Meta  # (layout, shape, dtype) interned, for the dispatch fast path

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, local: torch.Tensor, layout: Layout, shape: Sequence[int], requires_grad: bool = False
    ) -> GlobalTensor:
        self = _wrap(local, _meta_of(layout, tuple(shape), local.dtype), requires_grad, cls)
        if requires_grad:
            keep_grad_layout(self)
        return self

    # -- metadata ---------------------------------------------------------------------
    @property
    def _layout(self) -> Layout:
        return self._meta.layout

    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> NdSbp:
        """One SBP per placement axis, as a tuple."""
        return self._layout.sbp

    @property
    def is_global(self) -> bool:
        return True

    @property
    def is_local(self) -> bool:
        return False

    # -- reading the logical value (collectives: every rank must call, see _printing) --
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        from ._printing import global_repr

        return global_repr(self)

    def __format__(self, format_spec: str) -> str:
        from ._printing import global_format

        return global_format(self, format_spec)

    def tolist(self) -> Any:
        """The logical value as nested lists, on every rank (a collective)."""
        from ._printing import logical_value

        return logical_value(self).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The logical value as a numpy array, on every rank (a collective)."""
        from ._printing import logical_value

        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on a global tensor that requires grad; "
                "use t.detach().numpy() instead."
            )
        return logical_value(self).numpy(force=force)

    # -- autograd -------------------------------------------------------------------
    def requires_grad_(self, requires_grad: bool = True) -> GlobalTensor:
        """As ``torch.Tensor.requires_grad_``; a leaf's gradient then keeps its layout."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            keep_grad_layout(self)
        return self

    @property
    def requires_grad(self) -> bool:
        return _TENSOR_REQUIRES_GRAD.__get__(self)  # type: ignore[attr-defined]

    @requires_grad.setter
    def requires_grad(self, requires_grad: bool) -> None:
        """``t.requires_grad = True`` does what ``t.requires_grad_()`` does."""
        self.requires_grad_(requires_grad)

    # -- conversions ----------------------------------------------------------------
    def to_local(self) -> torch.Tensor:
        """This rank's piece (empty on a rank outside the placement). Differentiable."""
        return _ToLocal.apply(self)

    def to_global(
        self,
        placement: Placement | None = None,
        sbp: SbpParallel | Sequence[SbpParallel] | None = None,
        *,
        check_meta: bool = True,
    ) -> GlobalTensor:
        """Change the layout (boxing); the logical value stays the same."""
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
        return box(self, dst)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _dispatch_op(func, args, kwargs or {})


def _dispatch_op(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Binds ``_dispatch.dispatch`` on the first op (it imports the rules, which import this
    module) and then replaces itself with it: an import statement per op costs microseconds."""
    global _dispatch_op
    from ._dispatch import dispatch

    _dispatch_op = dispatch
    return dispatch(func, args, kwargs)


def is_global(x: object) -> bool:
    return isinstance(x, GlobalTensor)


_TENSOR_REQUIRES_GRAD = torch._C.TensorBase.requires_grad


def keep_grad_layout(leaf: torch.Tensor) -> None:
    """Make ``leaf``'s incoming gradient arrive in ``leaf``'s own layout (idempotent).

    A parameter's gradient can come out of the backward pass partial or split
    (a broadcast weight times a split batch gives a partial-sum gradient). A
    hook boxes it to the parameter's layout before it is accumulated into
    ``.grad`` (for a broadcast parameter: the all_reduce of data parallelism),
    so ``optimizer.step()`` is purely local.
    """
    if not isinstance(leaf, GlobalTensor) or getattr(leaf, "_grad_layout_hook", None) is not None:
        return
    owner = weakref.ref(leaf)

    def to_own_layout(grad: torch.Tensor) -> torch.Tensor | None:
        param = owner()
        if param is None or not isinstance(grad, GlobalTensor) or grad._layout == param._layout:
            return None
        return box(grad, param._layout)

    leaf._grad_layout_hook = leaf.register_hook(to_own_layout)  # type: ignore[attr-defined]


# -- boxing -------------------------------------------------------------------------


def box(x: GlobalTensor, dst: Layout) -> GlobalTensor:
    """Differentiable layout change without the meta check (ranks already agree)."""
    if dst == x._layout:
        return x
    return _Box.apply(x, dst)


def _run_plan(x: GlobalTensor, dst: Layout) -> GlobalTensor:
    boxing_plan = _plan(tuple(x.shape), x.dtype, x._layout, dst)
    local = executor.execute(boxing_plan, x._local, get_rank())
    return GlobalTensor(local, dst, x.shape)


class _Box(torch.autograd.Function):
    """Forward: boxing src -> dst. Backward: the gradient boxed back to src's layout."""

    @staticmethod
    def forward(ctx: Any, x: GlobalTensor, dst: Layout) -> GlobalTensor:
        ctx.src = x._layout
        return _run_plan(x, dst)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[GlobalTensor, None]:
        grad = _as_global_grad(grad, "boxing")
        return _Box.apply(grad, ctx.src), None


def _as_global_grad(grad: Any, where: str) -> GlobalTensor:
    if not isinstance(grad, GlobalTensor):
        raise TypeError(
            f"the gradient reaching {where} is a plain {type(grad).__name__}, expected a global "
            "tensor; a global tensor's gradient must itself be global."
        )
    return grad


def _check_boxing_meta(x: GlobalTensor, dst: Layout) -> None:
    """Every rank must box the same (layout, shape, dtype) to the same destination."""
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
_boxing_metas: dict[Any, _meta_check.RankMeta] = {}


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
        ctx.input_shape = x.shape
        local = _materialise(x, layout)
        return GlobalTensor(local, layout, shape)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[torch.Tensor, None, None]:
        grad = _as_global_grad(grad, "to_global")
        layout = ctx.layout
        dual = Layout(layout.placement, _dual(layout.sbp))
        local = (
            box(cast(GlobalTensor, grad.detach()), dual)._local
            if grad._layout != dual
            else grad._local
        )
        if get_rank() not in layout.placement:
            local = local.new_zeros(ctx.input_shape)
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


def _materialise(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's local tensor for ``x.to_global(layout)`` (broadcast sends from group heads)."""
    rank = get_rank()
    pl = layout.placement
    b_axes = [a for a, s in enumerate(layout.sbp) if isinstance(s, Broadcast) and pl.shape[a] > 1]
    local = x.detach()
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
            _trace.record(None, ["broadcast"])
    if rank not in pl:
        return local.new_empty(empty_local_shape(local.dim()))
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
            f"{placement} names rank(s) {outside} but the world has {world_size} ranks "
            f"(0..{world_size - 1}); use ranks that exist or launch more processes.",
            (),
        )
    try:
        return None, normalize(sbp, placement.ndim, x.dim())
    except (TypeError, ValueError) as error:
        return str(error), ()


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
