"""The one dispatch path for ATen ops on global tensors.

# NOTE [dispatch]
# 1. Ops that only touch metadata or aliasing (detach, alias) and reading a
#    scalar (item: the logical value, a collective) are handled here, and so is
#    ``_to_copy`` to a device (NOTE [device moves] in _devices), after the
#    fast path missed: a device move never leaves a fast entry.
# 2. An op with a decomposition (foreach ops, the AMP inf check, norms over a
#    split dim, ...) runs it: a function of the global arguments calling other
#    ops, which dispatch again; it may decline (NotImplemented) and go on to 3.
# 3. Otherwise the op's SBP rule (registered per op family in ``sbpflow.ops``,
#    see NOTE [rules]) proposes per-axis strategies; their cheapest N-D
#    combination wins (NOTE [choosing a strategy] in _propagation), inputs are
#    boxed to it, the op runs on local tensors, and outputs are wrapped with
#    the strategy's output SBP. Inputs whose gradient should come back in
#    their own layout get a hook (NOTE [gradient plan]).
#    An input the op writes into (in-place, schema alias ``a!``) must keep its
#    layout: only strategies that leave it as it is qualify. The decision is
#    cached per (op, input layouts, shapes, dtypes, arguments). A repeated
#    call that boxes nothing skips all of 2-3 (NOTE [fast path]).
# 4. An op with no rule (or no strategy keeping a written input's layout)
#    falls back to boxing every input to broadcast and computing locally,
#    writing results back into written inputs: always correct, never silent
#    (warns once per op; ``sbpflow.boxing.trace().fallbacks`` records it).
# Boxing here is not differentiable: dispatch runs below autograd, which
# differentiates the op itself through its backward formula (more ops).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _global, _rng
from . import ops as _rule_families  # noqa: F401  (importing it registers every family)
from ._bounded import BoundedDict
from ._devices import move_to_device
from ._gradient_hooks import apply_gradient_plan
from ._layout import Layout, empty_local_shape
from ._lazy_bits import resolve_arguments
from ._printing import logical_value
from ._propagation import NO_GRADIENT_PLAN, GradientPlan, choose
from ._view_writes import refuse_detached_view_writes
from .boxing import tracing as _trace
from .boxing._redistribute import box_below_autograd
from .comm import _errors, _functional, _groups
from .comm._world import device_for, get_rank
from .ops import _registry
from .ops._registry import FloatArg, LocalContext, OpInfo, Strategy, TensorMeta
from .placement import Placement
from .sbp import Broadcast

if TYPE_CHECKING:
    from ._global import Meta

aten = torch.ops.aten

_TO_COPY = aten._to_copy.default
_warned: set[str] = set()
_special: dict[Any, Callable[..., Any]] = {}


def special(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _special[op] = fn
        return fn

    return register


class OpDispatcher:
    """``GlobalTensor``'s dispatcher, its class attribute (NOTE [tensor layers] in _global)."""

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return dispatch(func, args, kwargs)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    handler = _special.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    key = _fast_key(func, args, kwargs)
    if key is not None:
        try:
            fast = _fast.get(key)
        except TypeError:  # an unhashable argument: no fast entry
            key = fast = None
        if fast is not None:
            return _run_fast(fast, func, args, kwargs)
    args, kwargs = resolve_arguments(func, args, kwargs)  # NOTE [lazy bits]
    if func is _TO_COPY and kwargs.get("device") is not None:  # never on the fast path
        return move_to_device(func, args[0], kwargs)  # NOTE [device moves]
    refuse_detached_view_writes(func, args, kwargs)  # NOTE [view writes]
    decomposition = _registry.lookup_decomposition(func)
    if decomposition is not None:
        key = None  # whether it applies may depend on more than the key: no fast entry
        out = decomposition(func, args, kwargs)
        if out is not NotImplemented:  # NotImplemented: the rule handles this case
            return out
    registered = _registry.lookup(func)
    if registered is None:
        return fallback(func, args, kwargs)
    return _run_rule(registered, func, args, kwargs, key)


