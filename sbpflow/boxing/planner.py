"""The boxing planner: cheapest path between two layouts. Pure: no process group.

# NOTE [one-axis transitions]
# Each step runs independently on every group of ranks along one placement
# axis (p ranks; "block" = the sub-tensor the group covers together).
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
#                    (copy when every piece stays on its rank, e.g. (S(0), S(0))
#                    on [[0, 1], [2, 3]] -> S(0) on [0, 1, 2, 3])
#
# A step on axis a that touches tensor dim d (split on either side) is only a
# group collective when no later axis b > a also splits d: later axes cut
# *inside* axis a's pieces, so axis a's group would hold interleaved data.
# The search never takes such an edge; it goes through another axis first.
#
# The backward of any step is planned the same way: the gradient is boxed from
# the layout it arrives in back to the forward input's layout.
#
# NOTE [merged axes]
# A step may run on several axes at once, axes = (a1 < a2 < ...), when they
# all go from the same value to the same value. Its groups are the ranks that
# vary only along those axes, members in row-major mesh order (groups_along),
# and it is the table's collective over p = the product of their sizes:
# (S(0), S(0)) -> (B, B) on a 2x2 mesh is one all_gather over four ranks,
# because in row-major order the four pieces follow each other along dim 0;
# (P, P) -> (B, B) is one all_reduce, (S(0), S(0)) -> (S(1), S(1)) one
# all_to_all. The validity rule becomes: no axis outside the group after a1
# splits a touched dim. The executor takes uneven piece sizes from each
# member's box: nested balanced splits are not one flat balanced split (6
# rows as (S(0), S(0)) on 2x2 are 2,1,2,1 per member; flat over 4 would be
# 2,2,1,1). cost.py counts latency in ceil(log2 p) rounds, so a merged
# collective never costs more than the chain of per-axis ones it replaces and
# saves their step overheads: the search prefers it. The merged axes are all
# the mesh's axes of more than one rank, never some of them: a mesh makes a
# group per axis and one of the whole mesh, no others (NOTE [meshes] in
# comm/_mesh.py; on three axes of more than one rank that is 4 groups of
# ranks, not 7), so a step over a strict subset would have no group to run on.
#
# The search is Dijkstra over (placement, N-D SBP) states; edges are made as
# states are reached (_steps.py) and weighted by the alpha-beta model in
# cost.py. ``BoxingPlan.to_networkx()`` re-runs it recording every edge.
#
# NOTE [plan cache]
# ``plan`` is on every boxing call, so its hot path is one dict look-up keyed
# on the raw arguments (shape tuple, dtype, src, dst, cost_model) and checked
# against the generation of the installed constants; only a miss normalises
# the arguments and plans, cached again per (normalised layouts, the cost
# models that price them), so installing constants seen before re-uses their
# plans.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch

from .._layout import Layout
from ..placement import Placement
from ..sbp import NdSbp, Partial, normalize
from . import _transfer
from . import cost as _cost
from ._steps import Codes, Values, axis_groups, candidate_values, coded_edges, states, transfer_edge
from .plan import BoxingPlan, BoxingStep

__all__ = ["clear_cache", "plan", "searched_graph"]

# Between two placements, every source state gets an edge to every destination
# state while there are at most this many pairs (2x2 -> 2x2 with four values per
# axis is 256); past it, only to the destination and to the same SBP there.
_FULL_CROSS_PAIRS = 256
_HOT_LIMIT = 8192

State = tuple[int, Codes]  # (placement index: 0 source, 1 destination), sbp as codes
Move = tuple[str, tuple[int, ...], int, float]  # op, axes, bytes sent, cost
_hot: dict[Any, tuple[int, BoxingPlan]] = {}


def plan(
    shape: Sequence[int],
    dtype: torch.dtype,
    src: Layout | tuple[Placement, Any],
    dst: Layout | tuple[Placement, Any],
    cost_model: _cost.CostModel | None = None,
) -> BoxingPlan:
    """The cheapest plan that turns layout ``src`` into ``dst``; cached.

    ``src``/``dst`` are ``(placement, sbp)`` pairs (or ``Layout``). Steps are
    priced with ``cost_model``, or, when it is ``None``, with the job's agreed
    model for each placement's device type (``cost.model_for``, NOTE [agreed
    constants] in cost.py). Needs no process group, so it works in a notebook
    with no cluster.
    """
    key: Any = (shape, dtype, src, dst, cost_model)
    try:
        hit = _hot.get(key)
    except TypeError:  # a list somewhere in the arguments: not hashable as given
        key, hit = None, None
    generation = _cost.generation()
    if hit is not None and hit[0] == generation:
        return hit[1]
    src_layout = _as_layout(src, "src", len(shape))
    dst_layout = _as_layout(dst, "dst", len(shape))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}; e.g. torch.float32.")
    for name, layout in (("src", src_layout), ("dst", dst_layout)):
        _check_partials(name, layout)
    models = _models(src_layout, dst_layout, cost_model)
    result = _cached_plan(tuple(int(n) for n in shape), dtype, src_layout, dst_layout, models)
    if key is not None:
        if len(_hot) >= _HOT_LIMIT:
            _hot.clear()
        _hot[key] = (generation, result)
    return result


Models = tuple[_cost.CostModel, _cost.CostModel]  # pricing steps on the source, destination


def _models(src: Layout, dst: Layout, cost_model: _cost.CostModel | None) -> Models:
    if cost_model is None:
        return (_cost.model_for(src.placement.type), _cost.model_for(dst.placement.type))
    if not isinstance(cost_model, _cost.CostModel):
        raise TypeError(
            f"cost_model must be a sbpflow.boxing.cost.CostModel or None, got "
            f"{type(cost_model).__name__}: {cost_model!r}; pass None to use the job's agreed "
            "model, or e.g. cost.CostModel(cost.LinkCost(alpha=60e-6, beta=1.5e9))."
        )
    return (cost_model, cost_model)


# NOTE [no partial detours]
# Entering a partial layout (the local "zero" step) is only taken on axes the
# destination itself keeps partial. A detour such as S -> P -> B (zero-pad,
# then all_reduce) can look as cheap as the all_gather it replaces under some
# measured constants, but it moves twice the bytes and makes plans depend on
# noise; keeping partials out of intermediate states keeps plans the ones in
# the transition table.


def _goal_is_partial_on(goal: NdSbp, axes: Sequence[int]) -> bool:
    return all(a < len(goal) and isinstance(goal[a], Partial) for a in axes)


def _check_partials(name: str, layout: Layout) -> None:
    kinds = {s.reduce_op for s in layout.sbp if isinstance(s, Partial)}
    if len(kinds) > 1:
        raise ValueError(
            f"{name} layout {layout} mixes partial_sum and partial_max on different mesh axes; "
            "boxing does not support that mix. Reduce one kind first (e.g. to broadcast)."
        )


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
    return Layout(layout.placement, normalize(layout.sbp, layout.placement.ndim, tensor_ndim))


@functools.lru_cache(maxsize=4096)
def _cached_plan(
    shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, models: Models
) -> BoxingPlan:
    graph = functools.partial(_searched_graph, shape, dtype, src, dst, models)
    if src.normalized() == dst.normalized():
        return BoxingPlan(shape, dtype, src, dst, (), graph)
    problem = _Problem.make(shape, dtype, src, dst, models)
    path, _ = _search(problem, record=False)
    steps = tuple(problem.step(u, v, move) for u, v, move in path)
    return BoxingPlan(shape, dtype, src, dst, steps, graph)


def clear_cache() -> None:
    """Forget every cached plan (and the transfer geometry behind them)."""
    _hot.clear()
    _cached_plan.cache_clear()
    _transfer.clear_cache()


# -- the search ------------------------------------------------------------------


@dataclass
class _Problem:
    """What one search needs, computed once: placements, cost models, values, axis groups.

    A state is ``(placement index, codes)``: 0 the source placement, 1 the
    destination's (when they differ), and the SBP as indices into ``table``.
    """

    shape: tuple[int, ...]
    itemsize: int
    placements: tuple[Placement, ...]
    models: tuple[_cost.CostModel, ...]
    table: Values
    groups: tuple[list[tuple[int, ...]], ...]
    start: State
    goal: State
    cross_targets: list[Codes] | None  # every destination state, or None: a few per source
    blocks: tuple[dict[Codes, int], ...]  # block bytes per placement, filled as the search goes

    @staticmethod
    def make(
        shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, models: Models
    ) -> _Problem:
        src, dst = src.normalized(), dst.normalized()
        itemsize = torch.empty((), dtype=dtype).element_size()
        values = candidate_values(len(shape), src.sbp + dst.sbp)
        table = Values(values)
        placements = (
            (src.placement,) if src.placement == dst.placement else (src.placement, dst.placement)
        )
        cross_targets = None
        if len(placements) == 2:
            num_src = _num_states(src.placement.shape, len(values))
            num_dst = _num_states(dst.placement.shape, len(values))
            if num_src * num_dst <= _FULL_CROSS_PAIRS:
                cross_targets = [table.encode(t) for t in states(dst.placement.shape, values)]
        return _Problem(
            shape,
            itemsize,
            placements,
            models[: len(placements)],
            table,
            tuple(axis_groups(pl.shape) for pl in placements),
            (0, table.encode(src.sbp)),
            (len(placements) - 1, table.encode(dst.sbp)),
            cross_targets,
            tuple({} for _ in placements),
        )

    def edges(self, state: State) -> Iterator[tuple[State, Move]]:
        index, codes = state
        pl, model, blocks = self.placements[index], self.models[index], self.blocks[index]
        goal = self.table.decode(self.goal[1])
        for axes in self.groups[index]:
            for _, op, sent, cost, new in coded_edges(
                self.shape, self.itemsize, pl, codes, axes, self.table, model, blocks
            ):
                if op == "zero" and not _goal_is_partial_on(goal, axes):
                    continue  # NOTE [no partial detours]
                yield (index, new), (op, axes, sent, cost)
        if index == 0 and len(self.placements) == 2:
            yield from self._transfers(codes)

    def _transfers(self, codes: Codes) -> Iterator[tuple[State, Move]]:
        src_pl, dst_pl = self.placements
        model, table, goal = self.models[1], self.table, self.goal[1]
        targets = self.cross_targets
        if targets is None:
            targets = [goal]
            if src_pl.ndim == dst_pl.ndim:
                same = table.encode(Layout(dst_pl, table.decode(codes)).normalized().sbp)
                if same != goal:
                    targets.append(same)
        source = Layout(src_pl, table.decode(codes))
        reductions = table.reductions(codes)
        for target in targets:
            if target != goal and table.reductions(target) - reductions:
                # A partial stop on the way (zero-filled, then reduced again
                # there) never beats sending its B form; only partial sources
                # move partial data, positionally.
                continue
            edge = transfer_edge(
                self.shape, self.itemsize, source, Layout(dst_pl, table.decode(target)), model
            )
            if edge is not None:
                yield (1, target), edge[:4]

    def layout(self, state: State) -> Layout:
        return Layout(self.placements[state[0]], self.table.decode(state[1]))

    def step(self, u: State, v: State, move: Move) -> BoxingStep:
        op, axes, sent, cost = move
        return BoxingStep(op, self.layout(u), self.layout(v), axes, sent, cost)


def _num_states(mesh_shape: Sequence[int], num_values: int) -> int:
    return math.prod(num_values if n > 1 else 1 for n in mesh_shape)


Path = list[tuple[State, State, "Move"]]


def _search(problem: _Problem, record: bool) -> tuple[Path, Path]:
    """Dijkstra from ``problem.start`` to ``problem.goal``: the path, and every edge seen if ``record``."""
    best: dict[State, float] = {problem.start: 0.0}
    back: dict[State, tuple[State, Move]] = {}
    heap: list[tuple[float, int, State]] = [(0.0, 0, problem.start)]
    done: set[State] = set()
    seen: Path = []
    tick = 1  # ties break by discovery order, the same on every rank
    while heap:
        dist, _, u = heapq.heappop(heap)
        if u in done:
            continue
        done.add(u)
        if u == problem.goal:
            break
        for v, move in problem.edges(u):
            if record:
                seen.append((u, v, move))
            candidate = dist + move[3]
            if candidate < best.get(v, math.inf):
                best[v] = candidate
                back[v] = (u, move)
                heapq.heappush(heap, (candidate, tick, v))
                tick += 1
    assert problem.goal in done, "every layout reaches every other through B"
    path: Path = []
    state = problem.goal
    while state != problem.start:
        prev, move = back[state]
        path.append((prev, state, move))
        state = prev
    path.reverse()
    return path, seen


def searched_graph(
    shape: Sequence[int],
    dtype: torch.dtype,
    src: Layout,
    dst: Layout,
    cost_model: _cost.CostModel | None = None,
) -> nx.DiGraph:
    """The graph of layouts the search reached, every edge it weighed, the chosen path marked.

    Priced as ``plan`` prices it (``cost_model``, or the agreed model when ``None``).
    """
    return _searched_graph(tuple(shape), dtype, src, dst, _models(src, dst, cost_model))


def _searched_graph(
    shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, models: Models
) -> nx.DiGraph:
    problem = _Problem.make(shape, dtype, src, dst, models)
    graph = nx.DiGraph()
    graph.add_node(problem.layout(problem.start))
    path: Path = []
    if problem.start != problem.goal:
        path, seen = _search(problem, record=True)
        for u, v, move in seen:
            _add_edge(graph, problem.step(u, v, move))
    for u, v, _ in path:
        graph.edges[problem.layout(u), problem.layout(v)]["chosen"] = True
    for node in graph.nodes:
        graph.nodes[node].update(label=str(node), placement=str(node.placement))
    return graph


def _add_edge(graph: nx.DiGraph, step: BoxingStep) -> None:
    graph.add_edge(step.src, step.dst, weight=step.cost, step=step, op=step.op, chosen=False)
