"""Boxing on 1-D placements: every pair of {S(0), S(1), B, P} gives the right pieces.

Compared with a single-process reference: each rank's local tensor after
boxing must equal ``torch.tensor_split`` of a logical tensor the test builds
itself (for P outputs, the locals must sum to it), and the collectives that
ran (``sbpflow.boxing.trace``) must be the DESIGN §3 table's.

All cases run inside one job per pool: placements of 1-4 ranks (in mesh
orders that are and are not the rank order) live in a world of 4, so ranks
outside a placement are exercised too; a world of 2 covers placement == world
for two ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import Broadcast, Partial, SbpParallel, Split
from sbpflow.testing import DistributedPool

from ._reference import SBPS, SHAPES, case_name, logical, piece, placement, source_local

Case = tuple[tuple[int, ...], tuple[int, ...], tuple[int, int], SbpParallel, SbpParallel, int]


def one_d_cases(placements: Sequence[tuple[int, ...]]) -> list[Case]:
    cases = []
    for ranks in placements:
        for shape_index, shape in enumerate(SHAPES):
            for pair_index, (src, dst) in enumerate(itertools.product(SBPS, SBPS)):
                seed = 1000 * len(ranks) + 100 * shape_index + pair_index
                cases.append((ranks, ranks, shape, src, dst, seed))
    return cases


def run_cases(cases: list[Case]) -> list[tuple[torch.Tensor, dict[str, int], tuple[int, ...], str]]:
    """Worker: box each case; return (local, collectives that ran, logical shape, sbp str)."""
    rank = sbpflow.env.get_rank()
    out = []
    for case in cases:
        src_ranks, dst_ranks, shape, src, dst, seed = case
        value = logical(shape, seed)
        x = source_local(value, src_ranks, src, rank, seed).to_global(placement(src_ranks), src)
        before = x.to_local().clone()
        with sbpflow.boxing.trace() as t:
            y = x.to_global(placement(dst_ranks), dst)
        assert torch.equal(x.to_local(), before), f"boxing modified its input: {case_name(case)}"
        out.append((y.to_local().detach(), dict(t.collectives()), tuple(y.shape), str(y.sbp[0])))
    return out


def _expected_collectives(src: SbpParallel, dst: SbpParallel) -> dict[str, int]:
    """DESIGN §3 for a rank inside a placement of more than one rank."""
    if src == dst:
        return {}
    if isinstance(src, Split) and isinstance(dst, Broadcast):
        return {"all_gather": 1}
    if isinstance(src, Partial) and isinstance(dst, Split):
        return {"reduce_scatter": 1}
    if isinstance(src, Partial) and isinstance(dst, Broadcast):
        return {"all_reduce": 1}
    if isinstance(src, Split) and isinstance(dst, Split):
        return {"all_to_all": 1}
    return {}  # B -> S (slice), S -> P and B -> P (local zero-fill)


def check_values(cases: list[Case], per_rank: list[list[Any]]) -> list[str]:
    """Compare every rank's piece with the reference; return readable mismatches."""
    problems = []
    for i, (_, dst_ranks, shape, _, dst, seed) in enumerate(cases):
        value = logical(shape, seed)
        name = case_name(cases[i])
        partial_sum = torch.zeros_like(value)
        for rank, results in enumerate(per_rank):
            local, _, got_shape, got_sbp = results[i]
            if got_shape != tuple(shape) or got_sbp != str(dst):
                problems.append(f"{name}: rank {rank} got shape {got_shape}, sbp {got_sbp}")
            if rank not in dst_ranks:
                if local.numel() != 0 or local.dtype != value.dtype:
                    problems.append(
                        f"{name}: rank {rank} is outside but holds {tuple(local.shape)}"
                    )
                continue
            if isinstance(dst, Partial) and len(dst_ranks) > 1:
                if local.shape != value.shape:
                    problems.append(f"{name}: rank {rank} P piece has shape {tuple(local.shape)}")
                else:
                    partial_sum += local
                continue
            expected = piece(value, dst_ranks, dst, rank)
            if local.shape != expected.shape or not torch.equal(local, expected):
                problems.append(
                    f"{name}: rank {rank} holds {local.tolist()}, expected {expected.tolist()}"
                )
        if isinstance(dst, Partial) and len(dst_ranks) > 1 and not torch.equal(partial_sum, value):
            problems.append(
                f"{name}: P pieces sum to {partial_sum.tolist()}, expected {value.tolist()}"
            )
    return problems


def _check_trace(cases: list[Case], per_rank: list[list[Any]]) -> list[str]:
    problems = []
    for i, (_, ranks, _, src, dst, _) in enumerate(cases):
        for rank, results in enumerate(per_rank):
            ran = results[i][1]
            expected = _expected_collectives(src, dst) if rank in ranks and len(ranks) > 1 else {}
            if ran != expected:
                problems.append(
                    f"{case_name(cases[i])}: rank {rank} ran {ran}, expected {expected}"
                )
    return problems


def _run_and_check(pool: DistributedPool, placements: Sequence[tuple[int, ...]]) -> None:
    cases = one_d_cases(placements)
    per_rank = pool.run(run_cases, cases)
    problems = check_values(cases, per_rank) + _check_trace(cases, per_rank)
    assert not problems, f"{len(problems)} of {len(cases)} cases wrong:\n" + "\n".join(
        problems[:40]
    )


def test_all_pairs_on_placements_of_one_to_four_ranks_in_a_world_of_four(pool: Any) -> None:
    """Placements [0], [0,1], [0,1,2], [0,1,2,3] and the reordered [3,1], [2,0,3,1]."""
    placements = [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (3, 1), (2, 0, 3, 1)]
    _run_and_check(pool(4), placements)


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_all_pairs_when_the_placement_is_the_whole_world(dist_pool: DistributedPool) -> None:
    _run_and_check(dist_pool, [(0, 1), (1, 0), (1,)])


def _same_layout_returns_a_fresh_value() -> bool:
    pl = placement(range(sbpflow.env.get_world_size()))
    x = torch.arange(6.0).reshape(2, 3).to_global(pl, sbpflow.sbp.broadcast)
    with sbpflow.boxing.trace() as t:
        y = x.to_global(pl, sbpflow.sbp.broadcast)
        z = x.to_global()  # both arguments omitted: keep the layout
        w = x.to_global(sbp=sbpflow.sbp.split(1))  # placement omitted
    assert not t.collectives()
    assert torch.equal(y.to_local(), x.to_local()) and torch.equal(z.to_local(), x.to_local())
    assert w.placement == pl and str(w.sbp[0]) == "S(1)"
    return True


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_omitted_arguments_keep_the_current_layout(dist_pool: DistributedPool) -> None:
    assert dist_pool.run(_same_layout_returns_a_fresh_value) == [True, True]
