"""The whole-step search as an integer linear program, solved by HiGHS (``scipy.optimize.milp``).

# NOTE [the program]
# One binary x[n, s] per node n (a representative of its tied class) and strategy s, with
# sum_s x[n, s] = 1. A producer-consumer edge costs boxing(producer's output layout ->
# consumer's input layout) forward plus boxing(consumer's gradient layout -> the gradient
# layout the producer needs) backward. Per edge, the producer's strategies are grouped by
# the output layout they give (z[k] = sum of their x) and the consumer's by (input layout,
# gradient layout) (w[m]); continuous y[k, m] >= 0 with sum_m y[k, m] = z[k] and
# sum_k y[k, m] = w[m] is exactly z[k] * w[m] once z and w are one-hot, so the edge's cost
# sum c[k, m] y[k, m] is linear. Edges whose two ends have one group each need no y.
# Minimise compute + boxing + the optimizer's update seconds (each tied class counted once
# per member; NOTE [the update in the search]), subject to the step's peak bytes per rank
# <= the budget (NOTE [peak memory] in _peak.py).
# The all_reduce of a parameter's gradient into the parameter (broadcast there) is priced as
# the data-parallel buckets run it (NOTE [bucketed gradients in the search] in _costs.py):
# its bytes and its share of a bucket's fixed cost, plus one binary u[axes] per set of mesh
# axes such all_reduces run over, which any choice (or pair variable) that runs one forces
# to 1, and which costs one bucket's fixed cost: the first bucket; and one binary per set of
# axes forced to 1 where the gradient bytes so bucketed, but those of the gradient the
# backward hands over last, reach the small first bucket's, which costs a second bucket's
# (the runtime's rule, ``bucket_last``; where the solver's integrality tolerance leaves that
# binary at ~0 though the bytes reach the first bucket's, it is forced to 1 and the program
# solved again). (A view of a parameter hands a partial gradient on to it: the all_reduce
# can always happen at the parameter.)
# A tiny preference for earlier strategies (all-broadcast first) makes ties deterministic;
# the solver runs with a zero relative gap, so it is exact.
#
# NOTE [the update in the search]
# A parameter's update runs on its local piece (``Prices.update_seconds``): a split weight
# updates 1/n of its elements per rank, a broadcast one all of them. The cost is linear in
# the parameter's choice, so it sits in the one search as a price of each of its strategies.
# Left out, the small Llama of bench/auto_parallel on 2 ranks (batch broadcast) searched
# fastest with its attention data parallel over the batch, the weights broadcast (21
# collectives a step), where torchtitan's layout, which updates half of each attention
# weight per rank, is predicted faster once the update counts. Counted alone it would
# shard weights that are read whole on every axis (ZeRO: gathered to be used, gradients
# reduce-scattered) to save a few percent of the update's memory traffic: storage that
# saves memory, the budget's business. So the update a parameter saves by being stored
# split where a reader reads it whole is given back on that edge
# (``Prices.stored_split_seconds``, per edge from the parameter or a view of it: a
# parameter stored split and read whole by two ops is given it back twice, which only
# holds such storage back further where no budget asks for it). A split whose compute is
# split with it (tensor parallel) keeps its smaller update. The plan's searched seconds
# (``Solution.seconds``) stay compute and boxing; the predicted step adds the update.
#
# Each collective also costs ``ComputeModel.collective_seconds``, its wait for the group's
# slowest rank (NOTE [default prices] in _costs.py): on 2 ranks Megatron's MLP blocks (one
# all_reduce per block and direction) are thus predicted faster than their
# sequence-parallel variant (a reduce_scatter and an all_gather instead, the norms and
# residual adds on half the rows), which the alpha-beta prices alone put 0.1% ahead and which
# measured 1.19x slower on the busy test host.
#
# NOTE [fewer collectives among near ties]
# The prices are round constants (NOTE [default prices] in _costs.py): they do not resolve
# two plans whose predicted steps are within ``NEAR_TIE`` (2%) of each other, and a plan
# meant to run on any machine should not bet collectives on such a margin (each is a point
# where every rank of its group waits for the slowest, which the prices only estimate).
# So the fastest step T is found first, then among the plans predicted within
# ``(1 + NEAR_TIE) * T`` the one with the fewest collectives per step (and among those the
# fastest: the time, scaled to under one collective across the band, is added to the
# count), which is kept where it runs fewer collectives than the fastest. A collective is
# each communicating boxing step, the bucketed all_reduces of parameter gradients counted as
# the one or two buckets the program charges (NOTE [bucketed gradients in the search] in
# _costs.py). Before that second solve, every column whose reduced cost in the first
# program's linear relaxation exceeds the band (``bound - relaxation``) is fixed to 0: no
# plan within the band can take it, and the second program, a count under a time bound, is
# otherwise far slower to solve (163 s against 10 s for the small Llama on a 2x2 mesh).
# Over ``NEAR_TIE_MAX_OPS`` captured ops the second solve is skipped: for Llama-7B on an
# 8x8 mesh it still took 150-340 s, against 15 s for the first.
# bench/auto_parallel's Llama on 2 ranks, its batch broadcast: the fastest plan split the
# head by vocabulary, adding the all_reduce of the head's input gradient (17 collectives a
# step, against torchtitan's decoder layout's 16) for a step predicted 1.7% shorter, and
# measured no faster on the test host in CPU time; with the rule, the plan is that layout, 16.
# The rule is off by default (``NEAR_TIE = 0.0``: the fastest predicted plan): on the 2x2
# mesh it took the small Llama's attention replicated on the tensor axis (13 collectives
# against the hand layout's 20), measured 1.26-1.28x slower than the hand layout, and on
# examples/auto_parallel.py's two blocks it took data parallelism over Megatron's layout.
# Where the prices miss by more than the band, fewer collectives are no better a guess.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..nn.parallel._reducer import FIRST_BUCKET_BYTES
from ..sbp import NdSbp, broadcast
from ._capture import Graph, Node
from ._costs import Prices, local_bytes
from ._peak import MIB, add_peak
from ._strategies import Strategy, grad_target, is_view

__all__ = [
    "Problem",
    "Solution",
    "node_bytes",
    "output_collectives",
    "output_seconds",
    "shared",
    "solve",
]

_TIE_BREAK = 1e-12  # seconds per strategy index: deterministic among equal plans
# plans predicted within this share of the fastest step are near ties, the fewest
# collectives first (NOTE [fewer collectives among near ties]); 0.0, off: the fastest
NEAR_TIE = 0.0
# captured ops above which the near-tie solve is skipped (the fastest plan kept): HiGHS took
# 150-340 s over it for Llama-7B on an 8x8 mesh (2,425 ops), against 15 s for the fastest
NEAR_TIE_MAX_OPS = 1000

# the bucketed all_reduces of a parameter gradient boxing: axes, bytes per rank in all, the
# parameter (representative) and the bytes of one member's gradient
_Mark = tuple[tuple[int, ...], float, int, float]


@dataclass
class Problem:
    graph: Graph
    reps: list[int]  # node -> the node whose decision it shares
    choices: dict[int, list[Strategy]]  # representative -> its candidate strategies
    prices: Prices
    optimizer_states: int
    saved: frozenset[tuple[int, int]]  # op outputs the backward keeps (NOTE [saved activations])


@dataclass
class Solution:
    chosen: dict[int, int]  # representative -> index of its strategy
    accumulate: dict[tuple[int, int], NdSbp]  # G per shared output (NOTE [shared outputs])
    distribute: dict[tuple[int, int], NdSbp]  # F per shared output
    seconds: float  # predicted step (the objective without tie breaks)
    bytes_per_rank: float  # the peak the program bounds (0: it had no budget)
    num_variables: int
    num_constraints: int
    solve_seconds: float
    # per set of axes, the parameter (representative) whose gradient the second-bucket rule
    # takes as the backward's last bucketed one (NOTE [bucketed gradients in the search])
    bucket_last: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)


def node_bytes(node: Node, strategy: Strategy, problem: Problem) -> float:
    """Bytes per rank the node keeps through the step."""
    prices, optimizer_states = problem.prices, problem.optimizer_states
    mesh = prices.mesh
    if node.kind == "param":
        copies = 2 + optimizer_states if node.requires_grad else 1
        return copies * local_bytes(
            node.out_shapes[0], node.out_dtypes[0], strategy.outputs[0], mesh
        )
    if node.kind in ("buffer", "input"):
        return local_bytes(node.out_shapes[0], node.out_dtypes[0], strategy.outputs[0], mesh)
    if node.kind == "op" and not is_view(node):
        return sum(
            local_bytes(shape, dtype, layout, mesh)
            for o, (shape, dtype, layout) in enumerate(
                zip(node.out_shapes, node.out_dtypes, strategy.outputs, strict=True)
            )
            if (node.index, o) in problem.saved
        )
    return 0.0


def output_seconds(
    graph: Graph, prices: Prices, output: tuple[int, int], layout: NdSbp, needs: NdSbp
) -> tuple[float, NdSbp]:
    """Seconds and layout of the cheapest way to hand an output to the loss: never partial.

    The output is reduced where it is partial (``grad_target``), or made whole everywhere;
    the loss's gradient comes back in that layout and is boxed to the one the output needs.
    """
    node = graph.nodes[output[0]]
    shape, dtype = node.out_shapes[output[1]], node.out_dtypes[output[1]]
    best: tuple[float, NdSbp] | None = None
    for target in dict.fromkeys((grad_target(layout), (broadcast,) * len(layout))):
        seconds = prices.boxing(shape, dtype, layout, target)[0]
        if node.requires_grad:
            seconds += prices.boxing(shape, dtype, target, needs)[0]
        if best is None or seconds < best[0]:
            best = (seconds, target)
    assert best is not None
    return best


def output_collectives(
    graph: Graph, prices: Prices, output: tuple[int, int], layout: NdSbp, needs: NdSbp
) -> int:
    """Collectives of handing an output to the loss as ``output_seconds`` does."""
    node = graph.nodes[output[0]]
    shape, dtype = node.out_shapes[output[1]], node.out_dtypes[output[1]]
    target = output_seconds(graph, prices, output, layout, needs)[1]
    ran = prices.collectives(shape, dtype, layout, target)
    if node.requires_grad:
        ran += prices.collectives(shape, dtype, target, needs)
    return ran


def shared(graph: Graph, reps: list[int]) -> set[tuple[int, int]]:
    """Outputs (of representatives) read by several ops.

    NOTE [shared outputs]: with one consumer, an output is boxed straight to the layout its
    consumer reads, and the gradient straight back. With several, the output is boxed once
    to a distribution layout F (a variable of the program), then from F to each consumer's
    layout: q, k and v reading one all_gathered input pay one all_gather. Backward, each
    consumer's gradient is boxed to one accumulation layout G (another variable: partial
    when they all come partial, so Megatron's column-parallel q, k and v share one
    all_reduce), and the sum once from G to the layout the producer needs. F and G equal
    to the producer's own layouts give back the one-consumer prices.
    """
    uses: Counter[tuple[int, int]] = Counter()
    for node in graph.nodes:
        for producer in node.inputs:
            uses[producer] += 1
    return {(u, o) for (u, o), n in uses.items() if n > 1 and reps[u] == u}


def _stored(graph: Graph, u: int) -> Node | None:
    """The parameter node ``u`` is (or is a view of), if any: where its update is."""
    node = graph.nodes[u]
    while is_view(node) and node.inputs:
        node = graph.nodes[node.inputs[0][0]]
    return node if node.kind == "param" else None


def _needs_grad(graph: Graph, u: int, o: int) -> bool:
    node = graph.nodes[u]
    return node.requires_grad and node.out_dtypes[o].is_floating_point


def bucket_last(
    graph: Graph, reps: list[int], marks: list[tuple[int, tuple[int, ...], float, int, float]]
) -> dict[tuple[int, ...], int]:
    """Per set of axes, the parameter class of the first registered parameter whose gradient
    can be all-reduced over them in a bucket: the backward hands its gradient over last."""
    order = {n: k for k, n in enumerate(graph.param_nodes.values())}
    first: dict[int, int] = {}
    for n, k in order.items():
        first[reps[n]] = min(first.get(reps[n], k), k)
    last: dict[tuple[int, ...], int] = {}
    for _, axes, _, param, _ in marks:
        if axes not in last or first.get(param, 0) < first.get(last[axes], 0):
            last[axes] = param
    return last


class _Program:
    """Columns (binary choices and continuous pair variables) and equality rows."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        # the optimizer's update, seconds, less what storing a parameter split where it is
        # read whole saves of it (NOTE [the update in the search])
        self.update: list[float] = []
        self.tie_break: list[float] = []
        # collectives per step each column runs (NOTE [fewer collectives among near ties])
        self.count: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[list[int], list[float], float]] = []
        # rows >= 0 (the peak memory's, NOTE [peak memory] in _peak.py), and the continuous
        # columns with no upper bound (MiB)
        self.positive: list[dict[int, float]] = []
        self.unbounded: list[int] = []
        # (column, axes, bytes, parameter, one): the column runs the all_reduces over those
        # axes of the gradients of the parameter's tied class, those bytes per rank in all,
        # ``one`` of them for each member
        self.buckets: list[tuple[int, tuple[int, ...], float, int, float]] = []
        # per set of axes, the most bytes the chosen columns can bucket over them: the sum
        # over one-hot groups of each group's most
        self.bucket_bound: Counter[tuple[int, ...]] = Counter()

    def choice(
        self,
        costs: list[float],
        update: list[float] | None = None,
        count: list[float] | None = None,
    ) -> int:
        """A one-hot choice among ``len(costs)`` options; returns its first column."""
        first = len(self.cost)
        self.cost += costs
        self.update += update or [0.0] * len(costs)
        self.count += count or [0.0] * len(costs)
        self.tie_break += [_TIE_BREAK * s for s in range(len(costs))]
        self.integer += [1] * len(costs)
        cols = list(range(first, first + len(costs)))
        self.rows.append((cols, [1.0] * len(cols), 1.0))
        return first

    def continuous(self) -> int:
        """A continuous column >= 0 with no upper bound, free in the objective."""
        self.cost.append(0.0)
        self.update.append(0.0)
        self.count.append(0.0)
        self.tie_break.append(0.0)
        self.integer.append(0)
        self.unbounded.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def equal(self, row: dict[int, float]) -> None:
        """``sum(row[col] * x[col]) == 0``."""
        self.rows.append((list(row), list(row.values()), 0.0))

    def at_least(self, row: dict[int, float]) -> None:
        """``sum(row[col] * x[col]) >= 0``."""
        self.positive.append(row)

    def pair(
        self,
        left: dict[object, list[int]],
        right: dict[object, list[int]],
        table: dict[tuple[object, object], float],
        buckets: dict[tuple[object, object], tuple[_Mark, ...]] | None = None,
        update: dict[tuple[object, object], float] | None = None,
        count: dict[tuple[object, object], float] | None = None,
    ) -> None:
        """Add ``table[a, b]`` seconds (``update[a, b]`` seconds of the optimizer's update,
        ``count[a, b]`` collectives) when the left choice is in group a and the right in
        group b (and mark it as running the parameter gradient all_reduces
        ``buckets[a, b]``: axes, bytes, parameter and one member's bytes)."""
        buckets = buckets or {}
        update = update or {}
        count = count or {}
        if not any(table.values()) and not any(buckets.values()) and not any(update.values()):
            assert not any(count.values())  # a collective always costs seconds
            return
        most: dict[tuple[int, ...], float] = {}
        for marks in buckets.values():
            for axes, num_bytes, _, _ in marks:
                most[axes] = max(most.get(axes, 0.0), num_bytes)
        self.bucket_bound.update(most)
        if len(left) == 1 or len(right) == 1:
            for (a, b), c in table.items():
                for col in right[b] if len(left) == 1 else left[a]:
                    self.cost[col] += c
                    self.update[col] += update.get((a, b), 0.0)
                    self.count[col] += count.get((a, b), 0.0)
                    self.buckets += [(col, *mark) for mark in buckets.get((a, b), ())]
            return
        index = {}
        for key, c in table.items():
            index[key] = len(self.cost)
            self.buckets += [(index[key], *mark) for mark in buckets.get(key, ())]
            self.cost.append(c)
            self.update.append(update.get(key, 0.0))
            self.count.append(count.get(key, 0.0))
            self.tie_break.append(0.0)
            self.integer.append(0)
        for a, cols in left.items():
            ys = [index[(a, b)] for b in right]
            self.rows.append((ys + cols, [1.0] * len(ys) + [-1.0] * len(cols), 0.0))
        for b, cols in right.items():
            ys = [index[(a, b)] for a in left]
            self.rows.append((ys + cols, [1.0] * len(ys) + [-1.0] * len(cols), 0.0))


