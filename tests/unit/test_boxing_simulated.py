"""Plans on meshes of up to eight ranks give the right values, checked in one process.

Each plan runs on every rank's piece at once through the mechanical simulator in
``tests/boxing_support.py`` (an all_gather concatenates the members' tensors in
member order, and so on), and the pieces it ends with must form the
single-device reference tensor. This covers the geometry of 8-rank and
cross-placement plans without spawning eight processes; tests/dist checks the
real executor on four.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.boxing import planner
from sbpflow.sbp import Broadcast, Partial, Split
from tests.boxing_support import assemble, make_locals, reference, simulate

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")


def pl(ranks: object) -> sbpflow.placement:
    return sbpflow.placement("cpu", ranks)


def _check(shape: tuple[int, ...], src: Layout, dst: Layout) -> None:
    ref = reference(shape)
    plan = planner.plan(shape, torch.float32, src, dst)
    got = assemble(shape, plan.dst, simulate(plan, make_locals(ref, plan.src)))
    assert torch.equal(got, ref), f"{src.describe()} -> {dst.describe()}\n{plan}"


def _signatures(ndim: int, values: list) -> list[tuple]:
    return list(itertools.product(values, repeat=ndim))


@pytest.mark.parametrize("shape", [(7, 5), (3, 2)], ids=["uneven", "tiny"])
def test_every_pair_on_2x4(shape: tuple[int, int]) -> None:
    mesh = pl([[0, 1, 2, 3], [4, 5, 6, 7]])
    for a, b in itertools.product(_signatures(2, [S0, S1, B, P]), repeat=2):
        _check(shape, Layout(mesh, a), Layout(mesh, b))


@pytest.mark.parametrize("shape", [(8, 8, 8), (5, 6, 7)], ids=["even", "uneven"])
def test_sampled_pairs_on_2x2x2(shape: tuple[int, int, int]) -> None:
    mesh = pl([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    signatures = _signatures(3, [S0, S1, S2, B, P])
    rnd = random.Random(sum(shape))
    for _ in range(120):
        _check(shape, Layout(mesh, rnd.choice(signatures)), Layout(mesh, rnd.choice(signatures)))


CROSS = {
    "2x2->[0,1,2,3]": (pl([[0, 1], [2, 3]]), pl([0, 1, 2, 3])),
    "2x2->[[0],[1]]": (pl([[0, 1], [2, 3]]), pl([[0], [1]])),
    "[0,1]->2x2": (pl([0, 1]), pl([[0, 1], [2, 3]])),
    "2x2->swapped rows": (pl([[0, 1], [2, 3]]), pl([[2, 3], [0, 1]])),
    "2x2x2->[0..7]": (pl([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]), pl(list(range(8)))),
    "2x4->4x2": (pl([[0, 1, 2, 3], [4, 5, 6, 7]]), pl([[0, 1], [2, 3], [4, 5], [6, 7]])),
    "[0,1,2,3]->disjoint 2x2": (pl([0, 1, 2, 3]), pl([[4, 5], [6, 7]])),
    "2x2->containing 2x2x2": (pl([[0, 1], [2, 3]]), pl([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])),
    "[0..7]->reversed 2x2x2": (pl(list(range(8))), pl([[[7, 6], [5, 4]], [[3, 2], [1, 0]]])),
}


# Uneven shapes everywhere; even ones too where the meshes are small (they run fast).
CROSS_CASES = [(name, (7, 5)) for name in CROSS] + [
    (name, (8, 8)) for name, (a, b) in CROSS.items() if a.num_ranks + b.num_ranks <= 8
]


@pytest.mark.parametrize("name, shape", CROSS_CASES)
def test_every_pair_between_placements(name: str, shape: tuple[int, int]) -> None:
    src_pl, dst_pl = CROSS[name]
    values = [S0, S1, B, P]
    for a in _signatures(src_pl.ndim, values):
        for b in _signatures(dst_pl.ndim, values):
            _check(shape, Layout(src_pl, a), Layout(dst_pl, b))


def test_same_pieces_on_a_reshaped_mesh_move_nothing() -> None:
    """(P, P) on [[0, 1], [2, 3]] is P on [0, 1, 2, 3] rank for rank: a local copy."""
    for src, dst in [((P, P), P), ((S0, S0), S0), ((B, B), B)]:
        plan = planner.plan(
            (8, 8), torch.float32, (pl([[0, 1], [2, 3]]), src), (pl([0, 1, 2, 3]), dst)
        )
        assert [s.op for s in plan.steps] == ["copy"], str(plan)


def test_partial_moves_positionally_between_meshes() -> None:
    """(P, P) on 2x2 to P on four other ranks: one send per rank, no reduction first."""
    plan = planner.plan(
        (8, 8), torch.float32, (pl([[0, 1], [2, 3]]), (P, P)), (pl([4, 5, 6, 7]), P)
    )
    assert [s.op for s in plan.steps] == ["send_recv"], str(plan)
