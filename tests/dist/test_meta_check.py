"""The metadata check (NOTE [meta check]) over the world, on the control group.

A disagreement must become the same readable ``ValueError`` on every rank,
also when a single rank of four differs; local -> global must still learn
every rank's local shape (the logical shape is compared with the one the test
computes in one process); each check must be small collectives of a fixed
size, the same first one for every check (NOTE [call agreement]); a rank that
dies must not leave the others waiting for the collective timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import sbpflow
from sbpflow import _meta_check
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool
from tests.dist._collective_errors import assert_collective_error


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def _last_rank_boxes_differently() -> None:
    """Only the last rank asks for another SBP: the hash of one vector of four differs."""
    last = sbpflow.env.get_rank() == sbpflow.env.get_world_size() - 1
    g = torch.ones(8, 3).to_global(_world(), broadcast)
    g.to_global(sbp=split(1) if last else split(0))


def _last_rank_passes_another_dtype() -> None:
    last = sbpflow.env.get_rank() == sbpflow.env.get_world_size() - 1
    torch.ones(2, 3, dtype=torch.float64 if last else torch.float32).to_global(_world(), split(0))


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
@pytest.mark.parametrize(
    "job, match",
    [
        (
            _last_rank_boxes_differently,
            r"ranks disagree in to_global \(boxing\):\n  sbp: rank 0 passed B -> S\(0\), "
            r"rank 1 passed B -> S\(0\), rank 2 passed B -> S\(0\), rank 3 passed B -> S\(1\)",
        ),
        (
            _last_rank_passes_another_dtype,
            r"ranks disagree in to_global:\n  dtype: rank 0 passed torch.float32, .*"
            r"rank 3 passed torch.float64",
        ),
    ],
)
def test_one_rank_of_four_disagreeing_is_the_same_error_everywhere(
    dist_pool: DistributedPool, job: Callable[[], None], match: str
) -> None:
    outcomes = dist_pool.run_expect_errors(job, timeout=30.0)
    outcomes.assert_all_raised(ValueError, match=match, within=30.0)
    assert len({str(error) for error in outcomes}) == 1, [str(e) for e in outcomes]


def _uneven_locals() -> tuple[tuple[int, ...], list[float]]:
    """Each rank passes its balanced piece of a (13, 2) tensor along dim 0."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    whole = torch.arange(26.0).reshape(13, 2)
    g = torch.tensor_split(whole, world)[rank].clone().to_global(_world(), split(0))
    return tuple(g.shape), g.to_global(sbp=broadcast).to_local().flatten().tolist()


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_local_shapes_are_gathered_for_the_logical_shape(dist_pool: DistributedPool) -> None:
    """Compared with the (13, 2) tensor the test builds in one process."""
    expected = torch.arange(26.0).flatten().tolist()
    assert dist_pool.run(_uneven_locals) == [((13, 2), expected)] * dist_pool.world_size


_COLLECTIVES = (
    "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_gather",
    "all_reduce", "broadcast", "barrier", "reduce_scatter_tensor", "all_gather_object",
)  # fmt: skip


def _count_collectives(check: Callable[[], Any]) -> list[tuple[str, int]]:
    """The torch.distributed collectives ``check`` entered, with the numel each sent."""
    seen: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def spy(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            sent = args[1] if name.endswith(("_single", "_tensor")) else args[0]
            seen.append((name, sent.numel() if isinstance(sent, torch.Tensor) else -1))
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, spy(name))
    try:
        check()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return seen


def _collectives_of_each_check() -> dict[str, list[tuple[str, int]]]:
    placement = repr(_world())
    boxing = _meta_check.RankMeta(None, torch.float32, (8, 3), placement, "B -> S(0)", False)
    local = _meta_check.RankMeta(None, torch.float32, (4, 3), placement, "S(0)", True)
    return {
        "agree": _count_collectives(lambda: _meta_check.agree(boxing, "to_global (boxing)")),
        "exchange": _count_collectives(
            lambda: _meta_check.exchange(local, "to_global", compare_shapes=False)
        ),
    }


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_each_check_is_small_fixed_size_collectives(dist_pool: DistributedPool) -> None:
    """agree all-reduces [hash, -hash]; exchange does the same (the call agreement), then
    sends the metadata vector to every rank."""
    world = dist_pool.world_size
    width = _meta_check._HEADER + _meta_check.MAX_DIMS
    for seen in dist_pool.run(_collectives_of_each_check):
        assert seen["agree"] == [("all_reduce", 2)], seen
        assert seen["exchange"] == [("all_reduce", 2), ("all_to_all_single", world * width)], seen


def _rank_one_exits() -> str:
    if sbpflow.env.get_rank() == 1:
        os._exit(3)
    torch.ones(2, 2).to_global(sbpflow.placement("cpu", [0, 1]), split(0))
    return "finished"


@pytest.fixture
def long_timeout_pool() -> Iterator[DistributedPool]:
    """A private 2-rank pool (a rank of it dies) whose collectives would wait 120 s."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": "120"}) as pool:
        yield pool


def test_a_rank_that_exits_is_noticed_long_before_the_timeout(
    long_timeout_pool: DistributedPool,
) -> None:
    """gloo sees the closed connection (well under a second here); the timeout is 120 s."""
    outcomes = long_timeout_pool.run_expect_errors(_rank_one_exits, timeout=30.0)
    assert outcomes.elapsed < 15, outcomes.elapsed
    assert_collective_error(
        outcomes[0],
        r"sbpflow: metadata check \(all_reduce\) over ranks \[0, 1\] failed in to_global at "
        r"test_meta_check\.py:\d+, a collective: every rank in it must reach it\. A peer rank "
        r"closed its connection: it exited, crashed \(see its output\) or finished the program "
        r"without making this call",
    )


def _mismatch_without_numpy() -> str:
    """Rank-dependent SBPs with ``Tensor.numpy`` failing as it does where numpy is missing."""
    real = torch.Tensor.numpy

    def unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Numpy is not available")

    torch.Tensor.numpy = unavailable  # type: ignore[method-assign,assignment]
    try:
        sbp = split(0) if sbpflow.env.get_rank() == 0 else sbpflow.sbp.broadcast
        torch.ones(2, 2).to_global(sbpflow.placement("cpu", [0, 1]), sbp)
    except ValueError as error:
        return str(error)
    finally:
        torch.Tensor.numpy = real  # type: ignore[method-assign]
    return "no error"


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_the_mismatch_report_needs_no_numpy(dist_pool: DistributedPool) -> None:
    for message in dist_pool.run(_mismatch_without_numpy):
        assert "ranks disagree in to_global" in message, message
        assert "sbp: rank 0 passed" in message, message
