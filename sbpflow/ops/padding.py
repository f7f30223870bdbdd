"""Padding: a split or partial input keeps its layout along dims the padding leaves alone.

# NOTE [padding splits]
# ``constant_pad_nd``, ``reflection_pad*d`` and ``replication_pad*d`` pad the
# last ``len(pad) // 2`` dims. A split on any other dim (batch, channels) is
# kept: each rank pads its own piece. Reflection and replication copy
# elements, so they are linear and a partial-sum input stays partial; a
# constant pad of a partial-sum input stays partial too, with the constant
# added by the group's first rank only (the others pad with 0). The backward
# ops take (grad_output, input) split alike.
"""

from __future__ import annotations

from typing import Any

import torch

from ..sbp import Split
from ._helpers import B, P, bind
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__: list[str] = []

_COPYING = [
    aten.reflection_pad1d.default,
    aten.reflection_pad2d.default,
    aten.reflection_pad3d.default,
    aten.replication_pad1d.default,
    aten.replication_pad2d.default,
    aten.replication_pad3d.default,
]
_COPYING_BACKWARD = [
    aten.reflection_pad1d_backward.default,
    aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default,
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
]


def _unpadded_dims(ndim: int, pad: list[int]) -> list[int]:
    padded = {ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}
    return [d for d in range(ndim) if d not in padded]


def _empty_piece(args: tuple[Any, ...], ctx: LocalContext) -> torch.Tensor | None:
    """Zeros of this rank's output piece when its input piece is empty (the kernels refuse
    empty non-batch dims, e.g. 3 channels split over 4 ranks)."""
    if args[0].numel() > 0:
        return None
    return args[0].new_zeros(ctx.local_output_shape(0))


def _pad_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext) -> Any:
    empty = _empty_piece(args, ctx)
    return func(*args, **kwargs) if empty is None else empty


def _constant_pad_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    empty = _empty_piece(args, ctx)
    if empty is not None:
        return empty
    bound = bind(func, args, kwargs)
    value = bound.get("value", 0) if ctx.holds_constants() else 0
    return func(bound["self"], bound["pad"], value)


@register(aten.constant_pad_nd.default, family="padding", local=_constant_pad_local)
def constant_pad_rule(info: OpInfo) -> list[Strategy]:
    return list(pad_rule(info))


@register(*_COPYING, family="padding", local=_pad_local)
def pad_rule(info: OpInfo) -> list[Strategy]:
    bound = bind(info.func, info.args, info.kwargs)
    pad = list(bound["pad"] if "pad" in bound else bound["padding"])
    ndim = info.inputs[0].ndim
    out = [Strategy((Split(d),), (Split(d),)) for d in _unpadded_dims(ndim, pad)]
    out.append(Strategy((P,), (P,)))
    out.append(Strategy((B,), (B,)))
    return out


@register(*_COPYING_BACKWARD, family="padding", local=_pad_local)
def pad_backward_rule(info: OpInfo) -> list[Strategy]:
    pad = list(bind(info.func, info.args, info.kwargs)["padding"])
    ndim = info.inputs[1].ndim
    out = [Strategy((Split(d), Split(d)), (Split(d),)) for d in _unpadded_dims(ndim, pad)]
    out += [Strategy((P, B), (P,)), Strategy((B, B), (B,))]
    return out
