"""Scaled dot-product attention: batch or heads split, computed locally with no gather.

# NOTE [attention splits]
# ``F.scaled_dot_product_attention`` picks a kernel with ``_fused_sdp_choice``
# and lowers to one of the fused ops below (on CPU:
# ``_scaled_dot_product_flash_attention_for_cpu`` and its backward). Each
# query attends only within its own (batch, head), so
#   q, k, v, mask S(0) -> output, logsumexp S(0)    (batch split)
#   q, k, v, mask S(1) -> output, logsumexp S(1)    (heads split)
# run per rank on the local pieces. A mask (or bias) whose batch/head dim has
# size 1 is broadcast over it and taken as B. Grouped-query attention (g query
# heads per key/value head) splits heads too where every rank gets whole
# groups: query heads [g*a, g*b) with key/value heads [a, b) (the balanced
# split gives that when the ranks' shares of key/value heads times g are their
# shares of query heads, e.g. 4 and 2 heads on 2 ranks), else only the batch.
# Outputs that are not per (batch, head) (RNG seeds, cumulative lengths) are
# B. In the backward ops the gradient of a tensor broadcast over the split dim
# (multi-query key/value heads, a mask shared by every head) sums each rank's
# queries' contributions: P. With dropout each rank would draw its own mask, so
# dropout_p > 0 only computes broadcast.
"""

from __future__ import annotations

from typing import Any

import torch

from .._layout import balanced_sizes
from ..sbp import SbpParallel, Split
from ._helpers import B, P, bind, normalize_dim
from ._registry import LocalContext, OpInfo, Strategy, TensorMeta, register

aten = torch.ops.aten

__all__: list[str] = []

_FORWARD = [
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
]
_BACKWARD = [
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
]


def _query(info: OpInfo) -> TensorMeta:
    """The query's metadata (the backward ops take the output gradient first)."""
    return info.inputs[1] if info.func in _BACKWARD else info.inputs[0]


def _along(meta: TensorMeta, query: TensorMeta, dim: int) -> SbpParallel:
    """S(dim) for a tensor that runs along the query's batch/head dim ``dim``, else B."""
    if meta.ndim >= 2 and meta.shape[dim] == query.shape[dim] and meta.shape[:2] != (1, 1):
        return Split(dim)
    if dim == 1 and meta.ndim == 4 and meta.shape[1] > 1:
        return Split(1)  # grouped-query key/value heads (_can_split checked the groups)
    return B  # a mask broadcast over this dim, a seed, cumulative lengths


def _can_split(info: OpInfo, dim: int) -> bool:
    query = _query(info)
    for meta in info.inputs:
        if meta.ndim != 4:
            continue  # 0-dim seeds, 1-D cumulative lengths
        size = meta.shape[dim]
        if size not in (1, query.shape[dim]) and not (
            dim == 1 and _groups_stay_whole(query.shape[1], size, info.mesh_axis_size)
        ):
            return False
    return query.shape[dim] > 1


def _groups_stay_whole(num_heads: int, num_kv_heads: int, num_ranks: int) -> bool:
    """Whether splitting ``num_heads`` query heads and ``num_kv_heads`` key/value heads over
    ``num_ranks`` gives every rank whole groups: query heads ``[g*a, g*b)`` where it holds
    key/value heads ``[a, b)``, ``g`` query heads per key/value head (NOTE [attention splits])."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return False
    group = num_heads // num_kv_heads
    return all(
        q == group * kv
        for q, kv in zip(
            balanced_sizes(num_heads, num_ranks),
            balanced_sizes(num_kv_heads, num_ranks),
            strict=True,
        )
    )


def _dropout(info: OpInfo) -> float:
    value = bind(info.func, info.args, info.kwargs).get("dropout_p", 0.0)
    return float(value or 0.0)


def _attention_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    """The kernel on this rank's pieces; a rank whose split left it no batch entries or heads
    (2 heads over 4 ranks) returns empty outputs, since the CPU kernels divide by those sizes."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensor_outputs = len(ctx.output_metas) == len(func._schema.returns)
    if (tensors and all(t.numel() > 0 for t in tensors[:3])) or not tensor_outputs:
        return func(*args, **kwargs)
    return tuple(
        torch.zeros(ctx.local_output_shape(i), dtype=meta.dtype, device=tensors[0].device)
        for i, meta in enumerate(ctx.output_metas)
    )


@register(*_FORWARD, *_BACKWARD, family="attention", local=_attention_local)
def attention_rule(info: OpInfo) -> list[Strategy]:
    out: list[Strategy] = []
    if _dropout(info) == 0.0:
        query = _query(info)
        for dim in (0, 1):
            if not _can_split(info, dim):
                continue
            outputs = tuple(_along(m, query, dim) for m in info.outputs)
            if info.func in _BACKWARD:  # gradients of inputs broadcast over dim: sums (P)
                outputs = tuple(
                    P if s == B and m.ndim == 4 else s
                    for s, m in zip(outputs, info.outputs, strict=True)
                )
            out.append(Strategy(tuple(_along(m, query, dim) for m in info.inputs), outputs))
    out.append(Strategy((B,) * len(info.inputs), (B,) * len(info.outputs)))
    return out


@register(aten._safe_softmax.default, family="attention")
def safe_softmax_rule(info: OpInfo) -> list[Strategy]:
    """The math path's softmax (all-masked rows give 0): any split off the softmax dim."""
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1], ndim)
    out = [Strategy((Split(d),), (Split(d),)) for d in range(ndim) if d != dim]
    return [*out, Strategy((B,), (B,))]


def _choice_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    return func(*args, **kwargs)


@register(aten._fused_sdp_choice.default, family="attention", local=_choice_local)
def sdp_choice_rule(info: OpInfo) -> list[Strategy]:
    """Which fused kernel runs depends on dtypes, devices and flags, not on values: each rank
    asks with its pieces as they are (no boxing)."""
    return [Strategy(tuple(info.current), ())]
