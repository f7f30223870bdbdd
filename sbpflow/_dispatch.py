"""The one dispatch path for ATen ops on global tensors: it decides (``_decisions``), then runs.

# NOTE [dispatch]
# 1. Ops that only touch metadata or aliasing (detach, alias) and reading a
#    scalar (item: the logical value, a collective) are handled here, as are
#    ``_foreach_*`` calls whose lists run on the pieces (NOTE [foreach on the
#    pieces] in ops/_foreach: those that cannot go on to 2), and so is
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
#    made and cached by the propagator (NOTE [decide, then run] in
#    _decisions) and run here. A repeated call that boxes nothing skips all of
#    2-3 (NOTE [fast path]); before that, an optimizer's pointwise op on
#    operands of one layout goes straight to the pieces (NOTE [same-layout
#    pointwise] in _dispatch_pointwise).
# 4. An op with no rule (or no strategy keeping a written input's layout)
#    falls back to the all-broadcast decision, run by the same runner: every
#    input boxed to broadcast, the op computed locally, results written back
#    into written inputs: always correct, never silent (warns once per op;
#    ``sbpflow.boxing.trace().fallbacks`` records it).
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
from ._decisions import FOLLOWING, Decision, Propagator, call_key, metadata_of, run_meta_kernel
from ._devices import move_to_device
from ._dispatch_pointwise import SAME_LAYOUT_OPS, same_layout
from ._gradient_hooks import apply_gradient_plan
from ._layout import Layout
from ._lazy_bits import resolve_arguments
from ._printing import logical_value
from ._propagation import GradientPlan
from ._view_writes import may_hold_a_copy, note_alias, refuse_detached_view_writes
from .boxing import tracing as _trace
from .boxing._redistribute import box_below_autograd
from .comm import _errors, _functional
from .comm._mesh import MESHES
from .comm._world import get_rank
from .ops import _registry
from .ops._foreach import on_pieces
from .ops._registry import LocalContext, TensorMeta
from .ops.optim import foreach_overloads
from .placement import Placement
from .sbp import Broadcast

if TYPE_CHECKING:
    from ._global import Meta

aten = torch.ops.aten

_TO_COPY = aten._to_copy.default
_warned: set[str] = set()
# The ops handled before the general path (NOTE [dispatch], 1), by kernel: ``op._op``, which
# an ``OpOverload`` hashes as (in Python: looking the kernel up directly skips that call on
# every dispatched op).
_special: dict[Any, Callable[..., Any]] = {}


def special(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _special[op._op] = fn
        return fn

    return register


FAST_BOUND = 4096


class OpDispatcher:
    """``GlobalTensor``'s dispatcher, its class attribute (NOTE [tensor layers] in _global):
    the propagator that decides calls and the fast entries of calls run before."""

    def __init__(self) -> None:
        self.propagator = Propagator()
        self.fast: BoundedDict[Any, _Fast | _Outside] = BoundedDict(
            "dispatch fast path", FAST_BOUND
        )
        _registry.on_change(self.forget)  # a new rule replaces what was decided without it

    def forget(self) -> None:
        self.propagator.forget()
        self.fast.clear()

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        handler = _special.get(func._op)
        if handler is not None:
            out = handler(func, args, kwargs)
            if out is not NotImplemented:  # NotImplemented: the general path below
                return out
        following = FOLLOWING.get()
        planned = None if following is None else following(func, args, kwargs)
        key = call_key(func, args, kwargs, True, planned)
        try:
            fast = self.fast.get(key)
            if fast is _BY_VALUE:  # its rule read a float argument (NOTE [fast path])
                key = call_key(func, args, kwargs, False, planned)
                fast = self.fast.get(key)
        except TypeError:  # an unhashable argument: no fast entry
            key = fast = None
        if fast is not None:
            if isinstance(fast, _Outside):
                return _run_outside(fast, args)
            return _run_fast(fast, func, args, kwargs)
        args, kwargs = resolve_arguments(func, args, kwargs)  # NOTE [lazy bits]
        if func is _TO_COPY and kwargs.get("device") is not None:  # never on the fast path
            return move_to_device(func, args[0], kwargs)  # NOTE [device moves]
        refuse_detached_view_writes(func, args, kwargs)  # NOTE [view writes]
        decomposition = _registry.lookup_decomposition(func)
        if decomposition is not None:
            key = None  # whether it applies may depend on more than the key: no fast entry
            if following is None:
                out = decomposition(func, args, kwargs)
            else:
                token = FOLLOWING.set(None)  # the ops it calls are no ops of the plan's
                try:
                    out = decomposition(func, args, kwargs)
                finally:
                    FOLLOWING.reset(token)
            if out is not NotImplemented:  # NotImplemented: the rule handles this case
                return out
        registered = _registry.lookup(func)
        if registered is None:
            return self.fallback(func, args, kwargs)
        return self._run_rule(registered, func, args, kwargs, key, planned)

    def _run_rule(
        self,
        registered: _registry.Registered,
        func: Any,
        args: tuple,
        kwargs: dict,
        key: Any,
        planned: Any = None,
    ) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        placement = _common_placement(func, flat)
        MESHES.of(placement, "an op")  # made at its entry point (NOTE [meshes])
        full = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
        # Plain tensors join as broadcast globals (0-dim ones stay scalars). "Plain" is any
        # tensor that is not global: a Parameter, and the fake or functional tensors a
        # torch.compile trace holds, join exactly as a torch.Tensor does in eager (else the
        # rule would not see them, and a trace could choose a layout eager would not).
        gt = _global.GlobalTensor
        mutated = _mutated_ids(func, args, kwargs)
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor) and not isinstance(a, gt) and a.dim() > 0:
                if a.device.type != placement.type:  # NOTE [device moves]
                    raise ValueError(
                        f"{func} got a plain tensor on {a.device} with global tensors on "
                        f"{placement}; a plain tensor joins as broadcast on the global tensors' "
                        f"device: move it with .to({placement.type!r}) or convert it with "
                        ".to_global(placement, sbp)."
                    )
                flat[i] = gt(a, full, a.shape)
                if id(a) in mutated:  # written into: its broadcast layout is kept, so the
                    mutated.add(id(flat[i]))  # op writes into ``a`` itself, not a boxed copy
        positions = [i for i, a in enumerate(flat) if isinstance(a, gt)]
        kept = [k for k, i in enumerate(positions) if id(flat[i]) in mutated]
        decision = self.propagator.propagate(
            registered, func, args, kwargs, metadata_of(flat), spec, placement, kept, planned
        )
        if decision is None:  # no strategy keeps a written input's layout
            return self.fallback(func, args, kwargs)
        if key is not None and self.propagator.reads_floats(key):
            self.fast[key] = _BY_VALUE
            key = call_key(func, args, kwargs, False, planned)
        return self._run(
            decision, registered, func, args, kwargs, flat, spec, placement, positions, key
        )

    def fallback(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` with every global input broadcast (``Decision.broadcast_everything``).

        An input the op writes into is boxed back to its own layout afterwards and
        copied into its local tensor, so in-place ops stay in place.
        """
        name = str(func)
        _trace.record_fallback(name)
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"sbpflow: no SBP rule for {name}; its global inputs are gathered to broadcast "
                "and it runs on every rank (correct, but slow). Register a rule in sbpflow.ops "
                "to avoid this.",
                stacklevel=3,
            )
        flat, spec = tree_flatten((args, kwargs))
        placement = _common_placement(func, flat)
        gt = _global.GlobalTensor
        positions = [i for i, a in enumerate(flat) if isinstance(a, gt)]
        decision = Decision.broadcast_everything(placement, len(positions))
        return self._run(decision, None, func, args, kwargs, flat, spec, placement, positions, None)

    def _run(
        self,
        decision: Decision,
        registered: _registry.Registered | None,
        func: Any,
        args: tuple,
        kwargs: dict,
        flat: list[Any],
        spec: Any,
        placement: Placement,
        positions: list[int],
        fast_key: Any,
    ) -> Any:
        """Run ``decision``: box the inputs, run the op on the pieces, wrap the outputs.

        ``flat``/``spec``: the flattened arguments, ``positions`` where the global ones are
        (``registered`` is None for the fallback); ``fast_key``: the call's key, to remember
        it by if it boxes nothing (NOTE [fast path]).
        """
        globals_ = [flat[i] for i in positions]
        mutated = _mutated_ids(func, args, kwargs)
        if decision.gradients:  # plain tensors joined as globals require no grad: never hooked
            apply_gradient_plan(decision.gradients, globals_)
        local_flat = list(flat)
        written: list[tuple[Any, torch.Tensor]] = []  # (global written into, the piece used)
        for i, g, layout in zip(positions, globals_, decision.input_layouts, strict=True):
            if g._layout.normalized() != layout.normalized():
                fast_key = None  # only calls that box nothing take the fast path
                assert decision.fallback or id(g) not in mutated, (
                    f"{func}: a written input was chosen to be boxed"
                )
                if not _functional.traced(g._local):  # compiled: no stack inspection at run time
                    _errors.publish(f"{func} (boxing its inputs)", _errors.user_site())  # timeouts
                local_flat[i] = box_below_autograd(g, layout)._local
            else:
                local_flat[i] = g._local
            if id(g) in mutated:
                written.append((g, local_flat[i]))
        rank = get_rank()
        if rank not in placement:
            if (
                fast_key is not None
                and registered is not None
                and not mutated
                and decision.output_structure is not None
                and not _rng.draws(func, args, kwargs)
                and _fast_eligible(args, kwargs)
            ):
                self.fast[fast_key] = _Outside(
                    decision.output_structure,
                    tuple(
                        decision.output_meta(k, m.dtype)
                        for k, m in enumerate(decision.output_metas)
                    ),
                    _fast_gradients(decision, args),
                )
            return _wrap_outputs_outside(func, decision, args, kwargs)
        local_args, local_kwargs = tree_unflatten(local_flat, spec)
        ctx = None
        if registered is not None and registered.local is not None:
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
            if decision.fallback and _rng.draws(func, args, kwargs):
                # NOTE [logical random state]: the same draw everywhere.
                device = next(t.device for t in local_flat if isinstance(t, torch.Tensor))
                generator = _rng.next_generator(args, kwargs, device)
                local_kwargs = {**local_kwargs, "generator": generator}
            out = func(*local_args, **local_kwargs)
        if decision.fallback is not None:
            for g, local in written:
                if local is not g._local:  # boxed for the op: the result boxed back into it
                    result = _global.GlobalTensor(local, decision.fallback, g.shape)
                    g._local.copy_(box_below_autograd(result, g._layout)._local)
        elif fast_key is not None and registered is not None and _fast_eligible(args, kwargs):
            if not mutated:
                self._remember_fast(fast_key, out, decision, registered, ctx, args)
            elif _writes_first_argument_only(func, args, mutated, out, decision):
                self.fast[fast_key] = _Fast(func._op, (), _IN_PLACE, registered.local, ctx)
        return _wrap_outputs(out, decision, {id(local): g for g, local in written})

    def _remember_fast(
        self,
        key: Any,
        out: Any,
        decision: Decision,
        registered: _registry.Registered,
        ctx: Any,
        args: tuple[Any, ...],
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
        gradients = _fast_gradients(decision, args)
        self.fast[key] = _Fast(op, metas, container, registered.local, ctx, gradients)


def _fast_gradients(decision: Decision, args: tuple[Any, ...]) -> GradientPlan | None:
    """The decision's gradient plan by position in ``args``; None when empty. A fast call
    holds its globals as top-level positional arguments only (``_fast_eligible``), so global
    input k is the k-th global of ``args``, wherever lists of numbers before it put it in
    the flattened arguments (``layer_norm(x, [H, W], w, b)``)."""
    where = [i for i, a in enumerate(args) if isinstance(a, _global.GlobalTensor)]
    fan_out = tuple(
        (where[k], tuple(where[j] for j in sources)) for k, sources in decision.gradients.fan_out
    )
    return GradientPlan(fan_out=fan_out) if fan_out else None


special(*foreach_overloads())(on_pieces)
special(*SAME_LAYOUT_OPS)(same_layout)  # NOTE [same-layout pointwise]


@special(aten.detach.default, aten.alias.default)
def _alias(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    piece = func(x._local)
    note_alias(x, piece)  # NOTE [view writes]: a copy stays a copy
    return _global.wrap(piece, x._meta)  # the same layout, shape, dtype and strides


@special(aten._local_scalar_dense.default, aten.item.default)
def _item(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.item()`` (and ``float(t)``, ``bool(t)``): the logical value, on every rank."""
    return logical_value(args[0], "item()").item()


# -- fast path ------------------------------------------------------------------------
# NOTE [fast path]
# Training repeats the same calls: same op, input layouts, shapes, dtypes and
# arguments. A call whose inputs need no boxing (and that writes no input and
# holds no plain tensor or list of tensors) leaves a ``_Fast`` entry under its
# ``call_key`` (NOTE [decide, then run] in _decisions: built straight from
# ``args``, no pytree, no layout normalisation, no schema walk); the next
# identical call finds it before any rule lookup and only unwraps the locals,
# runs the op (or the rule's ``local`` function with the same context) and
# wraps the outputs with the layouts and logical shapes the full path decided.
# The key holds everything that decision depended on. It folds float arguments as
# the propagator's does (NOTE [rules] in ops/_registry): an optimizer's step size,
# new every step, finds the entry of the last step. A call whose rule read a float
# leaves ``_BY_VALUE`` under its folded key and its entry under the exact values.


_BY_VALUE: Any = object()  # under a folded key: the entries are keyed by float value


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


def _fast_eligible(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call's global tensors are all top-level positional arguments (what
    ``_run_fast`` unwraps): no plain tensor, no list holding tensors, no tensor or list
    among the keyword arguments."""
    gt = _global.GlobalTensor
    for a in args:
        if isinstance(a, torch.Tensor) and not isinstance(a, gt):
            return False
        if (type(a) is list or type(a) is tuple) and any(
            isinstance(item, torch.Tensor) for item in a
        ):
            return False
    return not any(isinstance(a, torch.Tensor) or type(a) in (list, tuple) for a in kwargs.values())


# NOTE [in-place fast path]
# An in-place op (``p.add_(g, alpha=-lr)``: an optimizer's step) whose first argument is
# the only one written, keeps its layout and shape, and is returned, takes the fast path
# too: the key pins every input's layout, so the decision is the same and boxes nothing;
# the op runs on the pieces and the global tensor itself is returned. Writes into a view
# that holds a copy are still refused (NOTE [view writes]); in-place view ops (``t_``,
# ``squeeze_``), which change the tensor's metadata, never take it.
_IN_PLACE: Any = object()


def _writes_first_argument_only(
    func: Any, args: tuple, mutated: set[int], out: Any, decision: Decision
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
    if fast.container is _IN_PLACE and may_hold_a_copy(args[0]):
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


# NOTE [outside fast]
# A rank outside an op's placement runs nothing and holds empty pieces (NOTE [dispatch],
# ``_wrap_outputs_outside``); a program whose modules live on placements of other ranks
# does that for every op of those modules, on every call. A repeated call of that kind
# (same key, so the same decision: it boxes nothing, writes no input, draws no random
# numbers, and its outputs' structure is known) leaves an ``_Outside`` entry and skips the
# rule lookup, the propagation and the schema walks: it only hooks what the decision hooks
# and makes the empty outputs with the metadata the full path gave them.


@dataclass(frozen=True)
class _Outside:
    structure: tuple[Any, tuple[bool, ...]]  # the outputs' tree spec, which leaves are tensors
    outputs: tuple[Meta, ...]  # the tensor outputs' interned metadata
    gradients: GradientPlan | None = None  # as ``_Fast.gradients``


def _run_outside(fast: _Outside, args: tuple[Any, ...]) -> Any:
    if fast.gradients is not None:
        apply_gradient_plan(fast.gradients, args)
    spec, tensors = fast.structure
    metas = iter(fast.outputs)
    return tree_unflatten([_global.empty_piece(next(metas)) if t else None for t in tensors], spec)


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


def _wrap_outputs(out: Any, decision: Decision, written: dict[int, Any]) -> Any:
    """``out`` with each tensor wrapped per ``decision``; a piece the op wrote into (in
    ``written``) is returned as the global tensor it belongs to."""
    out_flat, out_spec = tree_flatten(out)
    index_of = {p: k for k, p in enumerate(decision.output_positions)}
    wrapped = []
    for position, o in enumerate(out_flat):
        if isinstance(o, torch.Tensor):
            if id(o) in written:
                wrapped.append(written[id(o)])
            elif decision.fallback is not None:  # broadcast, as computed
                wrapped.append(
                    _global.wrap(o, _global.meta_of(decision.fallback, o.shape, o.dtype))
                )
            else:
                wrapped.append(_global.wrap(o, decision.output_meta(index_of[position], o.dtype)))
        else:
            wrapped.append(o)
    return tree_unflatten(wrapped, out_spec)


def _wrap_outputs_outside(func: Any, decision: Decision, args: Any, kwargs: Any) -> Any:
    """A rank outside the placement skips the op and holds empty outputs.

    ``args``/``kwargs`` are the op's global arguments: the outputs' structure
    comes from the op on their logical metadata, not on this rank's empty
    pieces (some meta kernels divide by the input's numel). The decision keeps
    that structure (``Decision.output_structure``): running the op on meta
    tensors costs milliseconds for ops that decompose in Python, and a model
    placed on other ranks runs all its ops this way on this rank.
    """
    _rng.skip(func, args, kwargs)  # NOTE [logical random state]: advance as the others do
    structure = decision.output_structure
    if structure is None or decision.fallback is not None:
        flat, spec = tree_flatten((args, kwargs))
        out_flat, out_spec = run_meta_kernel(func, metadata_of(flat), spec)
        tensors = tuple(isinstance(o, torch.Tensor) for o in out_flat)
        if decision.fallback is not None:  # outputs broadcast, contiguous
            positions = tuple(i for i, t in enumerate(tensors) if t)
            metas = tuple(
                TensorMeta(tuple(out_flat[i].shape), out_flat[i].dtype) for i in positions
            )
            layouts = tuple(decision.fallback for _ in metas)
            decision = Decision((), layouts, metas, positions, tuple(None for _ in metas))
    else:
        out_spec, tensors = structure
        out_flat = [None] * len(tensors)
    tensor_outputs = iter(range(len(decision.output_metas)))
    wrapped = []
    for is_tensor, o in zip(tensors, out_flat, strict=True):
        if is_tensor:
            k = next(tensor_outputs)
            meta = decision.output_meta(k, decision.output_metas[k].dtype)
            wrapped.append(_global.empty_piece(meta))
        else:
            wrapped.append(o)
    return tree_unflatten(wrapped, out_spec)
