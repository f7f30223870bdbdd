"""Reductions: sum, mean, max/min, amax/amin, argmax/argmin, norms, var/std, prod, any/all,
equal.

# NOTE [reduction rules]
# A split on a dim that is kept stays a split (renumbered when the reduced
# dims are dropped). A split on a reduced dim needs the other ranks' pieces:
#   sum, mean          -> P(sum)  (mean: local sum / the *logical* count)
#   max, amax, inf-norm -> P(max) (a rank with an empty shard contributes -inf)
#   finite p-norms     -> sum |x|^p is P(sum), then the root after one all_reduce
#                         (a decomposition, so only a scalar-sized reduction moves)
#   everything else (min, argmax, var, prod, ...) -> gathered to B first
# Partial inputs pass through the reductions that share their reduce op
# (sum of a P(sum), max of a P(max)); any other needs its input boxed to B.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import _global
from .._layout import Layout
from ..sbp import Broadcast, Partial, SbpParallel, Split
from ._registry import LocalContext, OpInfo, Strategy, bind, register, register_decomposition

__all__ = ["reduced_dims", "reduction_strategies"]

aten = torch.ops.aten


def reduced_dims(ndim: int, dim: Any) -> list[int]:
    """The dims a reduction over ``dim`` (an int, a list, or None/[] for all) removes.

    A 0-dim tensor has none (torch accepts ``dim=0`` or ``-1`` on it and reduces nothing).
    """
    if ndim == 0:
        return []
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return list(range(ndim))
    return sorted({d % max(ndim, 1) for d in dims})


def reduction_strategies(
    info: OpInfo,
    dims: Sequence[int],
    keepdim: bool,
    on_split: SbpParallel | None,
    passes_partial: str | None,
) -> list[Strategy]:
    """Strategies for reducing input 0 over ``dims``; other global inputs stay broadcast.

    ``on_split``: the output SBP when a reduced dim is split (None: not allowed).
    ``passes_partial``: the partial reduce op ("sum"/"max") the op commutes with.
    """
    meta = info.inputs[0]
    rest = tuple(Broadcast() for _ in info.inputs[1:])
    num_out = len(info.outputs)
    strategies = []
    for d in range(meta.ndim):
        if meta.shape[d] < 1:
            continue
        if d in dims:
            if on_split is not None:
                strategies.append(
                    Strategy((Split(d), *rest), tuple(on_split for _ in range(num_out)))
                )
            continue
        out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
        strategies.append(
            Strategy((Split(d), *rest), tuple(Split(out_dim) for _ in range(num_out)))
        )
    strategies.append(Strategy((Broadcast(), *rest), tuple(Broadcast() for _ in range(num_out))))
    if passes_partial is not None:
        p = Partial(passes_partial)
        strategies.append(Strategy((p, *rest), tuple(p for _ in range(num_out))))
    return strategies


def _dims_keepdim(info: OpInfo) -> tuple[list[int], bool]:
    """Reduced dims and keepdim from the op's schema (no ``dim`` argument: all dims)."""
    bound = info.bound()
    return reduced_dims(info.inputs[0].ndim, bound.get("dim")), bool(bound.get("keepdim", False))


# -- sum and mean --------------------------------------------------------------------


@register(aten.sum, aten.nansum, family="reductions")
def sum_rule(info: OpInfo) -> list[Strategy]:
    dims, keepdim = _dims_keepdim(info)
    return reduction_strategies(info, dims, keepdim, Partial("sum"), "sum")


