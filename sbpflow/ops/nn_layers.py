"""Embedding, convolution and pooling: data parallel on the batch, model parallel on weights.

# NOTE [embedding splits]
# weight B,    ids S(d)  -> out S(d)      (data parallel)
# weight S(1), ids B     -> out S(-1)     (hidden dim split)
# weight S(0), ids B     -> out P         (vocab split: each rank looks up the
#                                          ids in its row range, zeros elsewhere)
# The backward mirrors it: grad S(d) with ids S(d) -> weight grad P; grad
# S(-1) -> S(1); a broadcast grad can produce only this rank's vocab rows, S(0).
#
# NOTE [convolution splits]
# input S(0) (batch), weight B          -> S(0)
# weight S(0) (out channels), bias S(0) -> S(1) (output channels)
# input S(1), weight S(1) (in channels) -> P    (bias is added once: it is P)
# Transposed convolutions store weight as (in, out/groups, ...), so the two
# channel rules swap weight dims. Channel rules need groups == 1.
"""

from __future__ import annotations

from typing import Any

import torch

from ..sbp import SbpParallel, Split
from ._helpers import B, P, bind, masked_outputs, strategy
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__: list[str] = []


# -- embedding ----------------------------------------------------------------------


def _vocab_range(
    ctx: LocalContext, layout_index: int, shape: tuple[int, ...], output: bool
) -> tuple[int, int]:
    layout = ctx.output_layouts[layout_index] if output else ctx.input_layouts[layout_index]
    return layout.box(shape, ctx.rank)[0]


def _embedding_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    weight, ids = bound["weight"], bound["indices"]
    num_rows = ctx.input_metas[0].shape[0]
    lo, hi = _vocab_range(ctx, 0, ctx.input_metas[0].shape, output=False)
    if (lo, hi) == (0, num_rows):
        return func(*args, **kwargs)
    # Vocab split: look up the ids this rank owns, zero the rest (the output is partial).
    owned = (ids >= lo) & (ids < hi)
    local_ids = torch.where(owned, ids - lo, torch.zeros_like(ids))
    out = aten.embedding.default(weight, local_ids)
    return out * owned.unsqueeze(-1).to(out.dtype)


def _indices_ndim(info: OpInfo) -> int:
    """The dims of the ids (argument 1 of embedding and of its backward).

    A plain 0-dim index (``embedding(torch.tensor(3), w)``) is not global: it has no dims.
    """
    k = info.input_at(1)
    return info.inputs[k].ndim if k is not None else 0


@register(aten.embedding.default, family="nn", local=_embedding_local)
def embedding_rule(info: OpInfo) -> list[Strategy]:
    ids_ndim = _indices_ndim(info)
    out = [strategy(info, {"indices": Split(d)}, (Split(d),)) for d in range(ids_ndim)]
    out.append(strategy(info, {"weight": Split(1)}, (Split(ids_ndim),)))
    out.append(strategy(info, {"weight": Split(0)}, (P,)))
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"weight": P}, (P,)))
    return out


def _embedding_backward_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    num_rows = ctx.output_metas[0].shape[0]
    lo, hi = _vocab_range(ctx, 0, ctx.output_metas[0].shape, output=True)
    if (lo, hi) == (0, num_rows):
        return func(*args, **kwargs)
    # This rank's vocab rows only: ids outside [lo, hi) contribute nothing.
    grad, ids = bound["grad_output"], bound["indices"]
    owned = (ids >= lo) & (ids < hi)
    local_ids = torch.where(owned, ids - lo, torch.zeros_like(ids))
    grad = grad * owned.unsqueeze(-1).to(grad.dtype)
    padding_idx = bound["padding_idx"]
    padding_idx = padding_idx - lo if lo <= padding_idx < hi else -1
    return func(grad, local_ids, hi - lo, padding_idx, bound["scale_grad_by_freq"])


@register(aten.embedding_dense_backward.default, family="nn", local=_embedding_backward_local)
def embedding_backward_rule(info: OpInfo) -> list[Strategy]:
    ids_ndim = _indices_ndim(info)
    by_freq = bool(bind(info.func, info.args, info.kwargs)["scale_grad_by_freq"])
    out = []
    if not by_freq:  # counting ids per row needs all of them
        out += [
            strategy(info, {"grad_output": Split(d), "indices": Split(d)}, (P,))
            for d in range(ids_ndim)
        ]
        out.append(strategy(info, {"grad_output": P}, (P,)))
    out.append(strategy(info, {"grad_output": Split(ids_ndim)}, (Split(1),)))
    out.append(strategy(info, {}, (B,)))
    if not by_freq:
        out.append(strategy(info, {}, (Split(0),)))
    return out


