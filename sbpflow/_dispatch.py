"""The one dispatch path for ATen ops on global tensors.

# NOTE [dispatch]
# 1. Ops that only touch metadata or aliasing (detach, alias) are handled here.
# 2. Otherwise the op's SBP rule (registered per op family in ``sbpflow.ops``)
#    proposes signatures; the one with the lowest boxing cost wins, inputs are
#    boxed to it, the op runs on local tensors, and outputs are wrapped with the
#    signature's output SBP.
# 3. An op with no rule falls back to boxing every input to broadcast and
#    computing locally: always correct, never silent (warns once per op).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._layout import Layout
from .sbp import Broadcast

aten = torch.ops.aten

_warned: set[str] = set()
_special: dict[Any, Callable[..., Any]] = {}


def special(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _special[op] = fn
        return fn

    return register


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    handler = _special.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    from .ops import _registry

    rule = _registry.lookup(func)
    if rule is not None:
        return _registry.run_rule(rule, func, args, kwargs)
    return fallback(func, args, kwargs)


@special(aten.detach.default, aten.alias.default)
def _alias(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from .tensor import GlobalTensor

    x = args[0]
    return GlobalTensor(func(x._local), x._layout, x.shape)


def fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Box every global input to broadcast, run locally, wrap outputs as broadcast."""
    from .boxing import tracing as _trace
    from .tensor import GlobalTensor, _run_plan

    name = str(func)
    _trace.record_fallback(name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"sbpflow: no SBP rule for {name}; its global inputs are gathered to broadcast and "
            "it runs on every rank (correct, but slow). Register a rule in sbpflow.ops to avoid this.",
            stacklevel=3,
        )
    flat, spec = tree_flatten((args, kwargs))
    placement = None
    for i, a in enumerate(flat):
        if isinstance(a, GlobalTensor):
            if placement is None:
                placement = a.placement
            elif a.placement != placement:
                raise ValueError(
                    f"{name} got global tensors on different placements ({placement} and "
                    f"{a.placement}); move them to one placement with .to_global(placement) first."
                )
            dst = Layout(a.placement, tuple(Broadcast() for _ in a.sbp))
            flat[i] = (_run_plan(a, dst) if a._layout != dst else a)._local
    assert placement is not None
    local_args, local_kwargs = tree_unflatten(flat, spec)
    out = func(*local_args, **local_kwargs)
    layout = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
    return tree_map(
        lambda o: GlobalTensor(o, layout, o.shape) if isinstance(o, torch.Tensor) else o, out
    )