def _mean_local(func: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> torch.Tensor:
    """The local mean rescaled to the logical count: sums over ranks to the logical mean."""
    local = args[0]
    dims = reduced_dims(local.dim(), bind(func, args, kwargs).get("dim"))
    logical = ctx.input_metas[0].shape
    count = math.prod(logical[d] for d in dims)
    local_count = math.prod(local.shape[d] for d in dims)
    if local_count == count:
        return func(*args, **kwargs)
    if local_count == 0:
        return torch.zeros(
            ctx.local_output_shape(0), dtype=ctx.output_metas[0].dtype, device=local.device
        )
    return func(*args, **kwargs) * (local_count / count)


@register(aten.mean, family="reductions", local=_mean_local)
def mean_rule(info: OpInfo) -> list[Strategy]:
    dims, keepdim = _dims_keepdim(info)
    return reduction_strategies(info, dims, keepdim, Partial("sum"), "sum")


# -- max and friends -----------------------------------------------------------------


def _max_local(func: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> torch.Tensor:
    """An empty shard contributes max's identity instead of raising (norms: 0, else lowest)."""
    if args[0].numel() == 0:
        dtype = ctx.output_metas[0].dtype
        fill = (
            0 if func.overloadpacket is aten.linalg_vector_norm else Partial("max").identity(dtype)
        )
        return torch.full(ctx.local_output_shape(0), fill, dtype=dtype, device=args[0].device)
    return func(*args, **kwargs)


@register(aten.amax, aten.max.default, family="reductions", local=_max_local)
def max_rule(info: OpInfo) -> list[Strategy]:
    dims, keepdim = _dims_keepdim(info)
    return reduction_strategies(info, dims, keepdim, Partial("max"), "max")


@register(
    aten.amin, aten.min.default, aten.max.dim, aten.min.dim, aten.argmax, aten.argmin,
    aten.prod, aten.logsumexp, aten.any, aten.all, aten.var, aten.std, aten.var_mean,
    aten.std_mean,
    family="reductions",
)  # fmt: skip
def gathered_reduction(info: OpInfo) -> list[Strategy]:
    """Reductions that need all of a reduced dim on one rank (min, indices, var, ...)."""
    dims, keepdim = _dims_keepdim(info)
    return reduction_strategies(info, dims, keepdim, None, None)


# -- vector norms --------------------------------------------------------------------


def _norm_args(func: Any, args: tuple, kwargs: dict) -> tuple[float, Any, bool, Any]:
    bound = bind(func, args, kwargs)
    return float(bound["ord"]), bound["dim"], bool(bound["keepdim"]), bound.get("dtype")


@register(aten.linalg_vector_norm, family="reductions", local=_max_local)
def vector_norm_rule(info: OpInfo) -> list[Strategy]:
    ord_, dim, keepdim, _ = _norm_args(info.func, info.args, info.kwargs)
    dims = reduced_dims(info.inputs[0].ndim, dim)
    if ord_ == math.inf:
        return reduction_strategies(info, dims, keepdim, Partial("max"), None)
    return reduction_strategies(info, dims, keepdim, None, None)


@register_decomposition(aten.linalg_vector_norm)
def vector_norm_over_split(func: Any, args: tuple, kwargs: dict) -> Any:
    """A finite p-norm over a split dim: ``(sum |x|^p)^(1/p)`` with one all_reduce of the sum."""
    x = args[0]
    if not isinstance(x, _global.GlobalTensor):
        return NotImplemented
    ord_, dim, keepdim, dtype = _norm_args(func, args, kwargs)
    dims = reduced_dims(x.dim(), dim)
    layout: Layout = x._layout.normalized()
    split_reduced = any(isinstance(s, Split) and s.dim in dims for s in layout.sbp)
    if not split_reduced or ord_ <= 0 or math.isinf(ord_) or layout.has_partial:
        return NotImplemented
    if dtype is not None:
        x = aten._to_copy(x, dtype=dtype)
    magnitude = aten.abs(x)
    powered = magnitude if ord_ == 1 else aten.pow(magnitude, ord_)
    total = aten.sum(powered, dims, keepdim)
    if ord_ == 1:
        return total  # partial-sum: later ops box it as they need
    if ord_ == 2:
        return aten.sqrt(total)
    return aten.pow(total, 1.0 / ord_)


@register_decomposition(aten.equal)
def equal(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.equal``: the count of differing elements, summed over ranks, is zero."""
    a, b = args
    if tuple(a.shape) != tuple(b.shape):
        return False
    return bool(aten.sum.default(aten.ne.Tensor(a, b)).item() == 0)
