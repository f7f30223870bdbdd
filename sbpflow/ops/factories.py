"""Tensors made from another's metadata: ``*_like``, ``new_*``, and in-place fills and copies.

# NOTE [factory rules]
# These ops never read their input's values, so any input layout is accepted
# as it is (no boxing). The output follows the input's splits; a partial or
# broadcast input gives a broadcast output (``ones_like`` of a P tensor must
# not be P: the ranks' ones would sum to the number of ranks). ``new_*`` ops
# follow the input only when asked for the input's own shape, else broadcast.
# Random ``*_like`` ops draw from sbpflow's counter-based generator so the
# logical tensor depends only on the seed, like ``sbpflow.randn``.
#
# In-place ``fill_``/``copy_``/``zero_`` keep the written tensor's layout. On a
# partial-sum axis a constant is written by the group's first rank only
# (zeros elsewhere), so the ranks still sum to it.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _factories, _global
from ..sbp import Broadcast, SbpParallel, Split
from ._registry import LocalContext, OpInfo, Strategy, bind, register, register_decomposition

aten = torch.ops.aten

__all__: list[str] = []


def _follow(s: SbpParallel) -> SbpParallel:
    return s if isinstance(s, Split) else Broadcast()


def _like_strategies(info: OpInfo) -> list[Strategy]:
    """The input as it is (never boxed); the output follows its splits."""
    current = info.current[0]
    rest = tuple(Broadcast() for _ in info.inputs[1:])
    return [Strategy((current, *rest), (_follow(current),))]


@register(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, family="factories")
def like(info: OpInfo) -> list[Strategy]:
    return _like_strategies(info)


def _new_local(func: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> torch.Tensor:
    """``new_*`` with the size argument replaced by this rank's local size."""
    local_shape = list(ctx.local_output_shape(0))
    args = (args[0], local_shape, *args[2:])
    if func.overloadpacket is aten.new_empty_strided:
        strides, acc = [], 1
        for n in reversed(local_shape):
            strides.append(acc)
            acc *= max(n, 1)
        args = (args[0], local_shape, list(reversed(strides)), *args[3:])
    return func(*args, **kwargs)


@register(
    aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided,
    family="factories", local=_new_local,
)  # fmt: skip
def new(info: OpInfo) -> list[Strategy]:
    meta = info.inputs[0]
    if tuple(info.bound()["size"]) == meta.shape:
        return _like_strategies(info)
    return [Strategy((info.current[0],), (Broadcast(),))]


def _random_like(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    if not isinstance(x, _global.GlobalTensor):
        return NotImplemented
    bound = bind(func, args, kwargs)
    make = _factories.rand if func.overloadpacket is aten.rand_like else _factories.randn
    sbp = tuple(_follow(s) for s in x.sbp)
    out = make(*x.shape, placement=x.placement, sbp=sbp, dtype=bound.get("dtype") or x.dtype)
    device = bound.get("device")
    if device is not None and torch.device(device) != out._local.device:
        raise ValueError(f"{func} on a global tensor cannot move it to {device}; use .to_global.")
    return out


register_decomposition(aten.rand_like, aten.randn_like)(_random_like)


# -- in-place writes --------------------------------------------------------------------


def _fill_local(func: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> torch.Tensor:
    if ctx.holds_constants():
        return func(*args, **kwargs)
    return args[0].zero_()


@register(aten.fill_, family="factories", local=_fill_local)
def fill(info: OpInfo) -> list[Strategy]:
    rest = tuple(Broadcast() for _ in info.inputs[1:])  # a global 0-dim fill value: broadcast
    return [Strategy((info.current[0], *rest), (info.current[0],))]


@register(aten.zero_, family="factories")
def zero(info: OpInfo) -> list[Strategy]:
    return [Strategy((info.current[0],), (info.current[0],))]


def _copy_local(func: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> torch.Tensor:
    if len(ctx.input_layouts) == 1 and not ctx.holds_constants():
        return args[0].zero_()  # the source is a plain 0-dim tensor or a number
    return func(*args, **kwargs)


@register(aten.copy_, family="factories", local=_copy_local)
def copy(info: OpInfo) -> list[Strategy]:
    """The written tensor keeps its layout; a global source is boxed to match it."""
    dst, s = info.inputs[0], info.current[0]
    if len(info.inputs) == 1:
        return [Strategy((s,), (s,))]
    src = info.inputs[1]
    source: SbpParallel = s
    if isinstance(s, Split):
        d = s.dim - (dst.ndim - src.ndim)
        broadcast_dim = d < 0 or (src.shape[d] == 1 and dst.shape[s.dim] != 1)
        source = Broadcast() if broadcast_dim else Split(d)
    return [Strategy((s, source), (s,))]
