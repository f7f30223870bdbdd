"""``_foreach_*`` ops on lists of global tensors laid out alike: one kernel on the pieces.

# NOTE [foreach on the pieces]
# torch.optim (``foreach=True``; the default for CUDA parameters), ``clip_grad_norm_`` and
# ``clip_grad_value_`` call ``_foreach_*`` ops on lists of tensors. On global tensors a list
# position is local when its operands (the tensors the lists hold at that position) agree
# axis by axis:
#   - all broadcast, or all split on the same dim: the result has that SBP;
#   - partial-sum where the op is linear in them, the other operands broadcast (NOTE
#     [pointwise partials] in pointwise.py): add/sub of two P lists, mul/div of a P list by
#     numbers, a 0-dim plain tensor or (mul) a B list, lerp of P ends, addcmul of a P self
#     with one P factor, addcdiv of a P self and numerator, neg, zero, copy of P into P;
#     the result is P. ``sqrt`` of P, P * P, P + a number are not local.
# Operands at one position also share their logical shape and placement (positions may
# differ from each other: a rank outside a position's placement runs the kernel on its
# empty pieces). An op writing into its first list must leave each tensor in its layout.
# A single tensor argument (``_foreach_mul.Tensor``'s factor) must be a plain 0-dim tensor.
#
# A call whose positions are all local runs the ``_foreach_*`` kernel once on the pieces:
# one dispatch, one kernel, outputs wrapped with the layouts found. What the positions
# allow is decided once per call signature (the op and the operands' interned metadata,
# NOTE [interned metadata] in _global) and cached; a repeated call only unwraps, runs and
# wraps. Anything else (a position that is not local, a global single tensor argument, a
# differentiated call, integer outputs whose dtype the op may change) returns
# NotImplemented and the caller applies the single-tensor op position by position, which
# boxes as its rule decides: slower, never wrong.
#
# ``_foreach_norm`` (p > 0) and ``_foreach_max`` reduce each tensor to a number. A
# position with no split axis gets it from its piece; positions split on some axes give
# a per-piece partial (|x|^p summed over the piece: the piece's norm to the p-th power;
# or its max), stacked and combined by one boxing ``P -> B`` per layout, all positions of
# that layout at once. Partial inputs are left to the single-tensor path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import _global
from .._bounded import BoundedDict
from .._layout import Layout, empty_local_shape
from .._view_writes import may_hold_a_copy, refuse_detached_view_writes
from ..boxing._redistribute import box_below_autograd
from ..comm._world import get_rank
from ..sbp import Broadcast, Partial, SbpParallel, Split

__all__ = ["on_pieces"]

_SUM = Partial("sum")

# Which list operands (by their index among the op's tensor lists) may be partial-sum
# together at one position, per op and overload (NOTE [foreach on the pieces]).
_LINEAR: dict[str, dict[str, tuple[frozenset[int], ...]]] = {
    "add": {"List": (frozenset({0, 1}),)},
    "sub": {"List": (frozenset({0, 1}),)},
    "mul": {
        "List": (frozenset({0}), frozenset({1})),
        "Scalar": (frozenset({0}),),
        "ScalarList": (frozenset({0}),),
        "Tensor": (frozenset({0}),),
    },
    "div": {
        "List": (frozenset({0}),),
        "Scalar": (frozenset({0}),),
        "ScalarList": (frozenset({0}),),
        "Tensor": (frozenset({0}),),
    },
    "neg": {"default": (frozenset({0}),)},
    "zero": {"default": (frozenset({0}),)},
    "copy": {"default": (frozenset({0, 1}),)},
    "lerp": {
        "List": (frozenset({0, 1}),),
        "Scalar": (frozenset({0, 1}),),
        "ScalarList": (frozenset({0, 1}),),
    },
    "addcmul": {
        kind: (frozenset({0, 1}), frozenset({0, 2})) for kind in ("Scalar", "ScalarList", "Tensor")
    },
    "addcdiv": {kind: (frozenset({0, 1}),) for kind in ("Scalar", "ScalarList", "Tensor")},
}

_REDUCTIONS = {"norm", "max"}


@dataclass(frozen=True)
class _Signature:
    """Where an op's arguments are: tensor lists and single tensors, by position."""

    base: str  # "add" for _foreach_add_
    in_place: bool
    lists: tuple[int, ...]  # positional indices of the Tensor[] arguments
    tensors: tuple[int, ...]  # positional indices of single Tensor arguments


_signatures: dict[Any, _Signature] = {}


