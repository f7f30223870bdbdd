"""Deciding an op's layouts: the pure half of dispatch (DTensor's ``_sharding_prop.py``).

# NOTE [decide, then run]
# Dispatch is two steps. ``Propagator.decide`` (here) turns a call's metadata into a
# ``Decision``: the layout each global input is boxed to, each output's layout,
# logical shape, dtype and strides, and the gradient plan. It sees metadata only
# (interned ``Meta`` objects for global tensors, plain 0-dim tensors' metadata, the
# other arguments as passed), calls the op's meta kernel, asks the op's rule
# (NOTE [rules]) and lets ``_propagation.choose`` price the candidates; it never
# sees a piece of data, boxes nothing and never communicates. Its decisions are
# cached under ``call_key``, the one key of a call, which the fast path uses too
# (NOTE [fast path] in _dispatch). ``sbpflow._dispatch`` runs a decision: boxes
# the inputs, runs the op (or the rule's ``local`` function) on the pieces, wraps
# the outputs. An op with no rule gets ``Decision.fallback``: every input
# broadcast, outputs broadcast as the op computes them, inputs the op writes into
# written back; the same runner runs it.
#
# A plan being followed (``FOLLOWING``, set while a model whose plan was applied runs its
# forward; NOTE [following the plan] in auto_parallel/_follow.py) may name the layouts
# of a call (a ``Planned``, NOTE [planned strategies] in _propagation). The planned
# layouts are part of the call's key: the same op on the same layouts may be planned
# otherwise elsewhere in the step, or not planned at all.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _global
from ._bounded import BoundedDict
from ._layout import Layout
from ._propagation import NO_GRADIENT_PLAN, GradientPlan, Planned, choose
from .ops._registry import FloatArg, OpInfo, Registered, Strategy, TensorMeta
from .placement import Placement
from .sbp import Broadcast

__all__ = [
    "DECISIONS_BOUND",
    "FOLLOWING",
    "Decision",
    "Propagator",
    "call_key",
    "run_meta_kernel",
]

# The plan being followed in this context: called with a call's ``(func, args, kwargs)``, it
# returns the call's ``Planned`` layouts or None (NOTE [decide, then run]).
FOLLOWING: ContextVar[Callable[[Any, tuple, dict], Planned | None] | None] = ContextVar(
    "sbpflow_following", default=None
)


@dataclass(frozen=True)
class Decision:
    """How a call runs: its inputs' layouts, its outputs' metadata, its gradient plan."""

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
    # The outputs' tree structure and which leaves are tensors, when every other leaf is
    # None: a rank outside the placement builds its empty outputs from it.
    output_structure: tuple[Any, tuple[bool, ...]] | None = None
    # An op with no rule (NOTE [decide, then run]): outputs are broadcast on this layout,
    # with the shapes the op computes; written inputs are boxed and written back.
    fallback: Layout | None = None

    def output_meta(self, k: int, dtype: torch.dtype) -> _global.Meta:
        """Tensor output ``k``'s interned metadata, with ``dtype`` (the piece's)."""
        shape = self.output_metas[k].shape
        return _global.meta_of(self.output_layouts[k], shape, dtype, self.output_strides[k])

    @staticmethod
    def broadcast_everything(placement: Placement, num_inputs: int) -> Decision:
        """The fallback: every global input broadcast, outputs broadcast as computed."""
        full = Layout(placement, tuple(Broadcast() for _ in range(placement.ndim)))
        return Decision((full,) * num_inputs, (), (), (), (), fallback=full)


def call_key(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fold_floats: bool,
    planned: Planned | None = None,
) -> Any:
    """The one key of a call: the op, each global input's interned metadata (NOTE [interned
    metadata] in _global), plain tensors' shape and dtype, and the other arguments with their
    types (1, 1.0 and True are equal keys otherwise). With ``fold_floats`` a float argument
    enters only as ``float`` (a learning rate changes every step), which serves as long as
    the rule reads no float argument (NOTE [rules]); floats inside lists are always exact.
    ``planned``: the layouts a followed plan gives the call, if any.

    Looking the key up raises ``TypeError`` when an argument is not hashable (then nothing
    is cached); it is not hashed here, as the lookup hashes it.
    """
    gt = _global.GlobalTensor
    parts: list[Any] = [func]
    for a in args:
        if isinstance(a, gt):
            parts.append(a._meta)
        elif type(a) is float:
            parts += (float, float if fold_floats else a)
        elif type(a) is list or type(a) is tuple:
            parts += (type(a), _sequence_part(a))
        elif isinstance(a, torch.Tensor):
            parts.append(("t", tuple(a.shape), a.dtype))
        else:
            parts += (type(a), a)
    for name, a in kwargs.items():
        if type(a) is float:
            parts += (name, float, float if fold_floats else a)
        elif type(a) is list or type(a) is tuple:
            parts += (name, type(a), _sequence_part(a))
        elif isinstance(a, torch.Tensor):
            parts += (name, _tensor_part(a))
        else:
            parts += (name, type(a), a)
    if planned is not None:
        parts += (Planned, planned)
    return tuple(parts)


def _sequence_part(items: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
    for item in items:
        if isinstance(item, torch.Tensor) or type(item) is float:
            return tuple(_item_part(item) for item in items)
    return tuple(items)  # ints, bools, None (sizes, dims): the values as they are


def _item_part(item: Any) -> Any:
    if isinstance(item, torch.Tensor):
        return _tensor_part(item)
    return (type(item), item)


def _tensor_part(a: torch.Tensor) -> Any:
    return a._meta if isinstance(a, _global.GlobalTensor) else ("t", tuple(a.shape), a.dtype)


def run_meta_kernel(func: Any, flat: list[Any], spec: Any) -> tuple[list[Any], Any]:
    """The op on meta tensors: its flattened outputs and their tree structure. The one place
    a meta kernel runs (``flat``: global inputs as their ``Meta``, see ``metadata_of``)."""
    meta_args, meta_kwargs = tree_unflatten([_to_meta(a) for a in flat], spec)
    return tree_flatten(func(*meta_args, **meta_kwargs))


def _to_meta(a: Any) -> Any:
    if type(a) is _global.Meta:  # its logical strides (NOTE [logical strides])
        return torch.empty_strided(a.shape, a.strides, dtype=a.dtype, device="meta")
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    if isinstance(a, torch.device):  # e.g. _to_copy(..., device=cpu): stay on meta
        return torch.device("meta")
    return a


def metadata_of(flat: list[Any]) -> list[Any]:
    """``flat`` with each global tensor replaced by its interned ``Meta``: what the
    propagator sees of a call."""
    gt = _global.GlobalTensor
    return [a._meta if isinstance(a, gt) else a for a in flat]


def output_structure(out_flat: list[Any], spec: Any) -> tuple[Any, tuple[bool, ...]] | None:
    """(tree spec, which leaves are tensors) when every other leaf is None."""
    tensors = tuple(isinstance(o, torch.Tensor) for o in out_flat)
    if all(t or o is None for t, o in zip(tensors, out_flat, strict=True)):
        return spec, tensors
    return None


# Distinct (op, layouts, shapes, arguments) calls; a model's step makes hundreds to a few thousand.
DECISIONS_BOUND = 4096
_UNDECIDED: Any = object()
_READS_FLOATS: Any = object()  # under a key with floats folded: the rule read one (NOTE [rules])


class Propagator:
    """Decides calls (NOTE [decide, then run]) and keeps what it decided, bounded."""

    def __init__(self) -> None:
        self.decisions: BoundedDict[Any, Decision | None] = BoundedDict(
            "dispatch decisions", DECISIONS_BOUND
        )

    def forget(self) -> None:
        self.decisions.clear()

    def propagate(
        self,
        registered: Registered,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        flat: list[Any],
        spec: Any,
        placement: Placement,
        kept: list[int],
        planned: Planned | None = None,
    ) -> Decision | None:
        """The call's decision, cached under ``call_key``; None when no strategy keeps the
        ``kept`` inputs' layouts (written in place: the caller falls back). ``planned``: the
        layouts a followed plan gives the call (NOTE [planned strategies] in _propagation).

        ``args``/``kwargs`` are the call as made (its key); ``flat``/``spec`` its flattened
        arguments as the rule sees them (plain tensors joined as broadcast globals), with
        global tensors replaced by their ``Meta`` (``metadata_of``).
        """
        try:
            key = folded = call_key(func, args, kwargs, True, planned)
            decision = self.decisions.get(key, _UNDECIDED)
            if decision is _READS_FLOATS:  # the rule reads float arguments: key them by value
                key = call_key(func, args, kwargs, False, planned)
                decision = self.decisions.get(key, _UNDECIDED)
        except TypeError:  # an unhashable argument: decided every time
            key = folded = None
            decision = _UNDECIDED
        if decision is not _UNDECIDED:
            return decision
        decision, read_floats = self.decide(registered, func, flat, spec, placement, kept, planned)
        if key is not None:
            if read_floats and key is folded:
                self.decisions[folded] = _READS_FLOATS
                key = call_key(func, args, kwargs, False, planned)
            self.decisions[key] = decision
        return decision

    def reads_floats(self, folded: Any) -> bool:
        """Whether the decision of the call whose key with floats folded is ``folded`` holds
        for its float values only (its rule read one)."""
        return self.decisions.get(folded) is _READS_FLOATS

    def decide(
        self,
        registered: Registered,
        func: Any,
        flat: list[Any],
        spec: Any,
        placement: Placement,
        kept: list[int],
        planned: Planned | None = None,
    ) -> tuple[Decision | None, bool]:
        """The op's strategy (``_propagation.choose``); ``kept`` inputs (written in place)
        must keep their layout; ``planned`` layouts are taken where the rule offers them.

        ``None`` when no strategy keeps them (the caller falls back). Also whether the
        rule read a float argument (then the decision holds for those values only).
        """
        Meta = _global.Meta
        out_flat, out_spec = run_meta_kernel(func, flat, spec)
        output_positions = tuple(i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor))
        output_metas = tuple(
            TensorMeta(tuple(out_flat[i].shape), out_flat[i].dtype) for i in output_positions
        )
        output_strides = tuple(tuple(out_flat[i].stride()) for i in output_positions)
        positions = [i for i, a in enumerate(flat) if type(a) is Meta]
        metas: list[_global.Meta] = [flat[i] for i in positions]
        info_flat = list(flat)
        inputs = []
        for i, meta in zip(positions, metas, strict=True):
            tensor = TensorMeta(meta.shape, meta.dtype)
            info_flat[i] = tensor
            inputs.append(tensor)
        info_args, info_kwargs = tree_unflatten(info_flat, spec)
        # Float arguments record whether the rule reads them (NOTE [rules]); lists stay as passed.
        info_args = tuple(FloatArg(a) if type(a) is float else a for a in info_args)
        info_kwargs = {k: FloatArg(a) if type(a) is float else a for k, a in info_kwargs.items()}
        per_axis: list[list[Strategy]] = []
        for axis, size in enumerate(placement.shape):
            now = [meta.layout.normalized().sbp[axis] for meta in metas]
            info = OpInfo(func, info_args, info_kwargs, inputs, list(output_metas), size, now)
            strategies = list(registered.rule(info))
            if not strategies:
                raise RuntimeError(
                    f"the SBP rule for {func} returned no strategy for {_describe(metas)}"
                )
            for s in strategies:
                if len(s.inputs) != len(inputs) or len(s.outputs) != len(output_metas):
                    raise RuntimeError(
                        f"the SBP rule for {func} returned {s} for {len(inputs)} global input(s) "
                        f"and {len(output_metas)} tensor output(s); this is a bug in that rule."
                    )
            per_axis.append(strategies)
        current = [meta.layout for meta in metas]
        wanted = None
        if planned is not None:
            # the plan names every tensor argument; the rule sees the global ones
            leaves = [i for i, a in enumerate(flat) if isinstance(a, (Meta, torch.Tensor))]
            if len(leaves) == len(planned.inputs) and len(planned.outputs) <= len(output_metas):
                wanted = ([planned.inputs[leaves.index(i)] for i in positions], planned.outputs)
        choice = choose(per_axis, placement, current, inputs, output_metas, kept, wanted)
        read_floats = any(
            type(a) is FloatArg and a.read for a in (*info_args, *info_kwargs.values())
        )
        if choice is None:
            return None, read_floats
        decision = Decision(
            choice.input_layouts,
            choice.output_layouts,
            output_metas,
            output_positions,
            output_strides,
            choice.gradients,
            output_structure(out_flat, out_spec),
        )
        return decision, read_floats


def _describe(metas: list[_global.Meta]) -> str:
    return ", ".join(f"{m.layout.sbp} {list(m.shape)}" for m in metas)
