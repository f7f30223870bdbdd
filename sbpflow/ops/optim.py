"""Optimizer support: ``_foreach_*`` ops, and the AMP inf check whose flag every rank must share.

# NOTE [optimizer ops]
# With the default settings torch.optim's SGD/Adam/AdamW take the single-tensor
# path for global parameters (foreach needs plain tensors), so their updates
# are the pointwise in-place ops (add_, mul_, lerp_, addcmul_, addcdiv_, sqrt,
# ...) of pointwise.py. Each parameter's gradient arrives in the parameter's
# own layout (``keep_grad_layout`` in _global.py), so every update is local.
#
# ``foreach=True`` (or a caller using ``torch._foreach_*`` directly) reaches
# dispatch with lists of tensors. Lists whose positions are each computable on
# the pieces run as one ``_foreach_*`` kernel there (NOTE [foreach on the
# pieces] in _foreach.py); otherwise each list position is dispatched on its
# own, as the single op it stands for.
#
# NOTE [AMP found-inf]
# ``GradScaler.unscale_`` checks gradients for inf/nan with
# ``_amp_foreach_non_finite_check_and_unscale_`` and ``update`` feeds the flag to
# ``_amp_update_scale_``. Each rank sees only its pieces (a split gradient can
# overflow on one rank only), so the flag is combined with an all_reduce(max)
# over the whole world: every rank then skips (or takes) the step and keeps the
# same scale, ranks outside the gradients' placements included.
# The world, and not the union of the gradients' placements: that union may be
# no placement any op used (pipeline stages on [0, 1] and [2] of four ranks),
# and creating its group at step time is a collective that the ranks outside
# it never enter (NOTE [group creation order] in comm/_groups.py). The world
# group always exists; the flag is one float. Every rank runs the same program,
# so every rank's scaler makes the same unscale_ calls. ``_amp_update_scale_``
# then sees plain tensors (the scaler's own state): it runs locally, on equal
# inputs everywhere, and needs no rule.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _global
from .._layout import Layout
from ..boxing._redistribute import box_below_autograd
from ..comm._world import get_world_size
from ..placement import Placement
from ..sbp import Broadcast, Partial
from ._foreach import on_pieces
from ._registry import register_decomposition

aten = torch.ops.aten

__all__: list[str] = []

# Foreach ops whose trailing positional scalar is keyword-only in the single op.
_VALUE_KWARG = {"addcmul", "addcdiv"}


def _base_op(func: Any) -> tuple[Any, str]:
    name = func.overloadpacket.__name__  # e.g. "_foreach_add_"
    base = name[len("_foreach_") :]
    packet = aten.linalg_vector_norm if base == "norm" else getattr(aten, base, None)
    if packet is None:
        raise NotImplementedError(
            f"{func} on global tensors: no single-tensor op aten.{base} to apply per item."
        )
    return packet, base.rstrip("_")


def foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """One kernel on the pieces where the lists allow it, else the op per list position."""
    out = on_pieces(func, args, kwargs)
    if out is not NotImplemented:
        return out
    return per_item(func, args, kwargs)


def per_item(func: Any, args: tuple, kwargs: dict) -> Any:
    """Apply the single-tensor op to each list position (each dispatches on its own)."""
    packet, base = _base_op(func)
    lengths = {len(a) for a in args if isinstance(a, (list, tuple))}
    assert len(lengths) == 1, f"{func}: list arguments of different lengths {sorted(lengths)}"
    count = lengths.pop()
    per_item_scalars = None
    if base in _VALUE_KWARG and func._overloadname == "Tensor":
        per_item_scalars = args[3].tolist()  # a 1-D tensor of per-item values
        args = args[:3]
    results = []
    for i in range(count):
        item_args = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
        item_kwargs = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}
        if base in _VALUE_KWARG:
            if per_item_scalars is not None:
                item_kwargs["value"] = per_item_scalars[i]
            elif len(item_args) > 3:
                item_kwargs["value"] = item_args.pop(3)
        if base == "norm" and len(item_args) > 2:  # _foreach_norm(self, ord, dtype)
            dtype = item_args.pop(2)
            if dtype is not None:
                item_kwargs["dtype"] = dtype
        results.append(packet(*item_args, **item_kwargs))
    if func._schema.returns:
        return results
    return None


# The foreach ops torch.optim, clip_grad_norm_ and GradScaler use (each also in place).
_FOREACH = [
    "add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "maximum",
    "minimum", "clamp_min", "clamp_max", "pow", "neg", "abs", "exp", "log", "sign",
    "reciprocal", "sigmoid", "copy", "zero", "norm", "max",
]  # fmt: skip


def _foreach_packets() -> list[Any]:
    names = [f"_foreach_{base}{suffix}" for base in _FOREACH for suffix in ("", "_")]
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


register_decomposition(*_foreach_packets())(foreach)


def foreach_overloads() -> list[Any]:
    """Every overload of those ops except ``out=`` ones (the dispatcher's first stop for them,
    NOTE [foreach on the pieces])."""
    overloads = [getattr(p, name) for p in _foreach_packets() for name in p.overloads()]
    return [op for op in overloads if not any(a.is_out for a in op._schema.arguments)]


@register_decomposition(aten._amp_foreach_non_finite_check_and_unscale_)
def amp_check_and_unscale(func: Any, args: tuple, kwargs: dict) -> None:
    """Unscale every gradient in place; found_inf becomes the max over every rank (NOTE [AMP
    found-inf])."""
    grads, found_inf, inv_scale = args
    if isinstance(found_inf, _global.GlobalTensor) or isinstance(inv_scale, _global.GlobalTensor):
        raise NotImplementedError(
            f"{func} with a global found_inf/inv_scale; torch.amp.GradScaler keeps them as plain "
            "tensors, which is the supported use."
        )
    locals_ = [g._local if isinstance(g, _global.GlobalTensor) else g for g in grads]
    local_flag = torch.zeros_like(found_inf)
    if locals_:
        func(locals_, local_flag, inv_scale)
    found_inf.copy_(torch.maximum(found_inf, _max_over_world(local_flag)))


def _max_over_world(flag: torch.Tensor) -> torch.Tensor:
    """All_reduce(max) of a 0-dim flag over every rank of the world (its group always exists)."""
    world = Placement(flag.device.type, list(range(get_world_size())))
    partial = _global.GlobalTensor(flag, Layout(world, (Partial("max"),)), ())
    return box_below_autograd(partial, Layout(world, (Broadcast(),)))._local.to(flag.device)
