"""Pointwise ops: same layout in, same layout out (with broadcasting and scalars).

# NOTE [pointwise partials]
# Every pointwise op may split any output dim (each input split on the dim
# that lines up with it under broadcasting, or broadcast where it is
# broadcast) or run fully broadcast. A partial-sum input survives only where
# the op is linear in it: with P inputs summing to the logical value, the op
# applied rank by rank must sum to the op of the sum.
#   additive  add/sub/rsub: the global operands P together; a constant operand
#             (a number, a plain 0-dim tensor) is added by the first rank of
#             each partial group only, zero elsewhere: P + 2 adds 2 once, not
#             once per rank (the same for where's and masked_fill's constants)
#   scale     mul: one operand P, the others B (mul_: self, which it writes); div: the
#             numerator only
#   linear    neg/clone/widening float casts, and the backward of activations in
#             their incoming gradient (relu's threshold_backward, ...)
#   mixed     where (its branches), masked_fill (self), lerp (self and
#             end), addcmul/addcdiv (self with one factor / the numerator)
#   none      everything non-linear: exp, pow, relu, comparisons, clamp, ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..sbp import Broadcast, Partial, SbpParallel, Split
from ._registry import LocalContext, LocalFn, OpInfo, Strategy, register

__all__ = ["elementwise_strategies", "partial_strategy", "split_strategies"]

aten = torch.ops.aten


def _aligned_dim(
    out_ndim: int, in_shape: Sequence[int], out_dim: int, out_shape: Sequence[int]
) -> int | None:
    """The input dim that lines up with output dim ``out_dim`` under broadcasting, if not size-1."""
    offset = out_ndim - len(in_shape)
    d = out_dim - offset
    if d < 0 or (in_shape[d] == 1 and out_shape[out_dim] != 1):
        return None
    return d


def split_strategies(info: OpInfo) -> list[Strategy]:
    """Split on each non-empty output dim (inputs aligned or broadcast), then all-broadcast."""
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
    strategies.append(
        Strategy(tuple(Broadcast() for _ in range(n)), tuple(Broadcast() for _ in info.outputs))
    )
    return strategies


def partial_strategy(info: OpInfo, partial_inputs: set[int]) -> Strategy:
    """Inputs in ``partial_inputs`` partial-sum, the rest broadcast; outputs partial-sum."""
    ins = tuple(Partial() if k in partial_inputs else Broadcast() for k in range(len(info.inputs)))
    return Strategy(ins, tuple(Partial() for _ in info.outputs))


def elementwise_strategies(info: OpInfo, partial_ok: str = "none") -> list[Strategy]:
    """Split/broadcast strategies plus partial ones: ``partial_ok`` is "all" (every input P
    together), "one" (any single input P, the others B) or "none"."""
    strategies = split_strategies(info)
    n = len(info.inputs)
    if partial_ok == "all":
        strategies.append(partial_strategy(info, set(range(n))))
    elif partial_ok == "one":
        strategies.extend(partial_strategy(info, {k}) for k in range(n))
    return strategies


# -- which inputs may be partial together (see NOTE [pointwise partials]) ---------------

PartialSets = Callable[[OpInfo], list[set[int]]]


def _operands(info: OpInfo, positions: Sequence[int]) -> list[int] | None:
    """Input indices of the tensor operands at ``positions``; None if one is not global."""
    found = [info.input_at(p) for p in positions]
    if any(k is None for k in found):
        return None
    return [k for k in found if k is not None]


def _globals_at(info: OpInfo, positions: Sequence[int]) -> list[set[int]]:
    """The global operands among ``positions`` as one partial set (constants: see NOTE)."""
    ks = {k for k in (info.input_at(p) for p in positions) if k is not None}
    return [ks] if ks else []


def _additive(info: OpInfo) -> list[set[int]]:
    return _globals_at(info, (0, 1))


def _scale(info: OpInfo) -> list[set[int]]:
    if info.func.overloadpacket is aten.mul_:  # a P factor would make the B self it writes P
        return _first(info)
    return [{k} for k in (info.input_at(0), info.input_at(1)) if k is not None]


def _numerator(info: OpInfo) -> list[set[int]]:
    if info.kwargs.get("rounding_mode") is not None:
        return []
    k = info.input_at(0)
    return [{k}] if k is not None else []


def _first(info: OpInfo) -> list[set[int]]:
    k = info.input_at(0)
    return [{k}] if k is not None else []


def _float_cast(info: OpInfo) -> list[set[int]]:
    """Casts keep P only between floating types that lose nothing (the parts' rounding
    errors would add up, and casts to integers truncate each part)."""
    src, dst = info.inputs[0].dtype, info.outputs[0].dtype
    if not (src.is_floating_point and dst.is_floating_point):
        return []
    src_info, dst_info = torch.finfo(src), torch.finfo(dst)
    if dst_info.eps > src_info.eps or dst_info.max < src_info.max:
        return []
    return _first(info)


def _where(info: OpInfo) -> list[set[int]]:
    return _globals_at(info, (1, 2))


def _masked_fill(info: OpInfo) -> list[set[int]]:
    return _first(info) if info.input_at(2) is None else []


def _lerp(info: OpInfo) -> list[set[int]]:
    ks = _operands(info, (0, 1))
    return [set(ks)] if ks is not None else []


def _addcmul(info: OpInfo) -> list[set[int]]:
    k0 = info.input_at(0)
    if k0 is None:
        return []
    return [{k0, k} for k in (info.input_at(1), info.input_at(2)) if k is not None]


def _addcdiv(info: OpInfo) -> list[set[int]]:
    k0, k1 = info.input_at(0), info.input_at(1)
    return [{k0, k1}] if k0 is not None and k1 is not None else []


def _none(info: OpInfo) -> list[set[int]]:
    return []


def _zero_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return type(value)(0) if isinstance(value, (bool, int, float, complex)) else value


def _constants_on_first_rank(positions: Sequence[int]) -> LocalFn:
    """A local function zeroing constant operands at ``positions`` off the partial groups'
    first ranks (see NOTE [pointwise partials])."""

    def local(func: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> Any:
        # The superset test first: it is cheap, and when every such operand is global
        # (``x + y``) there is nothing to zero, so the mesh coordinates are not needed.
        if not ctx.global_args.issuperset(positions) and not ctx.holds_constants():
            args = tuple(
                _zero_like(a) if i in positions and i not in ctx.global_args else a
                for i, a in enumerate(args)
            )
        return func(*args, **kwargs)

    return local


def _family(names: Sequence[str], partials: PartialSets, constants: Sequence[int] = ()) -> None:
    """Register the pointwise rule for each name and its in-place ``name_`` form.

    ``constants``: positional args that, when not global, are constants only
    the first rank of a partial-sum group may apply.
    """
    ops = []
    for name in names:
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is not None:
                ops.append(packet)

    def rule(info: OpInfo) -> list[Strategy]:
        strategies = split_strategies(info)
        strategies.extend(partial_strategy(info, ks) for ks in partials(info))
        return strategies

    rule.__name__ = f"pointwise_{partials.__name__.strip('_')}"
    local = _constants_on_first_rank(tuple(constants)) if constants else None
    register(*ops, family="pointwise", local=local)(rule)


_family(["add", "sub", "rsub"], _additive, constants=(0, 1))
_family(["mul"], _scale)
_family(["div"], _numerator)
_family(["neg", "clone", "positive", "conj_physical", "deg2rad", "rad2deg"], _first)
_family(["_to_copy"], _float_cast)
_family(["where"], _where, constants=(1, 2))
_family(["masked_fill"], _masked_fill, constants=(2,))
_family(["lerp"], _lerp)
_family(["addcmul"], _addcmul)
_family(["addcdiv"], _addcdiv)
# Activation backward ops are linear in their first argument, the incoming gradient.
_family(
    [
        "threshold_backward",
        "gelu_backward",
        "silu_backward",
        "sigmoid_backward",
        "tanh_backward",
        "hardtanh_backward",
        "leaky_relu_backward",
        "elu_backward",
        "softplus_backward",
        "hardsigmoid_backward",
        "hardswish_backward",
        "mish_backward",
        "logit_backward",
    ],
    _first,
)
_family(
    [
        # unary math
        "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
        "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh",
        "acosh", "atanh", "erf", "erfc", "erfinv", "reciprocal", "sign", "sgn", "signbit",
        "floor", "ceil", "round", "trunc", "frac", "square", "sinc", "digamma", "lgamma",
        "nan_to_num", "isnan", "isinf", "isneginf", "isposinf", "logical_not", "bitwise_not",
        # activations
        "relu", "gelu", "silu", "sigmoid", "mish", "hardtanh", "hardsigmoid", "hardswish",
        "leaky_relu", "elu", "softplus", "logit", "threshold",
        # binary and ternary
        "pow", "fmod", "remainder", "atan2", "hypot", "maximum", "minimum", "fmax", "fmin",
        "floor_divide", "xlogy", "copysign", "heaviside", "clamp", "clamp_min", "clamp_max",
        "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
        # comparisons
        "eq", "ne", "lt", "le", "gt", "ge",
    ],
    _none,
)  # fmt: skip
# torch.max(a, b) / torch.min(a, b): the reductions module owns the other overloads.
register(aten.max.other, aten.min.other, family="pointwise")(split_strategies)
