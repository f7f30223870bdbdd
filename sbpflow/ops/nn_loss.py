"""Softmax, log-softmax and the losses built on them (nll / cross entropy, mse).

# NOTE [mean losses over a split batch]
# A mean-reduced loss over a batch split across ranks must divide by the
# GLOBAL count, not the local one: each rank sums its shard's losses and
# divides by the whole batch's count, and the ranks' results sum to the loss
# (a P output). For mse the count is the logical numel (known statically).
# For nll it is the total class weight of the non-ignored targets, which only
# the data knows: the ranks' local totals are boxed P -> B (one all-reduce of
# one number) and the global total is returned as ``total_weight`` (B), which
# the backward then uses as it is. Softmax keeps any split that is not on the
# softmax dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._layout import Layout
from ..sbp import SbpParallel, Split
from ._helpers import B, P, bind, box_to, normalize_dim, strategy, sum_partials
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__: list[str] = []

_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


# -- softmax --------------------------------------------------------------------------


@register(aten._softmax.default, aten._log_softmax.default, family="nn")
def softmax_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1], ndim)
    out = [Strategy((Split(d),), (Split(d),)) for d in range(ndim) if d != dim]
    return [*out, Strategy((B,), (B,))]


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default, family="nn")
def softmax_backward_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[2], ndim)
    out = [Strategy((Split(d), Split(d)), (Split(d),)) for d in range(ndim) if d != dim]
    # Linear in the incoming gradient (the saved output is a constant).
    return [*out, Strategy((B, B), (B,)), Strategy((P, B), (P,))]


# -- nll loss -------------------------------------------------------------------------


def _target_dim(d: int) -> int:
    """The target dim matching input dim ``d`` (the target has no class dim 1)."""
    return d if d == 0 else d - 1


def _batch_axes_partial(layout: Layout) -> Layout:
    """A scalar statistic's layout: partial where ``layout`` splits the batch, else as is."""
    sbp: list[SbpParallel] = [P if isinstance(s, Split) else s for s in layout.sbp]
    return Layout(layout.placement, tuple(sbp))


def _nll_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext) -> Any:
    bound = bind(func, args, kwargs)
    layout = ctx.input_layouts[0]
    if bound["reduction"] != _MEAN or not any(isinstance(s, Split) for s in layout.sbp):
        return func(*args, **kwargs)
    total, local_weight = func(
        bound["self"], bound["target"], bound.get("weight"), _SUM, bound["ignore_index"]
    )
    stat = _batch_axes_partial(layout)
    global_weight = box_to(local_weight.reshape(1), stat, (1,), sum_partials(stat)).reshape(())
    return total / global_weight, global_weight


@register(
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    family="nn",
    local=_nll_local,
)
def nll_loss_rule(info: OpInfo) -> list[Strategy]:
    reduction = bind(info.func, info.args, info.kwargs)["reduction"]
    outs: dict[int, Any] = {
        _NONE: lambda d: (Split(_target_dim(d)), P),
        _SUM: lambda d: (P, P),
        _MEAN: lambda d: (P, B),  # total_weight comes back global (see the NOTE)
    }
    out = []
    if info.inputs[0].ndim >= 2:
        for d in range(info.inputs[0].ndim):
            if d != 1:
                out.append(
                    strategy(
                        info,
                        {"self": Split(d), "target": Split(_target_dim(d))},
                        outs[reduction](d),
                    )
                )
    out.append(strategy(info, {}, (B, B)))
    out.append(strategy(info, {"self": P}, (P, B)))  # linear in the log-probabilities
    return out


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default, family="nn")
def nll_loss_backward_rule(info: OpInfo) -> list[Strategy]:
    reduction = bind(info.func, info.args, info.kwargs)["reduction"]
    out = []
    if info.inputs[1].ndim >= 2:
        for d in range(info.inputs[1].ndim):
            if d != 1:
                td = _target_dim(d)
                table: dict[str, SbpParallel] = {
                    "grad_output": Split(td) if reduction == _NONE else B,
                    "self": Split(d),
                    "target": Split(td),
                    "total_weight": B if reduction == _MEAN else P,
                }
                out.append(strategy(info, table, (Split(d),)))
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"grad_output": P}, (P,)))
    return out


# -- mse loss -------------------------------------------------------------------------


def _mse_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext) -> Any:
    # Mean over a split tensor: this shard's sum over the GLOBAL numel (see the NOTE).
    if not any(isinstance(s, Split) for s in ctx.input_layouts[-1].sbp):
        return func(*args, **kwargs)  # every piece whole along the mean: as it is
    bound = bind(func, args, kwargs)
    if bound["reduction"] != _MEAN:
        return func(*args, **kwargs)
    return func(**{**bound, "reduction": _SUM}) / math.prod(ctx.input_metas[-1].shape)


@register(aten.mse_loss.default, family="nn", local=_mse_local)
def mse_loss_rule(info: OpInfo) -> list[Strategy]:
    reduction = bind(info.func, info.args, info.kwargs)["reduction"]
    a, b = info.inputs[0], info.inputs[-1]
    out = []
    if a.shape == b.shape and len(info.inputs) == 2:
        for d in range(a.ndim):
            out.append(Strategy((Split(d), Split(d)), (Split(d) if reduction == _NONE else P,)))
    return [*out, Strategy((B,) * len(info.inputs), (B,))]


@register(aten.mse_loss_backward.default, family="nn", local=_mse_local)
def mse_loss_backward_rule(info: OpInfo) -> list[Strategy]:
    reduction = bind(info.func, info.args, info.kwargs)["reduction"]
    out = []
    if len(info.inputs) == 3 and info.inputs[1].shape == info.inputs[2].shape:
        for d in range(info.inputs[1].ndim):
            grad = Split(d) if reduction == _NONE else B
            out.append(
                strategy(
                    info, {"grad_output": grad, "self": Split(d), "target": Split(d)}, (Split(d),)
                )
            )
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"grad_output": P}, (P,)))
    return out
