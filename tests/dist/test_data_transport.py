"""Boxing on both data transports (NOTE [collective transports]).

On one host, CPU collectives move their data through a shared-memory arena;
with ``SBPFLOW_SHARED_MEMORY=0`` (as on a multi-host world) they go over gloo.
Both must give the single-process result, the arena also for tensors larger
than its slots (several rounds), and ranks that make different collective
calls must get an error, not each other's bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
import torch

import sbpflow
from sbpflow.comm import _groups, _shared_arena, _transport, collectives
from sbpflow.comm.collectives import CollectiveError
from sbpflow.sbp import broadcast, partial_sum, split
from sbpflow.testing import DistributedPool
from tests.dist.test_boxing_1d import _run_and_check
from tests.dist.test_errors import WITHIN_S


def _arena_slot_sizes() -> dict[tuple[int, ...], int | None]:
    return {ranks: a and a.slot_bytes for ranks, a in _transport._arenas.items()}


@pytest.fixture(scope="module")
def gloo_data_pool() -> Iterator[DistributedPool]:
    """A private 2-rank pool whose ranks start with ``SBPFLOW_SHARED_MEMORY=0``."""
    with DistributedPool(2, timeout=120.0, env={"SBPFLOW_SHARED_MEMORY": "0"}) as pool:
        yield pool


@pytest.mark.skipif(not _shared_arena.SUPPORTED, reason="the arena is x86 only")
@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_one_host_boxes_through_the_arena(dist_pool: DistributedPool) -> None:
    _run_and_check(dist_pool, [(0, 1)])
    for sizes in dist_pool.run(_arena_slot_sizes):
        assert isinstance(sizes.get((0, 1)), int), sizes


def test_every_one_d_pair_over_gloo(gloo_data_pool: DistributedPool) -> None:
    _run_and_check(gloo_data_pool, [(0,), (0, 1)])
    for sizes in gloo_data_pool.run(_arena_slot_sizes):
        assert sizes and all(size is None for size in sizes.values()), sizes


# 12 MiB of float32: more than one 4 MiB slot for every collective, so each runs in rounds.
_BIG = (3072, 1024)


def _box_big() -> list[float]:
    """Worst absolute error against the single-process result, per case."""
    placement = sbpflow.placement("cpu", [0, 1])
    rank = sbpflow.env.get_rank()
    torch.manual_seed(7)
    halves = [torch.randn(_BIG), torch.randn(_BIG)]  # each rank's partial value
    whole = halves[0] + halves[1]
    errors = []
    for src, dst in [
        (partial_sum, broadcast),  # all_reduce
        (partial_sum, split(0)),  # reduce_scatter
        (partial_sum, split(1)),  # reduce_scatter along an inner dim
        (split(0), broadcast),  # all_gather
        (split(1), broadcast),  # all_gather along an inner dim
        (split(0), split(1)),  # all_to_all
    ]:
        start = halves[rank].to_global(placement, partial_sum).to_global(sbp=src)
        got = start.to_global(sbp=dst).to_local()
        expected = sbpflow.to_global(whole, placement, broadcast).to_global(sbp=dst).to_local()
        if dst == broadcast:  # the reference itself moved no data
            expected = whole
        errors.append(float((got - expected).abs().max()))
    return errors


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_tensors_larger_than_a_slot_give_the_single_process_result(
    dist_pool: DistributedPool, gloo_data_pool: DistributedPool
) -> None:
    for pool in (dist_pool, gloo_data_pool):
        for errors in pool.run(_box_big):
            assert max(errors) < 1e-5, errors


def _reduce_different_sizes() -> None:
    rank = sbpflow.env.get_rank()
    group = _groups.group_of("cpu", [(0, 1)], rank)
    assert group is not None
    collectives.all_reduce(torch.ones(4 + 4 * rank), group, "sum", inplace=False)


@pytest.mark.skipif(not _shared_arena.SUPPORTED, reason="the arena is x86 only")
def test_ranks_making_different_calls_all_raise() -> None:
    with DistributedPool(2, timeout=60.0) as pool:  # private: the group is out of step after
        outcomes = pool.run_expect_errors(_reduce_different_sizes, timeout=WITHIN_S)
    outcomes.assert_all_raised(
        CollectiveError, match="the ranks run different collectives", within=WITHIN_S
    )
    for error in outcomes:
        assert "all_reduce over ranks [0, 1] failed" in str(error), error


def _arena_in_use_under(context: str) -> bool:
    """Whether a P -> B used the arena, inside ``process_group_only()`` or not."""
    placement = sbpflow.placement("cpu", [0, 1])
    rank = sbpflow.env.get_rank()
    partial = torch.full((4, 3), float(rank + 1)).to_global(placement, partial_sum)
    partial.to_global(sbp=broadcast)  # the group's arena exists from here on
    used = []
    original = _shared_arena.SharedArena.all_reduce

    def spy(self: _shared_arena.SharedArena, *args: object, **kwargs: object) -> None:
        used.append(True)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    _shared_arena.SharedArena.all_reduce = spy  # type: ignore[method-assign]
    try:
        if context == "process group only":
            with _transport.process_group_only():
                out = partial.to_global(sbp=broadcast)
        else:
            out = partial.to_global(sbp=broadcast)
    finally:
        _shared_arena.SharedArena.all_reduce = original  # type: ignore[method-assign]
    assert torch.equal(out.to_local(), torch.full((4, 3), 3.0))
    return bool(used)


@pytest.mark.skipif(not _shared_arena.SUPPORTED, reason="the arena is x86 only")
@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_process_group_only_keeps_data_off_the_arena(dist_pool: DistributedPool) -> None:
    assert dist_pool.run(_arena_in_use_under, "default") == [True, True]
    assert dist_pool.run(_arena_in_use_under, "process group only") == [False, False]


def _rank_one_exits_before_reducing() -> str:
    rank = sbpflow.env.get_rank()
    group = _groups.group_of("cpu", [(0, 1)], rank)
    assert group is not None
    collectives.all_reduce(torch.ones(4), group, "sum", inplace=False)  # sets the arena up
    if rank == 1:
        os._exit(3)
    collectives.all_reduce(torch.ones(4), group, "sum", inplace=False)
    return "finished"


@pytest.mark.skipif(not _shared_arena.SUPPORTED, reason="the arena is x86 only")
def test_a_rank_that_exits_mid_collective_is_noticed_long_before_the_timeout() -> None:
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": "120"}) as pool:
        outcomes = pool.run_expect_errors(_rank_one_exits_before_reducing, timeout=WITHIN_S)
    assert outcomes.elapsed < 15, outcomes.elapsed
    assert re.search(
        r"sbpflow: all_reduce over ranks \[0, 1\] failed\..*rank 1 \(pid \d+\) exited while the "
        r"others waited",
        str(outcomes[0]),
    ), str(outcomes[0])
