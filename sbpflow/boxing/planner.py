"""The boxing planner: cheapest path between two layouts. Pure: no process group.

# NOTE [one-axis transitions]
# Each one-axis step runs independently on every group of ranks along one
# placement axis (p ranks; "block" = the sub-tensor the group covers).
#
#   from -> to     collective       bytes sent per rank      backward (grad in `to`)
#   S(i) -> B      all_gather       (p-1)/p * block          slice (local)
#   P    -> B      all_reduce       2(p-1)/p * block         none needed (B -> B)
#   P    -> S(i)   reduce_scatter   (p-1)/p * block          all_gather
#   S(i) -> S(j)   all_to_all       (p-1)/p^2 * block        all_to_all back
#   B    -> S(i)   slice (local)    0                        all_gather
#   B    -> P      zero (local): the group's first rank keeps the data
#   S(i) -> P      zero (local): the shard, zero-padded to the block
#   other placement  send_recv      the bytes that move      the reverse transfer
#
# A step on axis a that touches tensor dim d (split on either side) is only a
# group collective when no later axis b > a also splits d: later axes cut
# *inside* axis a's pieces, so axis a's group would hold interleaved data.
# The search never takes such an edge; it goes through another axis first.
#
# The backward of any step is planned the same way: the gradient is boxed from
# the layout it arrives in back to the forward input's layout.
#
# The search is Dijkstra over (placement, N-D SBP) states in a networkx graph;
# edge weights come from the alpha-beta model in cost.py.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Iterable, Sequence

import networkx as nx
import torch

from .._layout import Layout, box_at, box_numel
from ..placement import Placement
from ..sbp import Broadcast, Partial, SbpParallel, Split, sbp_str
from . import cost as _cost
from ._transfer import busiest_rank_bytes, is_positional, transfer_pieces
from .plan import BoxingPlan, BoxingStep

_MAX_FULL_CROSS_STATES = 16


def plan(
    shape: Sequence[int],
    dtype: torch.dtype,
    src: Layout | tuple[Placement, Any],
    dst: Layout | tuple[Placement, Any],
) -> BoxingPlan:
    """The cheapest plan that turns layout ``src`` into ``dst``; cached.

    ``src``/``dst`` are ``(placement, sbp)`` pairs (or ``Layout``). Needs no
    process group, so it works in a notebook with no cluster.
    """
    src_layout = _as_layout(src, "src", len(shape))
    dst_layout = _as_layout(dst, "dst", len(shape))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}; e.g. torch.float32.")
    return _cached_plan(tuple(int(n) for n in shape), dtype, src_layout, dst_layout, _cost.generation())


def _as_layout(value: Any, name: str, tensor_ndim: int) -> Layout:
    if isinstance(value, Layout):
        layout = value
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Placement):
        layout = Layout(value[0], value[1])
    else:
        raise TypeError(
            f"{name} must be a (placement, sbp) pair, got {value!r}; e.g. "
            f"{name}=(sbpflow.placement('cpu', [0, 1]), sbpflow.sbp.split(0))."
        )
    from ..sbp import normalize

    return Layout(layout.placement, normalize(layout.sbp, layout.placement.ndim, tensor_ndim))


@functools.lru_cache(maxsize=4096)
def _cached_plan(
    shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, cost_generation: int
) -> BoxingPlan:
    src_n, dst_n = src.normalized(), dst.normalized()
    itemsize = torch.empty((), dtype=dtype).element_size()
    if src_n == dst_n:
        return BoxingPlan(shape, dtype, src, dst, (), None)
    graph = build_graph(shape, itemsize, src_n, dst_n)
    path = nx.shortest_path(graph, src_n, dst_n, weight="weight")
    steps = tuple(graph.edges[a, b]["step"] for a, b in zip(path, path[1:]))
    for a, b in zip(path, path[1:]):
        graph.edges[a, b]["chosen"] = True
    return BoxingPlan(shape, dtype, src, dst, steps, graph)


def clear_cache() -> None:
    _cached_plan.cache_clear()


# -- the graph ------------------------------------------------------------------


def build_graph(shape: Sequence[int], itemsize: int, src: Layout, dst: Layout) -> nx.DiGraph:
    """Every layout on the source and destination placements, with step edges."""
    values = _candidate_values(len(shape), src, dst)
    graph = nx.DiGraph()
    placements = [src.placement] if src.placement == dst.placement else [src.placement, dst.placement]
    states_by_placement = {}
    for pl in placements:
        model = _cost.model_for(pl.type)
        states = _states(pl, values)
        states_by_placement[pl] = states
        for state in states:
            graph.add_node(state, label=str(state), placement=str(pl))
            for step in one_axis_steps(shape, itemsize, state, values, model):
                _add_step(graph, step)
    if src.placement != dst.placement:
        model = _cost.model_for(dst.placement.type)
        sources = states_by_placement[src.placement]
        targets = states_by_placement[dst.placement]
        for step in cross_steps(shape, itemsize, sources, targets, dst, model):
            _add_step(graph, step)
    return graph


def _add_step(graph: nx.DiGraph, step: BoxingStep) -> None:
    a, b = step.src, step.dst
    if graph.has_edge(a, b) and graph.edges[a, b]["weight"] <= step.cost:
        return
    graph.add_edge(a, b, weight=step.cost, step=step, op=step.op, chosen=False)


def _candidate_values(ndim: int, src: Layout, dst: Layout) -> list[SbpParallel]:
    values: list[SbpParallel] = [Broadcast(), Partial("sum")] + [Split(d) for d in range(ndim)]
    for s in src.sbp + dst.sbp:
        if s not in values:
            values.append(s)
    return values


def _states(pl: Placement, values: Sequence[SbpParallel]) -> list[Layout]:
    per_axis = [values if size > 1 else [Broadcast()] for size in pl.shape]
    return [Layout(pl, combo) for combo in itertools.product(*per_axis)]


def one_axis_steps(
    shape: Sequence[int],
    itemsize: int,
    state: Layout,
    values: Iterable[SbpParallel],
    model: _cost.CostModel,
) -> list[BoxingStep]:
    steps = []
    for axis, size in enumerate(state.placement.shape):
        if size == 1:
            continue
        for value in values:
            step = one_axis_step(shape, itemsize, state, axis, value, model)
            if step is not None:
                steps.append(step)
    return steps


def one_axis_step(
    shape: Sequence[int],
    itemsize: int,
    state: Layout,
    axis: int,
    value: SbpParallel,
    model: _cost.CostModel,
) -> BoxingStep | None:
    """The step that changes axis ``axis`` of ``state`` to ``value``, or ``None`` if none is direct."""
    current = state.sbp[axis]
    if value == current:
        return None
    touched = {s.dim for s in (current, value) if isinstance(s, Split)}
    for later in state.sbp[axis + 1 :]:
        if isinstance(later, Split) and later.dim in touched:
            return None  # see NOTE [one-axis transitions]
    pl = state.placement
    p = pl.shape[axis]
    dst = Layout(pl, state.sbp[:axis] + (value,) + state.sbp[axis + 1 :])
    block_sbp = state.sbp[:axis] + (Broadcast(),) + state.sbp[axis + 1 :]
    block = box_numel(box_at(shape, pl, block_sbp, (0,) * pl.ndim)) * itemsize
    op, cost, sent = _transition(current, value, p, block, model)
    if op is None:
        return None
    return BoxingStep(op, state, dst, (axis,), int(sent), cost)


def _transition(
    current: SbpParallel, value: SbpParallel, p: int, block: float, model: _cost.CostModel
) -> tuple[str | None, float, float]:
    split_from, split_to = isinstance(current, Split), isinstance(value, Split)
    if split_from and isinstance(value, Broadcast):
        return "all_gather", model.all_gather(p, block), (p - 1) / p * block
    if isinstance(current, Partial) and isinstance(value, Broadcast):
        return "all_reduce", model.all_reduce(p, block), 2 * (p - 1) / p * block
    if isinstance(current, Partial) and split_to:
        return "reduce_scatter", model.reduce_scatter(p, block), (p - 1) / p * block
    if split_from and split_to:
        return "all_to_all", model.all_to_all(p, block), (p - 1) / (p * p) * block
    if isinstance(current, Broadcast) and split_to:
        return "slice", model.local(0), 0
    if isinstance(value, Partial) and not isinstance(current, Partial):
        return "zero", model.local(block), 0
    return None, 0.0, 0.0  # P(sum) <-> P(max): no direct step


def cross_steps(
    shape: Sequence[int],
    itemsize: int,
    sources: Sequence[Layout],
    targets: Sequence[Layout],
    dst: Layout,
    model: _cost.CostModel,
) -> list[BoxingStep]:
    """Point-to-point edges from source-placement states to destination-placement states."""
    full = len(sources) * len(targets) <= _MAX_FULL_CROSS_STATES**2
    steps = []
    for s in sources:
        if full:
            wanted = list(targets)
        else:
            wanted = [dst] + [t for t in targets if t.sbp == s.sbp]
        for t in wanted:
            if s.has_partial and not is_positional(s, t):
                continue
            pieces = transfer_pieces(shape, s, t)
            nbytes, messages = busiest_rank_bytes(pieces, itemsize)
            cost = model.send_recv(messages, nbytes)
            if t.has_partial and not is_positional(s, t):
                cost += model.local(box_numel(t.box(shape, t.placement.flat_ranks[0])) * itemsize)
            steps.append(BoxingStep("send_recv", s, t, (), nbytes, cost))
    return steps


def describe_path(steps: Sequence[BoxingStep]) -> str:
    if not steps:
        return "(identity)"
    return " -> ".join([sbp_str(steps[0].src.sbp)] + [sbp_str(s.dst.sbp) for s in steps])