def _signature(func: Any) -> _Signature:
    found = _signatures.get(func)
    if found is None:
        name = func.overloadpacket.__name__[len("_foreach_") :]
        arguments = [a for a in func._schema.arguments if not a.kwarg_only]
        kinds = [str(a.type) for a in arguments]
        found = _signatures[func] = _Signature(
            base=name.rstrip("_"),
            in_place=name.endswith("_"),
            lists=tuple(i for i, k in enumerate(kinds) if k == "List[Tensor]"),
            tensors=tuple(i for i, k in enumerate(kinds) if k == "Tensor"),
        )
    return found


@dataclass(frozen=True)
class _Plan:
    """A decided call: the outputs' metadata (empty for an in-place op)."""

    outputs: tuple[_global.Meta, ...]


@dataclass(frozen=True)
class _ReductionPlan:
    """A decided ``_foreach_norm``/``_foreach_max``: per position its output metadata and
    whether this rank holds a piece; the split positions grouped by the partial layout
    their per-piece values make and their dtype (combined by one boxing to broadcast per
    group)."""

    outputs: tuple[_global.Meta, ...]
    inside: tuple[bool, ...]
    groups: tuple[tuple[Layout, tuple[int, ...]], ...]


_NO_PLAN: Any = object()  # a signature the pieces cannot compute: the per-item path
PLANS_BOUND = 1024
_plans: BoundedDict[Any, Any] = BoundedDict("foreach plans", PLANS_BOUND)


