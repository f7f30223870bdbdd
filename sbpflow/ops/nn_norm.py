"""Batch norm (statistics of the whole logical batch) and layer norm.

# NOTE [batch norm over a split batch]
# Training batch norm normalises each channel with the mean and variance of the
# WHOLE logical batch (DESIGN §4), not of each rank's shard. With the input
# split on a non-channel dim, every rank sums its shard per channel, the sums
# are boxed P -> B over the split axes (an all-reduce of C numbers), and the
# variance takes a second such pass over the centred values (two passes, not
# E[x^2] - E[x]^2, for the same accuracy as a single process). Running
# statistics are then updated identically on every rank of the axis. The
# backward needs sum(grad) and sum(grad * xhat) over the whole batch: one
# all-reduce of a (2, C) tensor, after which the weight and bias gradients are
# already complete (B). A channel split needs no communication (each rank owns
# whole channels); eval mode uses the running statistics and none either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._layout import Layout
from ..sbp import SbpParallel, Split
from ._helpers import B, P, bind, box_to, masked_outputs, strategy, sum_partials
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__: list[str] = []

_BN_FORWARD = [
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
]
_PER_CHANNEL = ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd")


def _batch_norm_strategies(
    info: OpInfo,
    data: Sequence[str],
    split_outs: Any,
    channel_outs: Any,
    whole_outs: Any,
    partial_outs: Any,
) -> list[Strategy]:
    """Non-channel splits (of every name in ``data``), the channel split, B, and P grads."""
    ndim = info.inputs[0].ndim
    out = []
    for d in range(ndim):
        if d != 1 and info.inputs[0].shape[d] > 0:
            out.append(strategy(info, {name: Split(d) for name in data}, split_outs(d)))
    if ndim > 1:
        table: dict[str, Any] = {name: Split(1) for name in data}
        table.update({name: Split(0) for name in _PER_CHANNEL})
        out.append(strategy(info, table, channel_outs))
    out.append(strategy(info, {}, whole_outs))
    if partial_outs is not None:
        out.append(strategy(info, {data[0]: P}, partial_outs))
    return out


def _is_training(func: Any, bound: dict[str, Any]) -> bool:
    if func is aten._native_batch_norm_legit_no_training.default:
        return False
    return bool(bound.get("training", bound.get("train")))


def _stat_layout(input_layout: Layout, channel_dim: int) -> Layout:
    """Layout of a per-channel statistic (channel dim ``channel_dim``) summed over a shard:
    partial where the input is split on a batch/spatial dim, split where channels are."""
    sbp: list[SbpParallel] = []
    for s in input_layout.sbp:
        if isinstance(s, Split):
            sbp.append(Split(channel_dim) if s.dim == 1 else P)
        else:
            sbp.append(s)
    return Layout(input_layout.placement, tuple(sbp))


def _needs_global_stats(layout: Layout) -> bool:
    return any(isinstance(s, Split) and s.dim != 1 for s in layout.sbp)


def _channel_sum(t: torch.Tensor, layout: Layout, num_channels: int) -> torch.Tensor:
    """Per-channel sum over this shard, then over the whole logical batch (boxed P -> B)."""
    dims = [0, *list(range(2, t.dim()))]
    local = t.sum(dims)
    stat = _stat_layout(layout, 0)
    return box_to(local, stat, (num_channels,), sum_partials(stat))


def _channel_view(stat: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor."""
    return stat.view((1, -1) + (1,) * (ndim - 2))


def _accumulate_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _batch_norm_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    layout = ctx.input_layouts[0]
    if not (_is_training(func, bound) and _needs_global_stats(layout)):
        return func(*args, **kwargs)
    x = bound["input"]
    shape = ctx.input_metas[0].shape
    num_channels = shape[1]
    count = math.prod(shape) // max(num_channels, 1)
    xa = _accumulate_dtype(x)
    mean = _channel_sum(xa, layout, num_channels) / count
    centred = xa - _channel_view(mean, x.dim())
    var = _channel_sum(centred * centred, layout, num_channels) / count
    invstd = torch.rsqrt(var + bound["eps"])
    out = centred * _channel_view(invstd, x.dim())
    if bound["weight"] is not None:
        out = out * _channel_view(bound["weight"], x.dim())
    if bound["bias"] is not None:
        out = out + _channel_view(bound["bias"], x.dim())
    out = out.to(x.dtype)
    momentum = bound["momentum"]
    unbiased = var * (count / max(count - 1, 1))
    running_mean: Any = bound.get("running_mean")
    running_var: Any = bound.get("running_var")
    # Saved statistics in the dtype the op itself returns (float32 for half inputs).
    save_mean = mean.to(ctx.output_metas[1].dtype)
    save_invstd = invstd.to(ctx.output_metas[2].dtype)
    if func is aten._native_batch_norm_legit_functional.default:
        new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
        new_var = running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum
        return out, save_mean, save_invstd, new_mean, new_var
    with torch.no_grad():  # the same update on every rank keeps the running stats broadcast
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return out, save_mean, save_invstd


