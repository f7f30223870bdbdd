"""Layout propagation: the N-D strategy an op runs with, and where its gradients go back.

Pure: layouts, shapes and the boxing planner's cost estimates in, a ``Choice``
out. No process group, no tensor data, no autograd (``_gradient_hooks`` applies
a choice's gradient plan at run time).

# NOTE [choosing a strategy]
# A rule lists candidate strategies per mesh axis (NOTE [rules]); every N-D
# combination is priced and the cheapest wins (ties: the rule's earlier
# candidates). The price is what the op costs now and what its outputs will
# cost the ops that consume them:
#   inputs     boxing each input from its layout to the strategy's (the
#              planner's estimate). Entering a partial layout (B -> P, a local
#              zero) is free now, but the sum must be reduced later: that
#              reduction is charged now, so no op picks a partial signature
#              just because it is cheap to enter.
#   outputs    an output split on a mesh axis where no input is split is a
#              split nobody asked for: the consumers worked with unsplit
#              tensors there and will likely need this one unsplit too, so the
#              gather back to B is charged. Without it a residual add
#              ``x (B) + y (P)`` reduce-scatters ``y`` (cheaper than an
#              all_reduce by itself) and the next column-parallel matmul
#              gathers it again: two collectives where Megatron runs one.
#              A split some input already has is kept free: sequence
#              parallelism (``x`` split on tokens, the user's choice) still
#              reduce-scatters ``y``.
#
# NOTE [gradient plan]
# Autograd differentiates each op through its own backward formula, and the
# gradient ops dispatch like any op: each picks its locally cheapest strategy.
# Left at that, the partial-sum gradient of a tensor-parallel block's input
# (every column-parallel matmul returns one) flows into layer norm's backward,
# which keeps it partial, so each norm weight's gradient needs its own
# all_reduce and the residual stream one more. Megatron places an operator
# there instead ("f": identity forward, all_reduce backward). A choice names
# the inputs whose gradient, once complete (every use summed), is boxed to the
# input's own layout with partial axes reduced (P -> B):
#   reverse    inputs the dispatcher gathers, reduces or re-splits for the op
#              (a split or partial axis changed): the gradient takes the
#              forward boxing's reverse (S -> B forward: P -> S, a
#              reduce_scatter; P -> S forward: S -> B, an all_gather), which
#              is sequence parallelism's backward.
#   fan-out    inputs broadcast on an axis where the op divides its work (the
#              input is sliced there, or an output is split or partial): the
#              input's gradient comes back a sum (P) or a piece (S) there.
#              Boxed back only when the work is divided by a sharded
#              *parameter* (checked at run time, see ``_gradient_hooks``): a
#              column-parallel matmul's input, Megatron's "f". A data-parallel
#              axis divides work by splitting the batch; its broadcast tensors'
#              partial gradients are reduced where they reach parameters, in
#              buckets (sbpflow.nn.parallel), as before.
#
# NOTE [planned strategies]
# A plan made over the whole step (``sbpflow.auto_parallel``) may want an op laid out
# otherwise than the cheapest choice from where its inputs are now: it reduce-scatters
# here so that an op further on needs no gather. ``choose`` then takes the ``planned``
# layouts (inputs and outputs) when the rule offers them and they keep the written inputs;
# otherwise it prices the candidates as above. A planned layout the rule does not offer is
# never forced: every choice stays one of the rule's, so following a plan never changes a
# value, only where boxing happens.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ._layout import Layout
from .boxing.planner import plan
from .ops._registry import Strategy, TensorMeta
from .placement import Placement
from .sbp import Broadcast, Partial, SbpParallel, Split

__all__ = [
    "NO_GRADIENT_PLAN",
    "Choice",
    "GradientPlan",
    "Planned",
    "boxing_cost",
    "choose",
    "consumer_cost",
    "gradient_plan",
]

# Added to every boxing priced (even a free local one), so of two strategies with the same
# collectives, the one with fewer boxing steps wins.
_PER_BOXING = 1e-9


@dataclass(frozen=True)
class GradientPlan:
    """Which global inputs' gradients are boxed to the input's own layout (NOTE [gradient plan]).

    ``reverse``: indices (among the op's global inputs) the dispatcher gathers, reduces or
    re-splits for the op. ``fan_out``: ``(index, sources)`` pairs, the input's gradient boxed
    back when one of the ``sources`` (inputs split or partial on an axis where the op divides
    work over this broadcast input) is a sharded parameter.
    """

    reverse: tuple[int, ...] = ()
    fan_out: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reverse or self.fan_out)


NO_GRADIENT_PLAN = GradientPlan()


@dataclass(frozen=True)
class Choice:
    """The strategy an op runs with: its inputs' and outputs' layouts, and its gradient plan."""

    input_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout, ...]
    gradients: GradientPlan


@dataclass(frozen=True, eq=False)
class Planned:
    """The layouts a plan gives one call (NOTE [planned strategies]), normalized.

    ``inputs``: one per tensor argument of the call, in the order ``tree_flatten`` gives
    them (plain ones included; only the global inputs' are read); ``outputs``: the leading
    tensor outputs' (fewer than the op has: the rest are free). Compared by identity: the
    plan that makes them gives equal ones the same object, so a cache key holding one
    hashes at once.
    """

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]


def choose(
    per_axis: Sequence[Sequence[Strategy]],
    placement: Placement,
    current: Sequence[Layout],
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    kept: Sequence[int] = (),
    planned: tuple[Sequence[Layout], Sequence[Layout]] | None = None,
) -> Choice | None:
    """The cheapest N-D combination of one strategy per mesh axis (NOTE [choosing a strategy]).

    ``current``: the global inputs' layouts now; ``kept``: inputs the op writes in place,
    which must keep their layout. ``planned``: the global inputs' and the leading outputs'
    layouts (normalized) a plan wants, taken when a combination has them (NOTE [planned
    strategies]). ``None`` when no combination keeps the ``kept`` inputs.
    """
    now = [layout.normalized() for layout in current]
    candidates = list(_candidates(per_axis, placement, now, inputs, outputs, kept))
    if planned is not None:
        want_ins, want_outs = tuple(planned[0]), tuple(planned[1])
        for ins, outs in candidates:
            if (
                tuple(layout.normalized() for layout in ins) == want_ins
                and tuple(layout.normalized() for layout in outs[: len(want_outs)]) == want_outs
            ):
                return Choice(ins, outs, gradient_plan(ins, outs, now))
    best: tuple[float, tuple[Layout, ...], tuple[Layout, ...]] | None = None
    for ins, outs in candidates:
        cost = 0.0
        for want, have, meta in zip(ins, now, inputs, strict=True):
            if want.normalized() != have:
                cost += boxing_cost(meta, have, want)
        for out, meta in zip(outs, outputs, strict=True):
            cost += consumer_cost(meta, out, now)
        if best is None or cost < best[0]:
            best = (cost, ins, outs)
    if best is None:
        return None
    _, ins, outs = best
    return Choice(ins, outs, gradient_plan(ins, outs, now))


def _candidates(
    per_axis: Sequence[Sequence[Strategy]],
    placement: Placement,
    now: Sequence[Layout],
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    kept: Sequence[int],
) -> Iterator[tuple[tuple[Layout, ...], tuple[Layout, ...]]]:
    """Every N-D combination's (input, output) layouts that keeps the ``kept`` inputs and is a
    layout the boxing can take, in the rules' order."""
    metas = [*inputs, *outputs]
    for combo in itertools.product(*per_axis):
        ins = tuple(Layout(placement, tuple(s.inputs[k] for s in combo)) for k in range(len(now)))
        if any(ins[k].normalized() != now[k] for k in kept):
            continue
        outs = tuple(
            Layout(placement, tuple(s.outputs[k] for s in combo)) for k in range(len(outputs))
        )
        if any(_mixes_partials(layout) for layout in ins + outs):
            continue  # sum-partial on one axis and max-partial on another: boxing can't take it
        if not all(_fits(layout, meta) for layout, meta in zip(ins + outs, metas, strict=True)):
            continue  # a split of a dim the tensor lacks (a 0-dim result): no such layout
        yield ins, outs


def boxing_cost(meta: TensorMeta, have: Layout, want: Layout) -> float:
    """Estimated seconds to box an input from ``have`` to ``want`` for an op, a partial
    layout entered here charged its later reduction (NOTE [choosing a strategy])."""
    cost = plan(meta.shape, meta.dtype, have, want).cost + _PER_BOXING
    new_partial = [
        a
        for a, (h, w) in enumerate(zip(have.sbp, want.sbp, strict=True))
        if isinstance(w, Partial) and not isinstance(h, Partial) and want.placement.shape[a] > 1
    ]
    if new_partial:
        reduced = Layout(
            want.placement,
            tuple(Broadcast() if a in new_partial else s for a, s in enumerate(want.sbp)),
        )
        cost += plan(meta.shape, meta.dtype, want, reduced).cost
    return cost


def consumer_cost(meta: TensorMeta, out: Layout, current: Sequence[Layout]) -> float:
    """Estimated seconds the consumers of an output laid out as ``out`` will spend gathering
    a split no input had on its mesh axis (NOTE [choosing a strategy])."""
    sizes = out.placement.shape
    expected: list[SbpParallel] = []
    for axis, s in enumerate(out.sbp):
        new_split = (
            isinstance(s, Split)
            and sizes[axis] > 1
            and not any(isinstance(layout.sbp[axis], Split) for layout in current)
        )
        expected.append(Broadcast() if new_split else s)
    if tuple(expected) == out.sbp:
        return 0.0
    return plan(meta.shape, meta.dtype, out, Layout(out.placement, tuple(expected))).cost


def gradient_plan(
    ins: Sequence[Layout], outs: Sequence[Layout], current: Sequence[Layout]
) -> GradientPlan:
    """The inputs whose gradients go back to their own layout (NOTE [gradient plan])."""
    sizes = ins[0].placement.shape if ins else ()
    reverse, fan_out = [], []
    for k, (want, have) in enumerate(zip(ins, current, strict=True)):
        used = want.normalized().sbp
        if any(
            not isinstance(h, Broadcast) and u != h for h, u in zip(have.sbp, used, strict=True)
        ):
            reverse.append(k)  # gathered, reduced or re-split: the gradient goes back
            continue
        sources: set[int] = set()
        for axis, (h, u) in enumerate(zip(have.sbp, used, strict=True)):
            divided = not isinstance(u, Broadcast) or any(
                not isinstance(o.normalized().sbp[axis], Broadcast) for o in outs
            )
            if sizes[axis] == 1 or not isinstance(h, Broadcast) or not divided:
                continue
            sources.update(
                j
                for j, other in enumerate(ins)
                if j != k and not isinstance(other.normalized().sbp[axis], Broadcast)
            )
        if sources:
            fan_out.append((k, tuple(sorted(sources))))
    return GradientPlan(tuple(reverse), tuple(fan_out))


def _fits(layout: Layout, meta: TensorMeta) -> bool:
    return all(s.dim < meta.ndim for s in layout.sbp if isinstance(s, Split))


def _mixes_partials(layout: Layout) -> bool:
    return len({s.reduce_op for s in layout.sbp if isinstance(s, Partial)}) > 1