def on_pieces(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` once on the local pieces, or NotImplemented (NOTE [foreach on the pieces])."""
    signature = _signature(func)
    if any(isinstance(v, torch.Tensor) or type(v) in (list, tuple) for v in kwargs.values()):
        return NotImplemented  # out= overloads and anything unusual
    per_position = signature.base in ("addcmul", "addcdiv")  # a number per position
    for i in signature.tensors:
        t = args[i]
        if _is_global(t) or t.dim() != (1 if per_position else 0) or t.is_conj() or t.is_neg():
            return NotImplemented  # lazy bits (NOTE [lazy bits]): the general path resolves them
    try:
        metas = tuple([tuple([t._meta for t in args[i]]) for i in signature.lists])
    except AttributeError:  # a plain tensor in a list: it joins as broadcast, item by item
        return NotImplemented
    if torch.is_grad_enabled() and any(t.requires_grad for i in signature.lists for t in args[i]):
        return NotImplemented  # differentiated: the single ops keep their gradient plans
    if signature.in_place and any(may_hold_a_copy(t) for t in args[0]):
        refuse_detached_view_writes(func, args, kwargs)  # NOTE [view writes]
    key = (func, metas, *(() if signature.base not in _REDUCTIONS else _reduction_args(func, args)))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _decide(func, signature, metas, args) or _NO_PLAN
    if plan is _NO_PLAN:
        return NotImplemented
    if isinstance(plan, _ReductionPlan):
        return _run_reduction(func, args, plan) if not kwargs else NotImplemented
    local_args = list(args)
    for i in signature.lists:
        local_args[i] = [t._local for t in args[i]]
    out = func(*local_args, **kwargs)
    if signature.in_place:
        return None
    wrap = _global.wrap
    return [wrap(o, meta) for o, meta in zip(out, plan.outputs, strict=True)]


def _is_global(t: Any) -> bool:  # read at call time (NOTE [tensor layers] in _global)
    return isinstance(t, _global.GlobalTensor)


def _decide(func: Any, signature: _Signature, metas: tuple, args: tuple) -> Any:
    if signature.base in _REDUCTIONS:
        return _decide_reduction(func, metas[0], args)
    linear = _LINEAR.get(signature.base, {}).get(func._overloadname, ())
    outputs = []
    for position in zip(*metas, strict=True):
        layout = _position_layout(position, linear)
        if layout is None:
            return None
        first = position[0]
        if signature.in_place:
            if layout != first.layout.normalized():
                return None  # the op would change the layout of the tensor it writes
            continue
        if any(m.dtype != first.dtype for m in position) or not (
            first.dtype.is_floating_point or first.dtype.is_complex
        ):
            return None  # the output's dtype is the inputs' only for equal floating dtypes
        if layout == first.layout.normalized():
            outputs.append(first)
        else:
            outputs.append(_global.meta_of(layout, first.shape, first.dtype, first.strides))
    return _Plan(tuple(outputs))


def _position_layout(
    position: tuple[_global.Meta, ...], linear: tuple[frozenset[int], ...]
) -> Layout | None:
    """The output layout of one list position computed on the pieces, or None if it cannot be."""
    first = position[0]
    placement = first.layout.placement
    if any(m.shape != first.shape or m.layout.placement != placement for m in position[1:]):
        return None
    layouts = [m.layout.normalized() for m in position]
    out: list[SbpParallel] = []
    for axis in range(placement.ndim):
        sbps = [layout.sbp[axis] for layout in layouts]
        partial = frozenset(k for k, s in enumerate(sbps) if isinstance(s, Partial))
        if partial:
            if partial not in linear or any(sbps[k] != _SUM for k in partial):
                return None
            if any(not isinstance(s, Broadcast) for k, s in enumerate(sbps) if k not in partial):
                return None
            out.append(_SUM)
        elif all(s == sbps[0] for s in sbps):
            out.append(sbps[0])
        else:
            return None  # split against broadcast, or on different dims
    return Layout(placement, tuple(out))


# -- reductions: _foreach_norm and _foreach_max -----------------------------------------


def _reduction_args(func: Any, args: tuple) -> tuple[Any, ...]:
    """``(ord, dtype)`` of a ``_foreach_norm`` call (exact: they decide), ``()`` for max."""
    if func.overloadpacket is torch.ops.aten._foreach_norm:
        ord_ = args[1] if len(args) > 1 else 2
        dtype = args[2] if len(args) > 2 else None
        return (float(ord_), dtype)
    return ()


def _decide_reduction(func: Any, metas: tuple[_global.Meta, ...], args: tuple) -> Any:
    norm = func.overloadpacket is torch.ops.aten._foreach_norm
    if norm:
        ord_, dtype = _reduction_args(func, args)
        if not ord_ > 0:  # 0, negative, -inf, nan: not a sum of powers nor a max
            return None
        reduce_op = "max" if math.isinf(ord_) else "sum"
    else:
        reduce_op, dtype = "max", None
    rank = get_rank()
    outputs, inside, groups = [], [], {}
    for k, meta in enumerate(metas):
        layout = meta.layout.normalized()
        if layout.has_partial:
            return None
        if norm and not (meta.dtype.is_floating_point or meta.dtype.is_complex):
            return None
        out_dtype = dtype or (meta.dtype.to_real() if norm else meta.dtype)
        broadcast = tuple(Broadcast() for _ in layout.sbp)
        outputs.append(_global.meta_of(Layout(layout.placement, broadcast), (), out_dtype))
        inside.append(rank in layout.placement)
        if any(isinstance(s, Split) for s in layout.sbp):
            partial = tuple(
                Partial(reduce_op) if isinstance(s, Split) else Broadcast() for s in layout.sbp
            )
            groups.setdefault((Layout(layout.placement, partial), out_dtype), []).append(k)
    return _ReductionPlan(
        tuple(outputs), tuple(inside), tuple((g, tuple(ks)) for (g, _), ks in groups.items())
    )


def _run_reduction(func: Any, args: tuple, plan: _ReductionPlan) -> list[_global.GlobalTensor]:
    tensors = args[0]
    norm = func.overloadpacket is torch.ops.aten._foreach_norm
    ord_ = _reduction_args(func, args)[0] if norm else math.inf
    split = {k for _, ks in plan.groups for k in ks}
    # Split pieces may be empty (uneven shards): their partial is the reduction's identity,
    # 0 (norms are >= 0) or the lowest value (max), without asking the kernel.
    run = [
        k
        for k, t in enumerate(tensors)
        if plan.inside[k] and not (k in split and t._local.numel() == 0)
    ]
    values = dict(zip(run, func([tensors[k]._local for k in run], *args[1:]), strict=True))
    wrap = _global.wrap
    results: list[Any] = [None] * len(tensors)
    for k, meta in enumerate(plan.outputs):
        if not plan.inside[k]:
            results[k] = _global.empty_piece(meta)
        elif k not in split:
            results[k] = wrap(values[k], meta)
    for partial, ks in plan.groups:
        meta = plan.outputs[ks[0]]
        device = tensors[ks[0]]._local.device
        inside = plan.inside[ks[0]]  # a group's positions share one placement
        if inside:
            identity = 0 if norm else Partial("max").identity(meta.dtype)
            local = torch.stack(
                [
                    values[k]
                    if k in values
                    else torch.full((), identity, dtype=meta.dtype, device=device)
                    for k in ks
                ]
            )
            if norm and not (math.isinf(ord_) or ord_ == 1):
                local = local.pow(ord_)
        else:
            local = torch.empty(empty_local_shape(1), dtype=meta.dtype, device=device)
        total = box_below_autograd(_global.GlobalTensor(local, partial, (len(ks),)), meta.layout)
        if not inside:
            continue
        combined = total._local
        if norm and ord_ == 2:
            combined = combined.sqrt()
        elif norm and not (math.isinf(ord_) or ord_ == 1):
            combined = combined.pow(1.0 / ord_)
        for k, value in zip(ks, combined.unbind(0), strict=True):
            results[k] = wrap(value, plan.outputs[k])
    return results
