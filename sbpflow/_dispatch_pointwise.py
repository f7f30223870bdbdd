"""The optimizer's pointwise ops on global tensors of one layout: straight to the pieces.

# NOTE [same-layout pointwise]
# An optimizer's per-parameter loop (torch's AdamW on CPU: ``mul_``, ``lerp_``, ``mul_``,
# ``addcmul_``, ``sqrt``, ``div``, ``add_``, ``addcdiv_`` per parameter, every step) calls
# pointwise ops whose global operands all carry one interned metadata: the parameter's
# layout, shape, dtype and strides. Such a call is local whatever the layout holds, as
# long as no axis of it is partial: each rank's pieces are the same region of every
# operand, so the op on the pieces is the op on the logical tensors, and the result keeps
# the operands' metadata. Partial layouts never qualify (``sqrt`` or ``+ eps`` of a partial
# sum is not the sum of the pieces' results; the rules in ops/pointwise.py decide those).
# This handler runs first for the ops listed below (NOTE [dispatch], 1) and takes a call
# only when:
#   - every tensor argument is a global tensor with the same ``Meta`` (so the same layout,
#     logical shape, dtype and strides: no broadcasting, no type promotion between
#     tensors; one interned object, or equal ones once the table dropped the first),
#     floating point, with no partial axis;
#   - every other argument is a Python ``float``, ``int`` or ``bool``, positional or one of
#     the op's scalar keywords; an out-of-place op's operands are contiguous (the result's
#     logical strides are then the operands');
#   - the sizes are plain integers (symbolic ones, from a dynamic-shape trace, are not);
#   - no plan is being followed (``FOLLOWING``), and autograd records nothing (grad mode off
#     or no operand requiring grad: a recorded op keeps its gradient plan, NOTE [gradient
#     plan]).
# Anything else returns NotImplemented and takes the general path; a write into a global
# view holding a copy is refused as there (NOTE [view writes]). A rank outside the
# placement holds empty pieces and runs the op on them: the same empty results.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _global
from ._bounded import BoundedDict
from ._decisions import FOLLOWING
from ._view_writes import holds_copy, refuse_detached_view_writes

__all__ = ["SAME_LAYOUT_OPS", "same_layout"]

aten = torch.ops.aten

# op -> whether it writes its first argument (and returns it)
SAME_LAYOUT_OPS: dict[Any, bool] = {
    **dict.fromkeys(
        [
            aten.mul_.Tensor, aten.mul_.Scalar, aten.add_.Tensor, aten.add_.Scalar,
            aten.sub_.Tensor, aten.sub_.Scalar, aten.div_.Tensor, aten.div_.Scalar,
            aten.lerp_.Scalar, aten.addcmul_.default, aten.addcdiv_.default,
            aten.sqrt_.default, aten.copy_.default,
        ],
        True,
    ),
    **dict.fromkeys(
        [
            aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar,
            aten.sub.Tensor, aten.sub.Scalar, aten.div.Tensor, aten.div.Scalar,
            aten.sqrt.default, aten.maximum.default,
        ],
        False,
    ),
}  # fmt: skip
_SCALAR_KWARGS = frozenset({"alpha", "value", "non_blocking"})
_NUMBERS = frozenset({float, int, bool})
# The kernels (``op._op``, hashed in C where an OpOverload hashes in Python) of the ops that
# write their first argument.
_IN_PLACE_KERNELS = frozenset(op._op for op, in_place in SAME_LAYOUT_OPS.items() if in_place)

# Meta -> _NO (floating with no partial axis: no), _IN_PLACE_ONLY (yes, strided) or _ANY
# (yes, contiguous). Metas are interned and compared by identity (NOTE [bounded caches]).
_NO, _IN_PLACE_ONLY, _ANY = 0, 1, 2
QUALIFIES_BOUND = 4096
_qualifies: BoundedDict[Any, int] = BoundedDict("same-layout pointwise metas", QUALIFIES_BOUND)
_following = FOLLOWING.get
_grad_enabled = torch.is_grad_enabled


def _kind(meta: Any) -> int:
    """What ``_qualifies`` holds for ``meta``, computed and stored (its miss)."""
    symbolic = any(type(n) is not int for n in (*meta.shape, *meta.strides))
    if symbolic or not meta.dtype.is_floating_point or meta.layout.has_partial:
        found = _NO
    elif meta.strides == _global._contiguous_strides(meta.shape):
        found = _ANY
    else:
        found = _IN_PLACE_ONLY
    _qualifies[meta] = found
    return found


def same_layout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on the pieces when its operands share one layout (NOTE [same-layout
    pointwise]); NotImplemented otherwise.

    It runs for every op of an optimizer's loop, so each check is spelled out here, inline,
    cheapest first: no call that is not needed (each costs as much as a check)."""
    gt = _global.GlobalTensor
    first = args[0] if args else None
    if not isinstance(first, gt):
        return NotImplemented
    meta = first._meta
    kind = _qualifies.get(meta)
    if kind is None:
        kind = _kind(meta)
    in_place = func._op in _IN_PLACE_KERNELS
    if kind == _NO or (kind == _IN_PLACE_ONLY and not in_place) or _following() is not None:
        return NotImplemented
    recording = _grad_enabled()
    if recording and first.requires_grad:
        return NotImplemented
    local_args = [first._local]
    for a in args[1:]:
        if isinstance(a, gt):
            if (a._meta is not meta and not _equal(a._meta, meta)) or (
                recording and a.requires_grad
            ):
                return NotImplemented
            local_args.append(a._local)
        elif type(a) in _NUMBERS:
            local_args.append(a)
        else:
            return NotImplemented
    if kwargs:
        for name, value in kwargs.items():
            if name not in _SCALAR_KWARGS or type(value) not in _NUMBERS:
                return NotImplemented
    if not in_place:
        return _global.wrap(func._op(*local_args, **kwargs), meta)
    if first._is_view() or holds_copy(first):  # may hold a copy (NOTE [view writes])
        refuse_detached_view_writes(func, args, kwargs)
    func._op(*local_args, **kwargs)
    return first


def _equal(a: Any, b: Any) -> bool:
    """Two metadata objects of one value: interning keeps one object per value, but once the
    bounded table has dropped an entry (NOTE [bounded caches]), a tensor made since holds a
    new object while an older one (a parameter) keeps the first."""
    return (
        a.layout == b.layout
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.strides == b.strides
    )
