"""N-D boxing on four real ranks: every SBP pair on 2x2 meshes and across 2-D/1-D placements.

Compared with a single-device reference: each rank returns its local tensor
after ``x.to_global(placement, sbp)``, and this process assembles the logical
tensor from the destination ranks' pieces (partial outputs by summing the
ranks' terms, replicas checked equal; ``tests/boxing_support.py``), which must
equal the reference exactly. Every rank also returns the collectives that ran
(``boxing.trace``) and the plan's own list, and they must agree.
"""

from __future__ import annotations

import collections
import itertools
import random
from typing import Any

import torch

import sbpflow
from sbpflow import boxing
from sbpflow._layout import Layout, empty_local_shape
from sbpflow.env import get_rank
from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.tensor import GlobalTensor
from tests.boxing_support import assemble, make_locals, reference

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
VALUES = (S0, S1, B, P)
Case = tuple[tuple[int, ...], Layout, Layout]


def pl(ranks: object) -> sbpflow.placement:
    return sbpflow.placement("cpu", ranks)


def _pairs(
    src_pl: sbpflow.placement, dst_pl: sbpflow.placement, shapes: list[tuple[int, int]]
) -> list[Case]:
    return [
        (shape, Layout(src_pl, a), Layout(dst_pl, b))
        for shape in shapes
        for a in itertools.product(VALUES, repeat=src_pl.ndim)
        for b in itertools.product(VALUES, repeat=dst_pl.ndim)
    ]


def suite(name: str) -> list[Case]:
    """The cases of one test, built the same way on every rank and in the test."""
    mesh = pl([[0, 1], [2, 3]])
    if name == "2x2":
        return _pairs(mesh, mesh, [(8, 8), (7, 5)])
    if name == "2x2 in reverse rank order":  # process-group order is not mesh order here
        reverse = pl([[3, 2], [1, 0]])
        return _pairs(reverse, reverse, [(7, 5)])
    if name == "across placements":  # uneven shapes; more shapes run in test_boxing_simulated
        return (
            _pairs(mesh, pl([0, 1, 2, 3]), [(8, 8), (7, 5)])
            + _pairs(mesh, pl([[0], [1]]), [(7, 5)])
            + _pairs(pl([0, 1]), mesh, [(7, 5)])
            + _pairs(mesh, pl([[2, 3], [0, 1]]), [(7, 5)])
        )
    if name == "eight ranks":  # cross-placement on a world of 8, sampled pairs
        cube = pl([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
        cases = (
            _pairs(cube, pl(list(range(8))), [(7, 5)])
            + _pairs(
                pl([[0, 1, 2, 3], [4, 5, 6, 7]]), pl([[0, 4], [1, 5], [2, 6], [3, 7]]), [(7, 5)]
            )
            + _pairs(pl([0, 1, 2, 3]), pl([[4, 5], [6, 7]]), [(7, 5)])
            + _pairs(mesh, pl([4, 5, 6, 7]), [(7, 5)])
        )
        return random.Random(0).sample(cases, 160)
    raise KeyError(name)


# -- the job each rank runs (module level, so the ranks can import it) ---------------


def run_suite(name: str) -> list[tuple[torch.Tensor, dict[str, int], dict[str, int], bool]]:
    """Box every case of ``suite(name)``.

    Per case: (local result, collectives run, collectives planned, input left as it was).
    """
    rank = get_rank()
    results = []
    for shape, src, dst in suite(name):
        pieces = make_locals(reference(shape), src)
        local = pieces.get(rank, torch.empty(empty_local_shape(len(shape))))
        before = local.clone()
        x = GlobalTensor(local, src, shape)
        with boxing.trace() as t:
            y = x.to_global(dst.placement, dst.sbp, check_meta=False)
        planned = boxing.plan(shape, torch.float32, src, dst).collectives()
        ran = dict(t.collectives())
        results.append(
            (
                y.to_local().detach(),
                ran,
                dict(collections.Counter(planned)),
                torch.equal(local, before),
            )
        )
    return results


# -- checks ---------------------------------------------------------------------------


def _check_suite(pool: Any, name: str, world_size: int = 4) -> None:
    cases = suite(name)
    per_rank = pool(world_size).run(run_suite, name)
    problems = []
    for index, (shape, src, dst) in enumerate(cases):
        label = f"{src.describe()} -> {dst.describe()} shape {list(shape)}"
        pieces = {r: per_rank[r][index][0] for r in dst.placement.flat_ranks}
        try:
            got = assemble(shape, dst, pieces)
        except AssertionError as error:
            problems.append(f"{label}: {error}")
            continue
        if not torch.equal(got, reference(shape)):
            problems.append(f"{label}: wrong values")
        for r in set(src.placement.flat_ranks) & set(dst.placement.flat_ranks):
            ran, planned = per_rank[r][index][1], per_rank[r][index][2]
            if ran != planned:
                problems.append(f"{label}: rank {r} ran {ran}, the plan has {planned}")
        for r in range(world_size):
            if not per_rank[r][index][3]:
                problems.append(f"{label}: rank {r}'s input tensor was modified")
            if r not in dst.placement and per_rank[r][index][0].numel() != 0:
                problems.append(f"{label}: rank {r} is outside the destination but holds data")
    assert not problems, f"{len(problems)} of {len(cases)} cases wrong:\n" + "\n".join(
        problems[:30]
    )


def test_every_pair_on_2x2(pool: Any) -> None:
    _check_suite(pool, "2x2")


def test_every_pair_on_2x2_in_reverse_rank_order(pool: Any) -> None:
    _check_suite(pool, "2x2 in reverse rank order")


def test_across_2d_and_1d_placements(pool: Any) -> None:
    _check_suite(pool, "across placements")


def test_across_placements_on_eight_ranks(pool: Any) -> None:
    """2x2x2 -> 1-D, 2x4 -> 4x2 (other rank order), 1-D -> disjoint 2x2, 2x2 -> disjoint 1-D."""
    _check_suite(pool, "eight ranks", world_size=8)


def merged_gather() -> tuple[dict[str, int], torch.Tensor]:
    mesh = pl([[0, 1], [2, 3]])
    src = Layout(mesh, (S0, S0))
    shape = (7, 5)
    x = GlobalTensor(make_locals(reference(shape), src)[get_rank()], src, shape)
    with boxing.trace() as t:
        y = x.to_global(mesh, (B, B), check_meta=False)
    return dict(t.collectives()), y.to_local()


def test_merged_axes_run_one_all_gather(pool: Any) -> None:
    """(S(0), S(0)) -> (B, B) on 2x2 is one all_gather over the four ranks, not two."""
    for ran, local in pool(4).run(merged_gather):
        assert ran == {"all_gather": 1}
        assert torch.equal(local, reference((7, 5)))
