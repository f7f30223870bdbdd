"""The one dispatch path for ATen ops on global tensors.

# NOTE [dispatch]
# 1. Ops that only touch metadata or aliasing (detach, alias) are handled here.
# 2. Otherwise the op's SBP rule (registered per op family in ``sbpflow.ops``,
#    see NOTE [rules]) proposes per-axis strategies; their N-D combination
#    whose input boxing is cheapest wins, inputs are boxed to it, the op runs
#    on local tensors, and outputs are wrapped with the strategy's output SBP.
#    The decision is cached per (op, input layouts, shapes, dtypes, arguments).
# 3. An op with no rule falls back to boxing every input to broadcast and
#    computing locally: always correct, never silent (warns once per op).
# Boxing here is not differentiable: dispatch runs below autograd, which
# differentiates the op itself through its backward formula (more ops).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._layout import Layout
from .boxing import tracing as _trace
from .boxing.planner import plan as _plan
from .comm._world import get_rank
from .ops import _registry
from .ops._registry import LocalContext, OpInfo, Strategy, TensorMeta
from .placement import Placement
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
    _load_rules()
    registered = _registry.lookup(func)
    if registered is None:
        return fallback(func, args, kwargs)
    return _run_rule(registered, func, args, kwargs)


def _load_rules() -> None:
    from . import ops  # noqa: F401  (importing the package registers every family)


@special(aten.detach.default, aten.alias.default)
def _alias(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from .tensor import GlobalTensor

    x = args[0]
    return GlobalTensor(func(x._local), x._layout, x.shape)


# -- rules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Decision:
    input_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout, ...]
    output_metas: tuple[TensorMeta, ...]


_decisions: dict[Any, _Decision] = {}


def _run_rule(registered: _registry.Registered, func: Any, args: tuple, kwargs: dict) -> Any:
    from .tensor import GlobalTensor, _run_plan

    flat, spec = tree_flatten((args, kwargs))
    placement = _common_placement(func, flat)
    full = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
    for i, a in enumerate(flat):  # plain tensors join as broadcast globals (scalars stay)
        if type(a) is torch.Tensor and a.dim() > 0:
            flat[i] = GlobalTensor(a, full, a.shape)
    positions = [i for i, a in enumerate(flat) if isinstance(a, GlobalTensor)]
    globals_ = [flat[i] for i in positions]
    key = _cache_key(func, flat)
    decision = _decisions.get(key) if key is not None else None
    if decision is None:
        decision = _decide(registered, func, flat, spec, positions, placement)
        if key is not None:
            _decisions[key] = decision
    mutated = _mutated_ids(func, args, kwargs)
    local_flat = list(flat)
    for i, g, layout in zip(positions, globals_, decision.input_layouts):
        if g._layout != layout:
            if id(g) in mutated:
                raise RuntimeError(
                    f"{func} writes into an input laid out as {g._layout} but needs {layout}; "
                    "box the input with .to_global(sbp=...) first."
                )
            g = _run_plan(g, layout)
        local_flat[i] = g._local
    local_args, local_kwargs = tree_unflatten(local_flat, spec)
    rank = get_rank()
    if rank not in placement:
        return _wrap_outputs_outside(func, decision, local_args, local_kwargs)
    if registered.local is not None:
        ctx = LocalContext(
            rank,
            list(decision.input_layouts),
            list(decision.output_layouts),
            [TensorMeta(tuple(g.shape), g.dtype) for g in globals_],
            list(decision.output_metas),
        )
        out = registered.local(func, local_args, local_kwargs, ctx)
    else:
        out = func(*local_args, **local_kwargs)
    return _wrap_outputs(out, decision, globals_, mutated)


def _common_placement(func: Any, flat: list[Any]) -> Placement:
    from .tensor import GlobalTensor

    placement = None
    for a in flat:
        if isinstance(a, GlobalTensor):
            if placement is None:
                placement = a.placement
            elif a.placement != placement:
                raise ValueError(
                    f"{func} got global tensors on different placements ({placement} and "
                    f"{a.placement}); move them to one placement with .to_global(placement) first."
                )
    assert placement is not None
    return placement


def _cache_key(func: Any, flat: list[Any]) -> Any:
    from .tensor import GlobalTensor

    parts: list[Any] = [func]
    for a in flat:
        if isinstance(a, GlobalTensor):
            parts.append((a._layout, tuple(a.shape), a.dtype))
        elif isinstance(a, torch.Tensor):
            parts.append(("t", tuple(a.shape), a.dtype))
        else:
            parts.append(a)
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _to_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        from .tensor import GlobalTensor

        if isinstance(a, GlobalTensor):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        return a.to("meta")
    return a


def _decide(
    registered: _registry.Registered,
    func: Any,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    placement: Placement,
) -> _Decision:
    meta_args, meta_kwargs = tree_unflatten([_to_meta(a) for a in flat], spec)
    meta_out = func(*meta_args, **meta_kwargs)
    out_flat, _ = tree_flatten(meta_out)
    output_metas = tuple(TensorMeta(tuple(o.shape), o.dtype) for o in out_flat if isinstance(o, torch.Tensor))
    info_flat = list(flat)
    inputs = []
    for i in positions:
        meta = TensorMeta(tuple(flat[i].shape), flat[i].dtype)
        info_flat[i] = meta
        inputs.append(meta)
    info_args, info_kwargs = tree_unflatten(info_flat, spec)
    per_axis: list[list[Strategy]] = []
    for size in placement.shape:
        info = OpInfo(func, info_args, info_kwargs, inputs, list(output_metas), size)
        strategies = list(registered.rule(info))
        if not strategies:
            raise RuntimeError(f"the SBP rule for {func} returned no strategy for {_describe(flat)}")
        per_axis.append(strategies)
    current = [flat[i]._layout for i in positions]
    best = None
    for combo in itertools.product(*per_axis):
        ins = tuple(Layout(placement, tuple(s.inputs[k] for s in combo)) for k in range(len(positions)))
        cost = 0.0
        for layout, have, meta in zip(ins, current, inputs):
            if layout.normalized() != have.normalized():
                cost += _plan(meta.shape, meta.dtype, have, layout).cost + 1e-9
        if best is None or cost < best[0]:
            outs = tuple(Layout(placement, tuple(s.outputs[k] for s in combo)) for k in range(len(output_metas)))
            best = (cost, ins, outs)
    assert best is not None
    return _Decision(best[1], best[2], output_metas)


def _describe(flat: list[Any]) -> str:
    from .tensor import GlobalTensor

    return ", ".join(
        f"{a.sbp} {list(a.shape)}" if isinstance(a, GlobalTensor) else type(a).__name__
        for a in flat
        if isinstance(a, torch.Tensor)
    )


def _mutated_ids(func: Any, args: tuple, kwargs: dict) -> set[int]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return set()
    ids: set[int] = set()
    for index, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for item in tree_flatten(value)[0]:
            if isinstance(item, torch.Tensor):
                ids.add(id(item))
    return ids


def _wrap_outputs(out: Any, decision: _Decision, globals_: list[Any], mutated: set[int]) -> Any:
    from .tensor import GlobalTensor

    by_local = {id(g._local): g for g in globals_ if id(g) in mutated}
    out_flat, out_spec = tree_flatten(out)
    k = 0
    wrapped = []
    for o in out_flat:
        if isinstance(o, torch.Tensor):
            if id(o) in by_local:
                wrapped.append(by_local[id(o)])
            else:
                wrapped.append(GlobalTensor(o, decision.output_layouts[k], decision.output_metas[k].shape))
            k += 1
        else:
            wrapped.append(o)
    return tree_unflatten(wrapped, out_spec)


def _wrap_outputs_outside(func: Any, decision: _Decision, local_args: Any, local_kwargs: Any) -> Any:
    """A rank outside the placement skips the op and holds empty outputs."""
    from ._layout import empty_local_shape
    from .tensor import GlobalTensor

    metas = iter(zip(decision.output_layouts, decision.output_metas))
    meta_out = func(*tree_flatten_map(_to_meta, local_args), **tree_flatten_map(_to_meta, local_kwargs))
    out_flat, out_spec = tree_flatten(meta_out)
    wrapped = []
    for o in out_flat:
        if isinstance(o, torch.Tensor):
            layout, meta = next(metas)
            local = torch.empty(empty_local_shape(len(meta.shape)), dtype=meta.dtype)
            wrapped.append(GlobalTensor(local, layout, meta.shape))
        else:
            wrapped.append(o)
    return tree_unflatten(wrapped, out_spec)


def tree_flatten_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) for x in flat], spec)


# -- fallback -------------------------------------------------------------------------


def fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Box every global input to broadcast, run locally, wrap outputs as broadcast."""
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
    placement = _common_placement(func, flat)
    for i, a in enumerate(flat):
        if isinstance(a, GlobalTensor):
            dst = Layout(a.placement, tuple(Broadcast() for _ in a.sbp))
            flat[i] = (_run_plan(a, dst) if a._layout != dst else a)._local
    local_args, local_kwargs = tree_unflatten(flat, spec)
    out = func(*local_args, **local_kwargs)
    layout = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
    out_flat, out_spec = tree_flatten(out)
    wrapped = [GlobalTensor(o, layout, o.shape) if isinstance(o, torch.Tensor) else o for o in out_flat]
    return tree_unflatten(wrapped, out_spec)
