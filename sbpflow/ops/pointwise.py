"""Pointwise ops: same layout in, same layout out (with broadcasting and scalars)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..sbp import Broadcast, Partial, SbpParallel, Split
from ._registry import OpInfo, Strategy, register

aten = torch.ops.aten

# Ops linear in each tensor input one at a time: P in one input with B in the rest stays P.
_LINEAR_UNARY = [aten.neg, aten.clone, aten._to_copy, aten.zeros_like]
_ADDITIVE = [aten.add, aten.sub]
_BILINEAR = [aten.mul, aten.div]


def _aligned_dim(out_ndim: int, in_shape: Sequence[int], out_dim: int, out_shape: Sequence[int]) -> int | None:
    """The input dim that lines up with output dim ``out_dim`` under broadcasting, if not size-1."""
    offset = out_ndim - len(in_shape)
    d = out_dim - offset
    if d < 0 or in_shape[d] == 1 and out_shape[out_dim] != 1:
        return None
    return d


def elementwise_strategies(info: OpInfo, partial_ok: str) -> list[Strategy]:
    """Split on any output dim (inputs split on the aligned dim, or B when broadcast), all-B,
    and partial ones: ``partial_ok`` is "all" (additive), "one" (bilinear) or "none"."""
    out = info.outputs[0]
    strategies = []
    for dim in range(out.ndim):
        if out.shape[dim] < 1:
            continue
        ins: list[SbpParallel] = []
        for meta in info.inputs:
            d = _aligned_dim(out.ndim, meta.shape, dim, out.shape)
            ins.append(Split(d) if d is not None else Broadcast())
        strategies.append(Strategy(tuple(ins), tuple(Split(dim) for _ in info.outputs)))
    n = len(info.inputs)
    strategies.append(Strategy(tuple(Broadcast() for _ in range(n)), tuple(Broadcast() for _ in info.outputs)))
    if partial_ok == "all":
        strategies.append(Strategy(tuple(Partial() for _ in range(n)), tuple(Partial() for _ in info.outputs)))
    elif partial_ok == "one":
        for k in range(n):
            ins = tuple(Partial() if i == k else Broadcast() for i in range(n))
            strategies.append(Strategy(ins, tuple(Partial() for _ in info.outputs)))
    return strategies


@register(*_ADDITIVE, family="pointwise")
def additive(info: OpInfo) -> list[Strategy]:
    return elementwise_strategies(info, "all")


@register(*_BILINEAR, family="pointwise")
def bilinear(info: OpInfo) -> list[Strategy]:
    # div is linear in its numerator only.
    if info.func.overloadpacket is aten.div and len(info.inputs) == 2:
        strategies = elementwise_strategies(info, "none")
        strategies.append(Strategy((Partial(), Broadcast()), (Partial(),)))
        return strategies
    return elementwise_strategies(info, "one")


@register(*_LINEAR_UNARY, family="pointwise")
def linear_unary(info: OpInfo) -> list[Strategy]:
    return elementwise_strategies(info, "all")
