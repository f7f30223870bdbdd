"""The planner finds the cheapest plan, merges mesh axes, and matches published step counts.

Pure: no process group. The reference is an exhaustive search written here, with its own
steps and prices: every sequence of up to four steps, each step setting a set of mesh axes
that hold the same value to another value by the collective of NOTE [one-axis transitions]
in planner.py, priced by the alpha-beta formulas of cost.py computed here (latency rounds
``ceil(log2 p)``, bytes of the group's block, whose size comes from balanced splits cut
here), enumerated layer by layer. The planner's Dijkstra must reach the same minimum, and
each step of its plan must be one of the reference's, at the reference's price. Like the
planner, it enters a partial layout (a local "zero" step) only on axes the destination
keeps partial (NOTE [no partial detours] in planner.py). It plans with two cost models:
one link for every collective, and one where all_to_all is slow.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.boxing import cost, planner
from sbpflow.sbp import Broadcast, Partial, Split

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")
MAX_STEPS = 4
ITEMSIZE = 4  # float32
MESH_2X2 = sbpflow.placement("cpu", [[0, 1], [2, 3]])
MESH_2X4 = sbpflow.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]])
MESH_2X2X2 = sbpflow.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
LINK = (60e-6, 1.5e9)  # alpha (seconds per message), beta (bytes per second)
SLOW_ALL_TO_ALL = (200e-6, 0.2e9)
MODEL = cost.CostModel(cost.LinkCost(*LINK))
MODELS = {
    "one link": (MODEL, {}),
    "slow all_to_all": (
        cost.CostModel(cost.LinkCost(*LINK), (("all_to_all", cost.LinkCost(*SLOW_ALL_TO_ALL)),)),
        {"all_to_all": SLOW_ALL_TO_ALL},
    ),
}
STEP_OVERHEAD = 5e-6  # seconds per step, as cost.py documents
LOCAL_BANDWIDTH = 10e9  # bytes per second of a local copy or zero fill, as cost.py documents


@pytest.fixture(autouse=True, scope="module")
def _fixed_cost_model():
    """Plan with these constants, whatever a calibration on this machine stored."""
    cost.set_model("gloo", MODEL)
    planner.clear_cache()
    yield
    cost.reset()
    planner.clear_cache()


def _seconds(link: tuple[float, float], messages: int, num_bytes: float) -> float:
    alpha, beta = link
    return STEP_OVERHEAD + messages * alpha + num_bytes / beta


class Exhaustive:
    """Best cost over all step sequences of at most ``MAX_STEPS`` steps on one placement."""

    def __init__(
        self,
        shape: tuple[int, ...],
        placement: sbpflow.placement,
        links: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        self.shape, self.mesh = shape, tuple(placement.shape)
        self.links = links or {}
        self.values = [B, P] + [Split(d) for d in range(len(shape))]
        moving = tuple(a for a, n in enumerate(self.mesh) if n > 1)
        # The groups a mesh makes: one per axis, one of the whole mesh (NOTE [meshes]).
        self.axis_sets = [(a,) for a in moving] + ([moving] if len(moving) > 1 else [])
        self._edges: dict[tuple, list[tuple[tuple, float, str, tuple[int, ...]]]] = {}

    def _block_bytes(self, sbp: tuple, axes: tuple[int, ...]) -> int:
        """Bytes of the sub-tensor the group of rank 0 along ``axes`` covers: the other axes'
        splits cut in mesh order, each keeping its first piece (a balanced split gives the
        first pieces the extra rows, so this group's block is the largest)."""
        sizes = list(self.shape)
        for a, s in enumerate(sbp):
            if a not in axes and isinstance(s, Split):
                sizes[s.dim] = -(-sizes[s.dim] // self.mesh[a])
        return math.prod(sizes) * ITEMSIZE

    def _step(self, op: str, p: int, block: int) -> float:
        """NOTE [one-axis transitions]'s collective over ``p`` ranks, in seconds."""
        link = self.links.get(op, LINK)
        rounds = (p - 1).bit_length()  # ceil(log2 p)
        if op in ("all_gather", "reduce_scatter"):
            return _seconds(link, rounds, (p - 1) / p * block)
        if op == "all_reduce":
            return _seconds(link, 2 * rounds, 2 * (p - 1) / p * block)
        if op == "all_to_all":
            return _seconds(link, rounds, (p - 1) / (p * p) * block)
        if op == "slice":
            return STEP_OVERHEAD
        assert op == "zero", op
        return STEP_OVERHEAD + block / LOCAL_BANDWIDTH

    def edges(self, sbp: tuple) -> list[tuple[tuple, float, str, tuple[int, ...]]]:
        """Every step from ``sbp``: (new sbp, seconds, op, axes)."""
        if sbp not in self._edges:
            self._edges[sbp] = [
                edge for axes in self.axis_sets for edge in self._edges_on(sbp, axes)
            ]
        return self._edges[sbp]

    def _edges_on(self, sbp: tuple, axes: tuple[int, ...]):
        current = sbp[axes[0]]
        if any(sbp[a] != current for a in axes):
            return  # merged axes go from one value together
        # A dim split by an axis after the group's first that is not in the group: the
        # group's pieces of that dim interleave, so no step of the group may touch it.
        cut_inside = {
            s.dim
            for b, s in enumerate(sbp)
            if b > axes[0] and b not in axes and isinstance(s, Split)
        }
        if isinstance(current, Split) and current.dim in cut_inside:
            return
        p = math.prod(self.mesh[a] for a in axes)
        block = self._block_bytes(sbp, axes)
        for value in self.values:
            if value == current or (isinstance(value, Split) and value.dim in cut_inside):
                continue
            op = _op(current, value)
            if op is None:
                continue
            new = tuple(value if a in axes else s for a, s in enumerate(sbp))
            yield new, self._step(op, p, block), op, axes

    def best(self, src: tuple, dst: tuple) -> tuple[float, int]:
        """``(cost, steps)`` of the cheapest sequence; ``(inf, -1)`` if none within the limit."""
        if src == dst:
            return 0.0, 0
        layer = {src: 0.0}  # cheapest cost of exactly k steps to each state
        best, best_len = math.inf, -1
        for k in range(1, MAX_STEPS + 1):
            nxt: dict[tuple, float] = {}
            for state, so_far in layer.items():
                for target, step_cost, op, axes in self.edges(state):
                    if op == "zero" and not all(isinstance(dst[a], Partial) for a in axes):
                        continue
                    total = so_far + step_cost
                    if total < nxt.get(target, math.inf):
                        nxt[target] = total
            if dst in nxt and nxt[dst] < best - 1e-15:
                best, best_len = nxt[dst], k
            layer = nxt
        return best, best_len


def _op(current: object, value: object) -> str | None:
    """The one-axis transition table (NOTE [one-axis transitions])."""
    split_from, split_to = isinstance(current, Split), isinstance(value, Split)
    if isinstance(value, Partial):
        return None if isinstance(current, Partial) else "zero"
    if split_from:
        return "all_to_all" if split_to else "all_gather"
    if isinstance(current, Partial):
        return "reduce_scatter" if split_to else "all_reduce"
    return "slice" if split_to else None


def _check_optimal(
    search: Exhaustive, pl: sbpflow.placement, src: tuple, dst: tuple, model: cost.CostModel
) -> None:
    shape = search.shape
    result = planner.plan(shape, torch.float32, (pl, src), (pl, dst), cost_model=model)
    expected, length = search.best(src, dst)
    assert length != -1, f"{src} -> {dst}: no sequence of <= {MAX_STEPS} steps"
    assert len(result.steps) <= MAX_STEPS
    assert math.isclose(result.cost, expected, rel_tol=1e-9, abs_tol=1e-12), (
        f"{src} -> {dst}: planner {result.cost * 1e6:.3f} us, exhaustive {expected * 1e6:.3f} us\n{result}"
    )
    # Each step of the plan is one of the searched steps, by the same op, priced the same.
    state = src
    for step in result.steps:
        assert step.src == Layout(pl, state), str(step)
        options = {(target, op, axes): c for target, c, op, axes in search.edges(state)}
        key = (step.dst.sbp, step.op, tuple(step.axes))
        assert key in options, f"{step}: not a step of the reference"
        assert math.isclose(options[key], step.cost, rel_tol=1e-9), str(step)
        state = step.dst.sbp
    assert state == dst


VALUES_2D = [S0, S1, B, P]
PAIRS_2D = list(itertools.product(itertools.product(VALUES_2D, repeat=2), repeat=2))


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mesh", [MESH_2X2, MESH_2X4], ids=["2x2", "2x4"])
@pytest.mark.parametrize("shape", [(8, 12), (7, 5)], ids=["even", "uneven"])
def test_every_2d_pair_is_optimal(
    mesh: sbpflow.placement, shape: tuple[int, int], model: str
) -> None:
    planned_with, links = MODELS[model]
    search = Exhaustive(shape, mesh, links)
    for src, dst in PAIRS_2D:
        _check_optimal(search, mesh, src, dst, planned_with)


def _sample_3d(count: int, seed: int) -> list[tuple[tuple, tuple]]:
    signatures = list(itertools.product([S0, S1, S2, B, P], repeat=3))
    rnd = random.Random(seed)
    return [(rnd.choice(signatures), rnd.choice(signatures)) for _ in range(count)]


@pytest.mark.parametrize("shape", [(8, 8, 8), (5, 6, 7)], ids=["even", "uneven"])
def test_sampled_3d_pairs_are_optimal(shape: tuple[int, int, int]) -> None:
    search = Exhaustive(shape, MESH_2X2X2)
    for src, dst in _sample_3d(150, seed=len(shape) * 7 + shape[0]):
        _check_optimal(search, MESH_2X2X2, src, dst, MODEL)


# -- merging ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, op",
    [
        ((S0, S0), (B, B), "all_gather"),
        ((P, P), (B, B), "all_reduce"),
        ((P, P), (S0, S0), "reduce_scatter"),
        ((S0, S0), (S1, S1), "all_to_all"),
    ],
)
@pytest.mark.parametrize("shape", [(8, 8), (7, 5)], ids=["even", "uneven"])
def test_merged_axes_make_one_collective(src: tuple, dst: tuple, op: str, shape: tuple) -> None:
    result = planner.plan(shape, torch.float32, (MESH_2X2, src), (MESH_2X2, dst))
    assert [(s.op, s.axes) for s in result.steps] == [(op, (0, 1))], str(result)


def test_merged_collective_on_three_axes() -> None:
    result = planner.plan(
        (8, 8, 8), torch.float32, (MESH_2X2X2, (S0, S0, S0)), (MESH_2X2X2, (B, B, B))
    )
    assert [(s.op, s.axes) for s in result.steps] == [("all_gather", (0, 1, 2))]


def test_no_merge_when_another_axis_cuts_inside() -> None:
    """(S(0), S(1), S(0)): axes 0 and 1 cannot gather dim 0 together while axis 2 splits it."""
    result = planner.plan(
        (8, 8, 8), torch.float32, (MESH_2X2X2, (S0, S1, S0)), (MESH_2X2X2, (B, S1, B))
    )
    for step in result.steps:
        if step.op == "all_gather" and 0 in step.axes:
            assert 2 in step.axes or step.src.sbp[2] != S0, str(result)


# -- published DTensor cases: collective counts -------------------------------------

MESH_4X1 = sbpflow.placement("cpu", [[0], [1], [2], [3]])

# (shape, mesh, src, dst, collectives DTensor's planner uses, collectives here).
# Merged axes go below DTensor where the layout allows one collective over the
# whole mesh: (S(0), S(0)) -> (S(1), S(1)) is one all_to_all over four ranks.
PUBLISHED = [
    ((8, 8), MESH_2X2, (S0, S1), (S0, S0), 1, 1),
    ((8, 8), MESH_2X2, (S0, S1), (S1, S0), 2, 2),
    ((8, 8), MESH_2X2, (S0, S0), (S1, S1), 2, 1),
    ((8, 8, 8), MESH_2X2, (S0, S2), (S1, S0), 2, 2),
    ((8, 8, 8), MESH_2X2, (S1, S1), (S1, S2), 1, 1),
    ((8, 8, 8), MESH_2X2X2, (S0, S0, S0), (S1, S1, S1), 3, 1),
] + [((8, 8), MESH_4X1, (S0, x), (S0, y), 0, 0) for x in (S1, B, P) for y in (S0, S1, B)]


@pytest.mark.parametrize("shape, mesh, src, dst, published, here", PUBLISHED)
def test_published_collective_counts(shape, mesh, src, dst, published, here) -> None:
    result = planner.plan(shape, torch.float32, (mesh, src), (mesh, dst))
    count = len(result.collectives())
    assert count <= published, str(result)
    assert count == here, str(result)


# -- cache and graph ----------------------------------------------------------------


def test_plans_are_cached_on_raw_and_normalised_arguments() -> None:
    a = planner.plan((8, 8), torch.float32, (MESH_2X2, (S0, S1)), (MESH_2X2, (B, B)))
    assert planner.plan((8, 8), torch.float32, (MESH_2X2, (S0, S1)), (MESH_2X2, (B, B))) is a
    assert (
        planner.plan(
            torch.Size([8, 8]), torch.float32, Layout(MESH_2X2, (S0, S1)), (MESH_2X2, [B, B])
        )
        is a
    )
    assert planner.plan([8, 8], torch.float32, (MESH_2X2, [S0, S1]), (MESH_2X2, (B, B))) is a


def test_plans_are_cached_per_cost_model() -> None:
    """New constants re-plan; constants seen before (installed or passed) re-use their plan."""
    args = ((8, 8), torch.float32, (MESH_2X2, (S0, S1)), (MESH_2X2, (S1, S0)))
    before = planner.plan(*args)
    slow = cost.CostModel(cost.LinkCost(MODEL.link.alpha * 1000, MODEL.link.beta))
    cost.set_model("gloo", slow)
    try:
        repriced = planner.plan(*args)
        assert repriced is not before
        assert repriced.cost > before.cost
        assert planner.plan(*args, cost_model=slow) is repriced
        assert planner.plan(*args, cost_model=MODEL) is before
    finally:
        cost.set_model("gloo", MODEL)
    assert planner.plan(*args) is before  # same constants again: the cached plan


def test_to_networkx_marks_the_chosen_path() -> None:
    result = planner.plan((8, 8), torch.float32, (MESH_2X2, (S0, S1)), (MESH_2X2, (S1, S0)))
    graph = result.to_networkx()
    chosen = {(u, v) for u, v, chosen in graph.edges(data="chosen") if chosen}
    assert chosen == {(s.src, s.dst) for s in result.steps}
    assert all(graph.edges[s.src, s.dst]["op"] == s.op for s in result.steps)
    assert graph.number_of_edges() > len(result.steps)


def test_cost_model_must_be_a_cost_model() -> None:
    src, dst = (MESH_2X2, (S0, B)), (MESH_2X2, (B, B))
    with pytest.raises(TypeError, match=r"cost_model must be a .*CostModel or None, got dict"):
        planner.plan((8, 8), torch.float32, src, dst, cost_model={})  # type: ignore[arg-type]