def _groups(first: int, keys: list[object]) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = {}
    for s, key in enumerate(keys):
        groups.setdefault(key, []).append(first + s)
    return groups


def _priced(
    prices: Prices,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    count: int,
    left: dict[object, list[int]],
    right: dict[object, list[int]],
) -> tuple[dict[tuple[object, object], float], dict[tuple[object, object], float]]:
    """Seconds and collectives of boxing each left layout to each right one, ``count`` times."""
    pairs = [(a, b) for a in left for b in right]
    seconds = {(a, b): count * prices.boxing(shape, dtype, a, b)[0] for a, b in pairs}  # type: ignore[arg-type]
    ran = {(a, b): float(count * prices.collectives(shape, dtype, a, b)) for a, b in pairs}  # type: ignore[arg-type]
    return seconds, ran


def solve(
    problem: Problem, budget: float | None, objective: str = "time", near: float | None = None
) -> Solution | None:
    """Solve the program; ``None`` when no plan fits ``budget``.

    ``objective="time"``: the fastest predicted step, the optimizer's update included
    (NOTE [the update in the search]), or the plan with the fewest collectives within
    ``near`` (default ``NEAR_TIE``; 0: the fastest) of it (NOTE [fewer collectives among
    near ties]); ``objective="memory"`` minimises the bytes per rank instead (the smallest
    footprint).
    """
    import numpy as np  # imported when planning: import sbpflow needs neither
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp

    graph, prices, reps = problem.graph, problem.prices, problem.reps
    counts = Counter(reps)

    def gradient(
        u: int, shape: tuple[int, ...], dtype: torch.dtype, src: NdSbp, dst: NdSbp, times: int
    ) -> tuple[float, tuple[_Mark, ...], float]:
        """Seconds of boxing the gradient of ``u`` into ``u``'s own layout, the marks of its
        all_reduces the buckets run (a parameter's) and the collectives it runs alone,
        ``times`` times."""
        seconds, steps = prices.boxing(shape, dtype, src, dst)
        if graph.nodes[u].kind != "param":
            return times * seconds, (), times * prices.collectives(shape, dtype, src, dst)
        seconds, _ = prices.gradient_boxing(shape, dtype, src, dst)
        one = prices.gradient_bytes(shape, dtype, dst)
        bucketed = [bool(prices.bucket_discount(step, dst, one)) for step in steps]
        marks = tuple(
            (step.axes, times * one, u, one) for step, b in zip(steps, bucketed, strict=True) if b
        )
        alone = sum(
            1 for step, b in zip(steps, bucketed, strict=True) if step.is_collective and not b
        )
        return times * seconds, marks, float(times * alone)

    program = _Program()
    offset: dict[int, int] = {}
    for rep in sorted(problem.choices):
        node = graph.nodes[rep]
        options = problem.choices[rep]
        costs = [counts[rep] * prices.compute_seconds(node, s) for s in options]
        ran = [0.0] * len(options)
        for output in graph.outputs:
            if reps[output[0]] == rep:
                for k, s in enumerate(options):
                    o = output[1]
                    seconds, _ = output_seconds(graph, prices, output, s.outputs[o], s.out_grads[o])
                    costs[k] += seconds
                    ran[k] += output_collectives(
                        graph, prices, output, s.outputs[o], s.out_grads[o]
                    )
        update = [counts[rep] * prices.optimizer_seconds(node, s) for s in options]
        offset[rep] = program.choice(costs, update, ran)

    def producer_groups(u: int, o: int) -> dict[object, list[int]]:
        return _groups(offset[u], [(s.outputs[o], s.out_grads[o]) for s in problem.choices[u]])

    # distribution and accumulation layouts (NOTE [shared outputs])
    many = shared(graph, reps)
    consumers: dict[tuple[int, int], list[tuple[int, int]]] = {key: [] for key in many}
    for node in graph.nodes:
        for i, (u, o) in enumerate(node.inputs):
            if (reps[u], o) in consumers:
                consumers[(reps[u], o)].append((reps[node.index], i))
    spread: dict[tuple[int, int], list[NdSbp]] = {}  # F candidates
    candidates: dict[tuple[int, int], list[NdSbp]] = {}  # G candidates
    for u, o in sorted(many):
        found = {s.outputs[o] for s in problem.choices[u]}
        for v, i in consumers[(u, o)]:
            found.update(s.inputs[i] for s in problem.choices[v])
        spread[(u, o)] = sorted(found, key=str)
        if _needs_grad(graph, u, o):
            found = {s.out_grads[o] for s in problem.choices[u]}
            for v, i in consumers[(u, o)]:
                found.update(s.grads[i] for s in problem.choices[v])
            candidates[(u, o)] = sorted(found, key=str)
    spread_offset = {}
    sum_offset = {}
    for (u, o), layouts in spread.items():
        node = graph.nodes[u]
        shape, dtype = node.out_shapes[o], node.out_dtypes[o]
        left = producer_groups(u, o)
        spread_offset[(u, o)] = program.choice([0.0] * len(layouts))
        right = _groups(spread_offset[(u, o)], list(layouts))
        pairs = [(a, f) for a in left for f in right]
        param = _stored(graph, u)
        program.pair(
            left,
            right,
            {(a, f): counts[u] * prices.boxing(shape, dtype, a[0], f)[0] for a, f in pairs},  # type: ignore[index]
            count={
                (a, f): counts[u] * prices.collectives(shape, dtype, a[0], f)  # type: ignore[index]
                for a, f in pairs
            },
            update=None
            if param is None
            else {
                (a, f): counts[u] * prices.stored_split_seconds(param, a[0], f)  # type: ignore[index]
                for a, f in pairs
            },
        )
        if (u, o) not in candidates:
            continue
        layouts = candidates[(u, o)]
        sum_offset[(u, o)] = program.choice([0.0] * len(layouts))
        right = _groups(sum_offset[(u, o)], list(layouts))
        found = {
            (a, g): gradient(u, shape, dtype, g, a[1], counts[u])  # type: ignore[index]
            for a in left
            for g in right
        }
        program.pair(
            left,
            right,
            {key: seconds for key, (seconds, _, _) in found.items()},
            {key: marks for key, (_, marks, _) in found.items()},
            count={key: ran for key, (_, _, ran) in found.items()},
        )

    # edges, merged per (producer class, output, consumer class, input)
    merged: Counter[tuple[int, int, int, int]] = Counter()
    for node in graph.nodes:
        for i, (u, o) in enumerate(node.inputs):
            merged[(reps[u], o, reps[node.index], i)] += 1
    for (u, o, v, i), count in sorted(merged.items()):
        producer = graph.nodes[u]
        shape, dtype = producer.out_shapes[o], producer.out_dtypes[o]
        consumer = problem.choices[v]

        if (u, o) in many:
            left = _groups(spread_offset[(u, o)], list(spread[(u, o)]))
            right = _groups(offset[v], [s.inputs[i] for s in consumer])
            seconds, ran = _priced(prices, shape, dtype, count, left, right)
            program.pair(left, right, seconds, count=ran)
            if (u, o) not in candidates:
                continue
            grads = _groups(offset[v], [s.grads[i] for s in consumer])
            sums_right = _groups(sum_offset[(u, o)], list(candidates[(u, o)]))
            seconds, ran = _priced(prices, shape, dtype, count, grads, sums_right)
            program.pair(grads, sums_right, seconds, count=ran)
            continue
        left = producer_groups(u, o)
        right = _groups(offset[v], [(s.inputs[i], s.grads[i]) for s in consumer])
        table, marks, update, ran = {}, {}, {}, {}
        param = _stored(graph, u)
        for a in left:
            for b in right:
                forward = prices.boxing(shape, dtype, a[0], b[0])[0]  # type: ignore[index]
                backward: tuple[float, tuple[_Mark, ...], float] = (0.0, (), 0.0)
                if _needs_grad(graph, u, o):
                    backward = gradient(u, shape, dtype, b[1], a[1], count)  # type: ignore[index]
                table[(a, b)] = count * forward + backward[0]
                marks[(a, b)] = backward[1]
                ran[(a, b)] = count * prices.collectives(shape, dtype, a[0], b[0]) + backward[2]  # type: ignore[index]
                if param is not None:
                    update[(a, b)] = count * prices.stored_split_seconds(param, a[0], b[0])  # type: ignore[index]
        program.pair(left, right, table, marks, update, ran)

    # one bucket's fixed cost per set of axes parameter gradients are all-reduced over, and
    # another where they overflow the small first bucket (NOTE [bucketed gradients in the
    # search] in _costs.py)
    last = bucket_last(graph, reps, program.buckets)
    bucket_columns, second_columns = {}, {}
    for axes in sorted({mark[1] for mark in program.buckets}):
        for columns in (bucket_columns, second_columns):
            columns[axes] = len(program.cost)
            program.cost.append(prices.bucket_fixed_seconds(axes))
            program.update.append(0.0)
            program.count.append(1.0)
            program.tie_break.append(0.0)
            program.integer.append(1)

    # the peak bytes per rank, where a budget bounds them or they are the objective
    peak = add_peak(program, problem, offset) if budget is not None or objective != "time" else None
    num_vars = len(program.cost)
    c_time = np.asarray(program.cost)
    c_update = np.asarray(program.update)
    c_ties = np.asarray(program.tie_break)
    data, row_ids, col_ids, rhs = [], [], [], []
    for r, (cols, coefs, value) in enumerate(program.rows):
        row_ids += [r] * len(cols)
        col_ids += cols
        data += coefs
        rhs.append(value)
    matrix = sparse.csr_matrix((data, (row_ids, col_ids)), shape=(len(program.rows), num_vars))
    constraints = [LinearConstraint(matrix, rhs, rhs)]
    if program.buckets:  # column <= u[axes]
        rows = range(len(program.buckets))
        marks = sparse.csr_matrix(
            (
                [1.0, -1.0] * len(program.buckets),
                (
                    [r for r in rows for _ in (0, 1)],
                    [c for col, axes, *_ in program.buckets for c in (col, bucket_columns[axes])],
                ),
            ),
            shape=(len(program.buckets), num_vars),
        )
        constraints.append(LinearConstraint(marks, -np.inf, 0.0))
        # the bytes bucketed over axes but the last gradient's < the first bucket's, or
        # second[axes] = 1 (NOTE [bucketed gradients in the search] in _costs.py)
        order = sorted(second_columns)
        data, row_ids, col_ids = [], [], []
        for col, axes, num_bytes, param, one in program.buckets:
            data.append(num_bytes - (one if param == last[axes] else 0.0))
            row_ids.append(order.index(axes))
            col_ids.append(col)
        below = FIRST_BUCKET_BYTES - 1.0  # gradient bytes are whole numbers
        for r, axes in enumerate(order):
            data.append(-max(program.bucket_bound[axes] - below, 1.0))
            row_ids.append(r)
            col_ids.append(second_columns[axes])
        overflow = sparse.csr_matrix((data, (row_ids, col_ids)), shape=(len(order), num_vars))
        constraints.append(LinearConstraint(overflow, -np.inf, below))
    if program.positive:
        data, row_ids, col_ids = [], [], []
        for r, row in enumerate(program.positive):
            row_ids += [r] * len(row)
            col_ids += list(row)
            data += list(row.values())
        shape = (len(program.positive), num_vars)
        rows = sparse.csr_matrix((data, (row_ids, col_ids)), shape=shape)
        constraints.append(LinearConstraint(rows, 0.0, np.inf))
    integrality = np.asarray(program.integer)
    bounds = Bounds(np.zeros(num_vars), np.ones(num_vars))
    bounds.ub[program.unbounded] = np.inf
    c_memory = np.zeros(num_vars)
    if peak is not None:
        c_memory[peak] = 1.0
        if budget is not None and objective == "time":
            bounds.ub[peak] = float(budget) / MIB
    options = {"mip_rel_gap": 0.0, "presolve": True}

    def run(
        c: np.ndarray,
        extra: list[LinearConstraint],
        upper: np.ndarray | None = None,
        gap: float = 0.0,
    ) -> Any:
        limits = Bounds(bounds.lb.copy(), bounds.ub if upper is None else upper)
        while True:
            result = milp(
                c,
                integrality=integrality,
                bounds=limits,
                constraints=constraints + extra,
                options={**options, "mip_rel_gap": gap},
            )
            if result.x is None or not program.buckets:
                return result
            # A second bucket's binary takes up a few bytes over the first bucket for each
            # unit of the solver's integrality tolerance times its big coefficient: where the
            # gradients overflow the first bucket by so few, the solver keeps it at ~0. Such
            # sets of axes pay their second bucket, solved again.
            chosen_x = np.round(result.x)
            over = [
                second_columns[axes]
                for r, axes in enumerate(order)
                if chosen_x[second_columns[axes]] == 0 and (overflow[r] @ chosen_x)[0] > below
            ]
            if not over:
                return result
            limits.lb[over] = 1.0

    # scaled to milliseconds / MiB so HiGHS' tolerances see numbers near one
    step_ms = (c_time + c_update) * 1e3
    c = step_ms + c_ties * 1e3 if objective == "time" else c_memory + c_ties
    start = time.perf_counter()
    result = run(c, [])
    near = NEAR_TIE if near is None else near
    num_ops = sum(1 for node in graph.nodes if node.kind == "op")
    if objective == "time" and near > 0 and result.x is not None and num_ops <= NEAR_TIE_MAX_OPS:
        # NOTE [fewer collectives among near ties]
        c_count = np.asarray(program.count)
        bound = float(step_ms @ result.x) * (1.0 + near)
        # a column whose reduced cost in the relaxation takes the step past the bound is 0
        # in every plan within it
        a_ub, b_ub = _as_upper_bounds(constraints[1:])
        lp = linprog(
            step_ms,
            A_ub=a_ub,
            b_ub=b_ub,
            A_eq=matrix,
            b_eq=rhs,
            bounds=[(0.0, None if np.isinf(hi) else hi) for hi in bounds.ub],
            method="highs",
        )
        upper = bounds.ub.copy()
        if lp.status == 0:
            slack = bound - lp.fun + 1e-6 * bound
            upper[np.asarray(lp.lower.marginals) > slack] = 0.0
        # the count plus the step scaled to half a collective across the band: a gap of a
        # quarter of a collective still finds the fewest collectives
        scale = 0.5 / (bound - bound / (1.0 + near))
        most = float(c_count @ np.round(result.x)) + scale * bound
        fewer = run(
            c_count + scale * step_ms + c_ties,
            [LinearConstraint(step_ms.reshape(1, -1), -np.inf, bound)],
            upper,
            gap=0.25 / most,
        )
        if fewer.x is not None and c_count @ np.round(fewer.x) < c_count @ np.round(result.x) - 0.5:
            result = fewer
    elapsed = time.perf_counter() - start
    if result.x is None:
        if result.status == 2:  # infeasible
            return None
        raise RuntimeError(f"the plan's integer program was not solved: {result.message}")

    def pick(first: int, n: int) -> int:
        return int(np.argmax(result.x[first : first + n]))

    chosen = {rep: pick(offset[rep], len(problem.choices[rep])) for rep in problem.choices}
    accumulate = {
        key: candidates[key][pick(sum_offset[key], len(candidates[key]))] for key in candidates
    }
    distribute = {key: spread[key][pick(spread_offset[key], len(spread[key]))] for key in spread}
    return Solution(
        chosen=chosen,
        accumulate=accumulate,
        distribute=distribute,
        seconds=float(c_time @ result.x),
        bytes_per_rank=0.0 if peak is None else float(result.x[peak]) * MIB,
        num_variables=num_vars,
        num_constraints=len(program.rows) + sum(c.A.shape[0] for c in constraints[1:]),
        solve_seconds=elapsed,
        bucket_last=last,
    )


def _as_upper_bounds(constraints: list[Any]) -> tuple[Any, Any]:
    """``constraints`` as ``linprog``'s ``A_ub x <= b_ub`` (a lower bound as its negation);
    ``(None, None)`` where there are none."""
    import numpy as np
    from scipy import sparse

    blocks, limits = [], []
    for k in constraints:
        a = sparse.csr_matrix(k.A)
        for side, sign in ((k.ub, 1.0), (k.lb, -1.0)):
            values = np.broadcast_to(np.asarray(side, dtype=float), (a.shape[0],))
            finite = np.flatnonzero(np.isfinite(values))
            if finite.size:
                blocks.append(sign * a[finite])
                limits.append(sign * values[finite])
    if not blocks:
        return None, None
    return sparse.vstack(blocks), np.concatenate(limits)