# -- convolution --------------------------------------------------------------------


def _conv_flags(info: OpInfo) -> tuple[bool, int]:
    bound = bind(info.func, info.args, info.kwargs)
    return bool(bound["transposed"]), int(bound["groups"])


@register(aten.convolution.default, family="nn")
def convolution_rule(info: OpInfo) -> list[Strategy]:
    transposed, groups = _conv_flags(info)
    out = [strategy(info, {"input": Split(0)}, (Split(0),))]
    if groups == 1:
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        out.append(strategy(info, {"weight": Split(out_dim), "bias": Split(0)}, (Split(1),)))
        out.append(strategy(info, {"input": Split(1), "weight": Split(in_dim), "bias": P}, (P,)))
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"input": P, "bias": P}, (P,)))
    return out


@register(aten.convolution_backward.default, family="nn")
def convolution_backward_rule(info: OpInfo) -> list[Strategy]:
    transposed, groups = _conv_flags(info)
    mask = bind(info.func, info.args, info.kwargs)["output_mask"]

    def make(table: dict[str, SbpParallel], outs: tuple[SbpParallel, ...]) -> Strategy:
        return strategy(info, table, masked_outputs(info, outs, mask))

    out = [make({"grad_output": Split(0), "input": Split(0)}, (Split(0), P, P))]
    if groups == 1:
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        out.append(
            make({"grad_output": Split(1), "weight": Split(out_dim)}, (P, Split(out_dim), Split(0)))
        )
        out.append(make({"input": Split(1), "weight": Split(in_dim)}, (Split(1), Split(in_dim), B)))
    out.append(make({}, (B, B, B)))
    out.append(make({"grad_output": P}, (P, P, P)))
    return out


# -- pooling ------------------------------------------------------------------------

# op -> number of trailing spatial dims; every dim before them is a batch/channel dim.
_POOLS_MAX = {
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.adaptive_max_pool2d.default: 2,
    aten.adaptive_max_pool3d.default: 3,
}
_POOLS_LINEAR = {
    aten.avg_pool2d.default: 2,
    aten.avg_pool3d.default: 3,
    aten._adaptive_avg_pool2d.default: 2,
    aten._adaptive_avg_pool3d.default: 3,
}
_POOL_BACKWARDS = {
    aten.max_pool2d_with_indices_backward.default: 2,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten.adaptive_max_pool2d_backward.default: 2,
    aten.adaptive_max_pool3d_backward.default: 3,
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
    aten._adaptive_avg_pool2d_backward.default: 2,
    aten._adaptive_avg_pool3d_backward.default: 3,
}


def _batch_dims(info: OpInfo, spatial: int) -> range:
    return range(info.inputs[0].ndim - spatial)


@register(*_POOLS_MAX, family="nn")
def max_pool_rule(info: OpInfo) -> list[Strategy]:
    dims = _batch_dims(info, _POOLS_MAX[info.func])
    k = len(info.outputs)
    out = [Strategy((Split(d),), (Split(d),) * k) for d in dims]
    return [*out, Strategy((B,), (B,) * k)]


@register(*_POOLS_LINEAR, family="nn")
def avg_pool_rule(info: OpInfo) -> list[Strategy]:
    dims = _batch_dims(info, _POOLS_LINEAR[info.func])
    out = [Strategy((Split(d),), (Split(d),)) for d in dims]
    return [*out, Strategy((B,), (B,)), Strategy((P,), (P,))]


@register(*_POOL_BACKWARDS, family="nn")
def pool_backward_rule(info: OpInfo) -> list[Strategy]:
    # Every pooling backward is linear in grad_output; the other inputs (self,
    # indices) are laid out like it when split, and broadcast when grad is partial.
    dims = _batch_dims(info, _POOL_BACKWARDS[info.func])
    n = len(info.inputs)
    out = [Strategy((Split(d),) * n, (Split(d),)) for d in dims]
    out.append(Strategy((B,) * n, (B,)))
    out.append(Strategy((P,) + (B,) * (n - 1), (P,)))
    return out