@special(aten.detach.default, aten.alias.default)
def _alias(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    return _global.wrap(func(x._local), x._meta)  # the same layout, shape, dtype and strides


@special(aten._local_scalar_dense.default, aten.item.default)
def _item(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.item()`` (and ``float(t)``, ``bool(t)``): the logical value, on every rank."""
    return logical_value(args[0], "item()").item()


# -- rules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Decision:
    input_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout, ...]
    output_metas: tuple[TensorMeta, ...]
    # Where the tensor outputs sit among the flattened outputs. Kernels may
    # return None where the meta kernel returns a tensor (masked outputs of
    # *_backward ops), so outputs are matched by position, not by count.
    output_positions: tuple[int, ...]
    # The outputs' logical strides, from the meta kernel (NOTE [logical strides]); None:
    # contiguous.
    output_strides: tuple[tuple[int, ...] | None, ...]
    gradients: GradientPlan = NO_GRADIENT_PLAN  # NOTE [gradient plan] in _propagation

    def output_meta(self, k: int, dtype: torch.dtype) -> Meta:
        """Tensor output ``k``'s interned metadata, with ``dtype`` (the piece's)."""
        shape = self.output_metas[k].shape
        return _global.meta_of(self.output_layouts[k], shape, dtype, self.output_strides[k])


# Distinct (op, layouts, shapes, arguments) calls; a model's step makes hundreds to a few thousand.
DECISIONS_BOUND = 4096
_decisions: BoundedDict[Any, _Decision | None] = BoundedDict("dispatch decisions", DECISIONS_BOUND)
_UNDECIDED: Any = object()
_READS_FLOATS: Any = object()  # under a key with floats folded: the rule read one (NOTE [rules])


def _run_rule(
    registered: _registry.Registered, func: Any, args: tuple, kwargs: dict, fast_key: Any = None
) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    placement = _common_placement(func, flat)
    _groups.ensure_placement_groups(placement, get_rank())
    full = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
    # Plain tensors join as broadcast globals (0-dim ones stay scalars). "Plain" is any
    # tensor that is not global: a Parameter, and the fake or functional tensors a
    # torch.compile trace holds, join exactly as a torch.Tensor does in eager (else the
    # rule would not see them, and a trace could choose a layout eager would not).
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor) and not isinstance(a, _global.GlobalTensor) and a.dim() > 0:
            if a.device.type != placement.type:  # NOTE [device moves]
                raise ValueError(
                    f"{func} got a plain tensor on {a.device} with global tensors on {placement}; "
                    "a plain tensor joins as broadcast on the global tensors' device: move it "
                    f"with .to({placement.type!r}) or convert it with .to_global(placement, sbp)."
                )
            flat[i] = _global.GlobalTensor(a, full, a.shape)
    positions = [i for i, a in enumerate(flat) if isinstance(a, _global.GlobalTensor)]
    globals_ = [flat[i] for i in positions]
    mutated = _mutated_ids(func, args, kwargs)
    key = folded = _cache_key(func, args, kwargs, exact_floats=False)
    decision = _decisions.get(key, _UNDECIDED) if key is not None else _UNDECIDED
    if decision is _READS_FLOATS:  # the rule reads float arguments: key them by value
        key = _cache_key(func, args, kwargs, exact_floats=True)
        decision = _decisions.get(key, _UNDECIDED)
    if decision is _UNDECIDED:
        kept = [k for k, g in enumerate(globals_) if id(g) in mutated]
        decision, read_floats = _decide(registered, func, flat, spec, positions, placement, kept)
        if key is not None:
            if read_floats and key is folded:
                _decisions[folded] = _READS_FLOATS
                key = _cache_key(func, args, kwargs, exact_floats=True)
            _decisions[key] = decision
    if decision is None:  # no strategy keeps a written input's layout
        return fallback(func, args, kwargs)
    if decision.gradients:  # plain tensors joined above require no grad: never hooked
        apply_gradient_plan(decision.gradients, globals_)
    local_flat = list(flat)
    for i, g, layout in zip(positions, globals_, decision.input_layouts, strict=True):
        if g._layout.normalized() != layout.normalized():
            fast_key = None  # only calls that box nothing take the fast path
            assert id(g) not in mutated, f"{func}: a written input was chosen to be boxed"
            if not _functional.traced(g._local):  # compiled: no stack inspection at run time
                _errors.publish(f"{func} (boxing its inputs)", _errors.user_site())  # timeouts
            g = box_below_autograd(g, layout)
        local_flat[i] = g._local
    local_args, local_kwargs = tree_unflatten(local_flat, spec)
    rank = get_rank()
    if rank not in placement:
        return _wrap_outputs_outside(func, decision, args, kwargs)
    ctx = None
    if registered.local is not None:
        ctx = LocalContext(
            rank,
            list(decision.input_layouts),
            list(decision.output_layouts),
            [TensorMeta(tuple(g.shape), g.dtype) for g in globals_],
            list(decision.output_metas),
            _global_args(flat, spec),
        )
        out = registered.local(func, local_args, local_kwargs, ctx)
    else:
        out = func(*local_args, **local_kwargs)
    if fast_key is not None:
        if not mutated:
            _remember_fast(fast_key, out, decision, registered, ctx, positions)
        elif _writes_first_argument_only(func, args, mutated, out, decision):
            _fast[fast_key] = _Fast(func._op, (), _IN_PLACE, registered.local, ctx)  # no grad
    return _wrap_outputs(out, decision, globals_, mutated)


# -- fast path ------------------------------------------------------------------------
# NOTE [fast path]
# Training repeats the same calls: same op, input layouts, shapes, dtypes and
# arguments. A call whose inputs need no boxing (and that writes no input and
# holds no plain tensor or list of tensors) leaves a ``_Fast`` entry under a
# key built straight from ``args`` (no pytree, no layout normalisation, no
# schema walk); the next identical call finds it before any rule lookup and
# only unwraps the locals, runs the op (or the rule's ``local`` function with
# the same context) and wraps the outputs with the layouts and logical shapes
# the full path decided. The key holds everything that decision depended on.


@dataclass(frozen=True)
class _Fast:
    op: Callable[..., Any]  # the ATen kernel itself (skips OpOverload.__call__)
    outputs: tuple[Meta, ...]  # the outputs' interned metadata
    # None: one tensor output; tuple or list: that container of tensors; _IN_PLACE: an op
    # writing its first argument in place and returning it (NOTE [in-place fast path])
    container: type | None
    local: Any  # the rule's local function, or None
    ctx: LocalContext | None
    # The decision's gradient plan by position in ``args``, None when empty (a call that
    # boxes nothing has no input to reverse: only fan-out inputs).
    gradients: GradientPlan | None = None


FAST_BOUND = 4096
_fast: BoundedDict[Any, _Fast] = BoundedDict("dispatch fast path", FAST_BOUND)


def _forget_decisions() -> None:
    _decisions.clear()
    _fast.clear()


_registry.on_change(_forget_decisions)  # a new rule replaces what was decided without it


def _fast_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A flat key of the call (hashable unless an argument is not), or None when the call
    cannot take the fast path."""
    gt = _global.GlobalTensor
    parts: list[Any] = [func]
    for a in args:
        if isinstance(a, gt):
            parts.append(a._meta)  # interned (layout, shape, dtype): hashed by identity
        elif isinstance(a, torch.Tensor):
            return None
        elif type(a) is list or type(a) is tuple:
            for item in a:
                if isinstance(item, torch.Tensor):
                    return None
            parts += (type(a), tuple(a))
        else:
            parts += (type(a), a)  # the type too: 1, 1.0 and True are equal keys
    for name, a in kwargs.items():
        if isinstance(a, torch.Tensor) or type(a) in (list, tuple):
            return None
        parts += (name, type(a), a)
    return tuple(parts)


def _remember_fast(
    key: Any, out: Any, decision: _Decision, registered: Any, ctx: Any, positions: list[int]
) -> None:
    if isinstance(out, torch.Tensor):
        container, outs = None, [out]
    elif type(out) in (tuple, list) and all(isinstance(o, torch.Tensor) for o in out):
        container, outs = type(out), list(out)
    else:
        return
    if decision.output_positions != tuple(range(len(outs))):
        return  # outputs the meta kernel gave and this one did not (masked backward outputs)
    metas = tuple(decision.output_meta(k, o.dtype) for k, o in enumerate(outs))
    op = key[0]._op if isinstance(key[0], torch._ops.OpOverload) else key[0]
    # Fast calls hold globals in ``args`` only, none inside a list: input k is args[positions[k]].
    fan_out = tuple(
        (positions[k], tuple(positions[j] for j in sources))
        for k, sources in decision.gradients.fan_out
    )
    gradients = GradientPlan(fan_out=fan_out) if fan_out else None
    _fast[key] = _Fast(op, metas, container, registered.local, ctx, gradients)


# NOTE [in-place fast path]
# An in-place op (``p.add_(g, alpha=-lr)``: an optimizer's step) whose first argument is
# the only one written, keeps its layout and shape, and is returned, takes the fast path
# too: the key pins every input's layout, so the decision is the same and boxes nothing;
# the op runs on the pieces and the global tensor itself is returned. Writes into a view
# that holds a copy are still refused (NOTE [view writes]); in-place view ops (``t_``,
# ``squeeze_``), which change the tensor's metadata, never take it.
_IN_PLACE: Any = object()


def _writes_first_argument_only(
    func: Any, args: tuple, mutated: set[int], out: Any, decision: _Decision
) -> bool:
    first = args[0] if args else None
    return (
        isinstance(first, _global.GlobalTensor)
        and mutated == {id(first)}
        and out is first._local
        and torch.Tag.inplace_view not in func.tags
        and len(decision.output_layouts) == 1
        and decision.output_layouts[0].normalized() == first._layout.normalized()
        and decision.output_metas[0].shape == tuple(first.shape)
        and isinstance(func, torch._ops.OpOverload)
    )


def _run_fast(fast: _Fast, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    gt = _global.GlobalTensor
    if fast.gradients is not None:
        apply_gradient_plan(fast.gradients, args)
    local_args = [a._local if isinstance(a, gt) else a for a in args]
    if fast.container is _IN_PLACE and args[0]._is_view():
        refuse_detached_view_writes(func, args, kwargs)
    if fast.local is not None:
        out = fast.local(func, tuple(local_args), kwargs, fast.ctx)
    else:
        out = fast.op(*local_args, **kwargs)
    if fast.container is None:
        return _global.wrap(out, fast.outputs[0])
    if fast.container is _IN_PLACE:
        return args[0]
    return fast.container(
        [_global.wrap(o, meta) for o, meta in zip(out, fast.outputs, strict=True)]
    )


def _global_args(flat: list[Any], spec: Any) -> frozenset[int]:
    marks, _ = tree_unflatten([isinstance(a, _global.GlobalTensor) for a in flat], spec)
    return frozenset(i for i, m in enumerate(marks) if any(tree_flatten(m)[0]))


def _common_placement(func: Any, flat: list[Any]) -> Placement:
    placement = None
    for a in flat:
        if isinstance(a, _global.GlobalTensor):
            if placement is None:
                placement = a.placement
            elif a.placement != placement:
                raise ValueError(
                    f"{func} got global tensors on different placements ({placement} and "
                    f"{a.placement}); move them to one placement with .to_global(placement) first."
                )
    assert placement is not None
    return placement


def _cache_key(func: Any, args: tuple, kwargs: dict, exact_floats: bool) -> Any:
    """The decision cache's key for a call, or None when an argument is not hashable.

    With ``exact_floats`` False a float argument enters only as ``float``
    (learning rates change every step), which serves as long as the rule reads
    no float argument (NOTE [rules]); floats inside lists are always exact.
    """
    parts: list[Any] = [func]
    parts += (_key_part(a, exact_floats) for a in args)
    for name, a in kwargs.items():
        parts += (name, _key_part(a, exact_floats))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _key_part(a: Any, exact_floats: bool) -> Any:
    if isinstance(a, _global.GlobalTensor):
        return (a._layout, tuple(a.shape), a.dtype, a.stride())
    if isinstance(a, torch.Tensor):
        return ("t", tuple(a.shape), a.dtype)
    if type(a) is float and not exact_floats:
        return float
    if type(a) is list or type(a) is tuple:
        return (type(a), tuple(_key_part(item, True) for item in a))
    return (type(a), a)  # the type too: 1, 1.0 and True are equal keys


def _to_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        if isinstance(a, _global.GlobalTensor):  # its logical strides (NOTE [logical strides])
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return a.to("meta")
    if isinstance(a, torch.device):  # e.g. _to_copy(..., device=cpu): stay on meta
        return torch.device("meta")
    return a


def _decide(
    registered: _registry.Registered,
    func: Any,
    flat: list[Any],
    spec: Any,
    positions: list[int],
    placement: Placement,
    kept: list[int],
) -> tuple[_Decision | None, bool]:
    """The op's strategy (``_propagation.choose``); ``kept`` inputs (written in place) must
    keep their layout.

    ``None`` when no strategy keeps them (the caller falls back). Also whether
    the rule read a float argument (then the decision holds for those values only).
    """
    meta_args, meta_kwargs = tree_unflatten([_to_meta(a) for a in flat], spec)
    meta_out = func(*meta_args, **meta_kwargs)
    out_flat, _ = tree_flatten(meta_out)
    output_positions = tuple(i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor))
    output_metas = tuple(
        TensorMeta(tuple(out_flat[i].shape), out_flat[i].dtype) for i in output_positions
    )
    output_strides = tuple(tuple(out_flat[i].stride()) for i in output_positions)
    info_flat = list(flat)
    inputs = []
    for i in positions:
        meta = TensorMeta(tuple(flat[i].shape), flat[i].dtype)
        info_flat[i] = meta
        inputs.append(meta)
    info_args, info_kwargs = tree_unflatten(info_flat, spec)
    # Float arguments record whether the rule reads them (NOTE [rules]); lists stay as passed.
    info_args = tuple(FloatArg(a) if type(a) is float else a for a in info_args)
    info_kwargs = {k: FloatArg(a) if type(a) is float else a for k, a in info_kwargs.items()}
    per_axis: list[list[Strategy]] = []
    for axis, size in enumerate(placement.shape):
        now = [flat[i]._layout.normalized().sbp[axis] for i in positions]
        info = OpInfo(func, info_args, info_kwargs, inputs, list(output_metas), size, now)
        strategies = list(registered.rule(info))
        if not strategies:
            raise RuntimeError(
                f"the SBP rule for {func} returned no strategy for {_describe(flat)}"
            )
        for s in strategies:
            if len(s.inputs) != len(inputs) or len(s.outputs) != len(output_metas):
                raise RuntimeError(
                    f"the SBP rule for {func} returned {s} for {len(inputs)} global input(s) and "
                    f"{len(output_metas)} tensor output(s); this is a bug in that rule."
                )
        per_axis.append(strategies)
    current = [flat[i]._layout for i in positions]
    choice = choose(per_axis, placement, current, inputs, output_metas, kept)
    read_floats = any(type(a) is FloatArg and a.read for a in (*info_args, *info_kwargs.values()))
    if choice is None:
        return None, read_floats
    decision = _Decision(
        choice.input_layouts,
        choice.output_layouts,
        output_metas,
        output_positions,
        output_strides,
        choice.gradients,
    )
    return decision, read_floats


def _describe(flat: list[Any]) -> str:
    return ", ".join(
        f"{a.sbp} {list(a.shape)}" if isinstance(a, _global.GlobalTensor) else type(a).__name__
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
    by_local = {id(g._local): g for g in globals_ if id(g) in mutated}
    out_flat, out_spec = tree_flatten(out)
    index_of = {p: k for k, p in enumerate(decision.output_positions)}
    wrapped = []
    for position, o in enumerate(out_flat):
        if isinstance(o, torch.Tensor):
            if id(o) in by_local:
                wrapped.append(by_local[id(o)])
            else:
                wrapped.append(_global.wrap(o, decision.output_meta(index_of[position], o.dtype)))
        else:
            wrapped.append(o)
    return tree_unflatten(wrapped, out_spec)


def _wrap_outputs_outside(func: Any, decision: _Decision, args: Any, kwargs: Any) -> Any:
    """A rank outside the placement skips the op and holds empty outputs.

    ``args``/``kwargs`` are the op's global arguments: the outputs' structure
    comes from the op on their logical metadata, not on this rank's empty
    pieces (some meta kernels divide by the input's numel). That structure is
    kept per decision: running the op on meta tensors costs milliseconds for
    ops that decompose in Python, and a pipelined step runs every other
    stage's ops this way on every rank.
    """
    _rng.skip(func, args, kwargs)  # NOTE [logical random state]: advance as the others do
    tensor_outputs = iter(range(len(decision.output_metas)))
    device = (
        device_for(decision.output_layouts[0].placement.type) if decision.output_layouts else None
    )
    structure = _outside_structures.get((func, decision))
    if structure is None:
        meta_out = func(*tree_flatten_map(_to_meta, args), **tree_flatten_map(_to_meta, kwargs))
        out_flat, out_spec = tree_flatten(meta_out)
        tensors = tuple(isinstance(o, torch.Tensor) for o in out_flat)
        structure = (out_spec, tensors)
        if all(t or o is None for t, o in zip(tensors, out_flat, strict=True)):
            _outside_structures[(func, decision)] = structure
    else:
        out_spec, tensors = structure
        out_flat = [None] * len(tensors)
    wrapped = []
    for is_tensor, o in zip(structure[1], out_flat, strict=True):
        if is_tensor:
            k = next(tensor_outputs)
            meta = decision.output_metas[k]
            local = torch.empty(empty_local_shape(len(meta.shape)), dtype=meta.dtype, device=device)
            wrapped.append(_global.wrap(local, decision.output_meta(k, meta.dtype)))
        else:
            wrapped.append(o)
    return tree_unflatten(wrapped, structure[0])


# (op, decision) -> the op's output structure (tree spec, which leaves are tensors), for
# outputs made of tensors and Nones only.
_outside_structures: BoundedDict[Any, Any] = BoundedDict(
    "output structures outside the placement", DECISIONS_BOUND
)


def tree_flatten_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) for x in flat], spec)


