"""The collectives of ``sbpflow.comm.collectives`` over gloo, against one-process results.

Every job builds the logical tensors itself (the same on every rank for a
seed) and compares what the collective gave this rank with the piece plain
single-process PyTorch computes from them: uneven (balanced) pieces, inner
dims, groups whose mesh order differs from the process group's, tensors of
several MiB. A rank that dies mid-collective must surface on the other as a
named ``CollectiveError``, long before the collective timeout.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import sbpflow
from sbpflow.comm import _groups, collectives
from sbpflow.sbp import broadcast, partial_sum, split
from sbpflow.testing import DistributedPool
from tests.dist._collective_errors import assert_collective_error


def _sizes(length: int, num: int) -> list[int]:
    return [t.shape[0] for t in torch.tensor_split(torch.empty(length), num)]


def _group_orders(world: int) -> list[tuple[int, ...]]:
    """The whole world in order, reversed, and (on 4 ranks) shuffled: mesh != group order."""
    orders = [tuple(range(world)), tuple(reversed(range(world)))]
    if world == 4:
        orders.append((2, 0, 3, 1))
    return orders


def _collectives_against_one_process(shape: tuple[int, int]) -> list[str]:
    """Every collective on every group order and dim; returns the mismatches found."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    problems: list[str] = []

    def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if got.shape != expected.shape or not torch.equal(got, expected):
            problems.append(f"{name} on rank {rank}: {got.shape} vs expected {expected.shape}")

    gen = torch.Generator().manual_seed(11)
    # small integers: sums are exact in float32, so results compare with torch.equal
    parts = [torch.randint(-8, 9, shape, generator=gen).float() for _ in range(world)]
    whole = parts[0]
    for order in _group_orders(world):
        group = _groups.group_of("cpu", [order], rank)
        assert group is not None
        member = order.index(rank)
        for dim in (0, 1):
            sizes = _sizes(shape[dim], world)
            pieces = torch.tensor_split(whole, world, dim=dim)
            where = f"group {list(order)}, dim {dim}"
            got = collectives.all_gather(pieces[member].clone(), dim, group, sizes)
            check(f"all_gather {where}", got, whole)  # member k holds piece k
            total = sum(parts)
            got = collectives.reduce_scatter(parts[rank].clone(), dim, group, sizes, "sum")
            check(f"reduce_scatter {where}", got, torch.tensor_split(total, world, dim=dim)[member])
            largest = torch.stack(parts).amax(0)
            got = collectives.reduce_scatter(parts[rank].clone(), dim, group, sizes, "max")
            check(
                f"reduce_scatter max {where}", got, torch.tensor_split(largest, world, dim)[member]
            )
            other = 1 - dim
            src_sizes = _sizes(shape[other], world)
            local = torch.tensor_split(whole, world, dim=other)[member].clone()
            got = collectives.all_to_all(local, other, dim, group, src_sizes, sizes)
            check(f"all_to_all {where}", got, pieces[member])
        got = collectives.all_reduce(parts[rank].clone(), group, "sum", inplace=True)
        check(f"all_reduce sum, group {list(order)}", got, sum(parts))
        got = collectives.all_reduce(parts[rank].clone(), group, "max", inplace=False)
        check(f"all_reduce max, group {list(order)}", got, torch.stack(parts).amax(0))
        buffer = parts[rank].clone()
        collectives.broadcast(buffer, order[-1], group)
        check(f"broadcast from {order[-1]}", buffer, parts[order[-1]])
    return problems


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
@pytest.mark.parametrize("shape", [(13, 6), (8, 12), (3, 5)])
def test_collectives_give_the_one_process_result(
    dist_pool: DistributedPool, shape: tuple[int, int]
) -> None:
    """Uneven pieces (13 over 4: 4,3,3,3; 3 over 4: 1,1,1,0) and even ones, both dims."""
    problems = [
        p for ranks in dist_pool.run(_collectives_against_one_process, shape) for p in ranks
    ]
    assert not problems, "\n".join(problems)


# 12 MiB of float32: several MiB per message on every collective.
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
        if dst == broadcast:
            expected = whole
        else:
            expected = torch.tensor_split(whole, 2, dim=dst.dim)[rank]
        errors.append(float((got - expected).abs().max()) if got.shape == expected.shape else 1e9)
    return errors


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_tensors_of_several_mib_give_the_single_process_result(dist_pool: DistributedPool) -> None:
    for errors in dist_pool.run(_box_big):
        assert max(errors) < 1e-5, errors


def _large_all_reduces() -> list[str]:
    """all_reduce into a new tensor of 8 MiB (two exchanges on two members, NOTE [gloo gathers
    and reductions]) and of an odd length (gloo's own), in both group orders, sum and max,
    against the one-process result; the source must stay as it was."""
    rank = sbpflow.env.get_rank()
    gen = torch.Generator().manual_seed(3)
    problems = []
    for shape in [(2**15, 64), (2**15 + 1, 63)]:
        parts = [torch.randint(-8, 9, shape, generator=gen).float() for _ in range(2)]
        for order in [(0, 1), (1, 0)]:
            group = _groups.group_of("cpu", [order], rank)
            assert group is not None
            for op, expected in [("sum", parts[0] + parts[1]), ("max", parts[0].maximum(parts[1]))]:
                source = parts[rank].clone()
                got = collectives.all_reduce(source, group, op, inplace=False)
                if not torch.equal(got, expected) or not torch.equal(source, parts[rank]):
                    problems.append(f"{op} of {shape}, group {list(order)} on rank {rank}")
    return problems


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_large_all_reduces_give_the_single_process_result(dist_pool: DistributedPool) -> None:
    problems = [p for ranks in dist_pool.run(_large_all_reduces) for p in ranks]
    assert not problems, "\n".join(problems)


def _rank_one_exits_mid_collective() -> str:
    rank = sbpflow.env.get_rank()
    group = _groups.group_of("cpu", [(0, 1)], rank)
    assert group is not None
    collectives.all_reduce(torch.ones(4), group, "sum", inplace=False)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is inside the next all_reduce by then
        os._exit(3)
    collectives.all_reduce(torch.ones(4), group, "sum", inplace=False)
    return "finished"


def test_a_rank_that_exits_mid_collective_is_noticed_long_before_the_timeout() -> None:
    """gloo sees the closed connection (about 0.5 s here, the sleep included); the timeout is 120 s."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": "120"}) as pool:
        outcomes = pool.run_expect_errors(_rank_one_exits_mid_collective, timeout=30.0)
    assert outcomes.elapsed < 15, outcomes.elapsed
    assert_collective_error(
        outcomes[0],
        r"sbpflow: all_reduce over ranks \[0, 1\] failed in the call at test_collectives\.py:\d+, "
        r"a collective: every rank in it must reach it\. A peer rank closed its connection",
    )