@register(*_BN_FORWARD, family="nn", local=_batch_norm_local)
def batch_norm_rule(info: OpInfo) -> list[Strategy]:
    k = len(info.outputs)
    return _batch_norm_strategies(
        info,
        ["input"],
        lambda d: (Split(d),) + (B,) * (k - 1),
        (Split(1),) + (Split(0),) * (k - 1),
        (B,) * k,
        None,
    )


def _batch_norm_backward_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    layout = ctx.input_layouts[1]  # the forward input's layout
    mask = list(bound["output_mask"])
    if len(ctx.output_metas) == 3:  # the meta kernel returned every output: so must we
        mask = [True, True, True]
    if not (bound["train"] and _needs_global_stats(layout)):
        return func(**{**bound, "output_mask": mask})
    grad, x = bound["grad_out"], bound["input"]
    shape = ctx.input_metas[1].shape
    num_channels = shape[1]
    count = math.prod(shape) // max(num_channels, 1)
    ndim = x.dim()
    ga, xa = _accumulate_dtype(grad), _accumulate_dtype(x)
    mean = _channel_view(bound["save_mean"], ndim)
    invstd = _channel_view(bound["save_invstd"], ndim)
    xhat = (xa - mean) * invstd
    dims = [0, *list(range(2, ndim))]
    sums = torch.stack([ga.sum(dims), (ga * xhat).sum(dims)])  # (2, C): one all-reduce
    stat = _stat_layout(layout, 1)
    sums = box_to(sums, stat, (2, num_channels), sum_partials(stat))
    sum_g, sum_gx = sums[0], sums[1]
    weight = bound["weight"]
    scale = invstd if weight is None else invstd * _channel_view(weight, ndim)
    grad_input = None
    if mask[0]:
        inner = ga - _channel_view(sum_g, ndim) / count - xhat * _channel_view(sum_gx, ndim) / count
        grad_input = (scale * inner).to(x.dtype)
    param_dtype = x.dtype if weight is None else weight.dtype
    grad_weight = sum_gx.to(param_dtype) if mask[1] else None
    grad_bias = sum_g.to(param_dtype) if mask[2] else None
    return grad_input, grad_weight, grad_bias


@register(aten.native_batch_norm_backward.default, family="nn", local=_batch_norm_backward_local)
def batch_norm_backward_rule(info: OpInfo) -> list[Strategy]:
    bound = bind(info.func, info.args, info.kwargs)
    mask = bound["output_mask"]
    # Training: the weight/bias sums are all-reduced for grad_input anyway, so they come
    # back complete (B); eval: they are sums over this shard (P).
    reduced = B if bound["train"] else P
    return _batch_norm_strategies(
        info,
        ["grad_out", "input"],
        lambda d: masked_outputs(info, (Split(d), reduced, reduced), mask),
        masked_outputs(info, (Split(1), Split(0), Split(0)), mask),
        masked_outputs(info, (B, B, B), mask),
        masked_outputs(info, (P, P, P), mask),
    )


# -- layer norm ---------------------------------------------------------------------


def _layer_norm_axis(info: OpInfo) -> int:
    normalized = bind(info.func, info.args, info.kwargs)["normalized_shape"]
    return info.inputs[0].ndim - len(normalized)


@register(aten.native_layer_norm.default, family="nn")
def layer_norm_rule(info: OpInfo) -> list[Strategy]:
    axis = _layer_norm_axis(info)
    out = [strategy(info, {"input": Split(d)}, (Split(d),) * 3) for d in range(axis)]
    return [*out, strategy(info, {}, (B, B, B))]


@register(aten.native_layer_norm_backward.default, family="nn")
def layer_norm_backward_rule(info: OpInfo) -> list[Strategy]:
    axis = _layer_norm_axis(info)
    mask = bind(info.func, info.args, info.kwargs)["output_mask"]
    data = ("grad_out", "input", "mean", "rstd")
    out = [
        strategy(
            info, {name: Split(d) for name in data}, masked_outputs(info, (Split(d), P, P), mask)
        )
        for d in range(axis)
    ]
    out.append(strategy(info, {}, masked_outputs(info, (B, B, B), mask)))
    out.append(strategy(info, {"grad_out": P}, masked_outputs(info, (P, P, P), mask)))
    return out