# -- fallback -------------------------------------------------------------------------


def fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Box every global input to broadcast, run locally, wrap outputs as broadcast.

    An input the op writes into is boxed back to its own layout afterwards and
    copied into its local tensor, so in-place ops stay in place.
    """
    name = str(func)
    _trace.record_fallback(name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"sbpflow: no SBP rule for {name}; its global inputs are gathered to broadcast and "
            "it runs on every rank (correct, but slow). Register a rule in sbpflow.ops to avoid this.",
            stacklevel=3,
        )
    mutated = _mutated_ids(func, args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    placement = _common_placement(func, flat)
    full = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
    written: list[tuple[Any, torch.Tensor]] = []  # (global written into, its broadcast local)
    for i, a in enumerate(flat):
        if isinstance(a, _global.GlobalTensor):
            local = (
                box_below_autograd(a, full) if a._layout.normalized() != full.normalized() else a
            )._local
            if id(a) in mutated:
                written.append((a, local))
            flat[i] = local
    local_args, local_kwargs = tree_unflatten(flat, spec)
    if get_rank() not in placement:
        meta_out = func(*tree_flatten_map(_to_meta, args), **tree_flatten_map(_to_meta, kwargs))
        meta_flat = tree_flatten(meta_out)[0]
        positions = tuple(i for i, o in enumerate(meta_flat) if isinstance(o, torch.Tensor))
        metas = tuple(TensorMeta(tuple(meta_flat[i].shape), meta_flat[i].dtype) for i in positions)
        contiguous = tuple(None for _ in metas)  # as the ranks inside wrap fallback outputs
        decision = _Decision((), tuple(full for _ in metas), metas, positions, contiguous)
        return _wrap_outputs_outside(func, decision, args, kwargs)
    if _rng.draws(func, args, kwargs):  # NOTE [logical random state]: the same draw everywhere
        device = next(t.device for t in tree_flatten(local_args)[0] if isinstance(t, torch.Tensor))
        local_kwargs = {**local_kwargs, "generator": _rng.next_generator(args, kwargs, device)}
    out = func(*local_args, **local_kwargs)
    by_local = {}
    for g, local in written:
        by_local[id(local)] = g
        if local is not g._local:
            g._local.copy_(
                box_below_autograd(_global.GlobalTensor(local, full, g.shape), g._layout)._local
            )
    out_flat, out_spec = tree_flatten(out)
    wrapped = [
        (by_local[id(o)] if id(o) in by_local else _global.GlobalTensor(o, full, o.shape))
        if isinstance(o, torch.Tensor)
        else o
        for o in out_flat
    ]
    return tree_unflatten(wrapped, out_spec)
