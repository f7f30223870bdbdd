"""The rank pool itself: results, failures, hangs and crashes on real spawned ranks.

These tests call ``torch.distributed`` directly because they test the
harness, not sbpflow's communication layer. The destructive ones shrink the
shared 2-rank pool's timeout with ``monkeypatch`` and each leaves it dead, so
the next job must start fresh workers.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from sbpflow.testing import DistributedPool, RankFailure, RankTimeout, RemoteError

# -- jobs (module level, so the ranks can import them) ---------------------------


def _rank_info() -> tuple[int, int, str, str, str, str, int]:
    return (
        dist.get_rank(),
        dist.get_world_size(),
        os.environ["RANK"],
        os.environ["LOCAL_RANK"],
        os.environ["LOCAL_WORLD_SIZE"],
        os.environ["OMP_NUM_THREADS"],
        torch.get_num_threads(),
    )


def _all_reduce(scale: float, *, length: int) -> torch.Tensor:
    tensor = torch.arange(length, dtype=torch.float32) * scale * (dist.get_rank() + 1)
    dist.all_reduce(tensor)
    return tensor


def _raise_on_rank_one() -> str:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    return "fine"


def _raise_everywhere() -> None:
    raise ValueError(f"shapes disagree on rank {dist.get_rank()}")


def _sleep_on_rank_one(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def _raise_then_others_wait_in_all_reduce() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 gave up before the all_reduce")
    dist.all_reduce(torch.ones(1))


def _die_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def _pid() -> int:
    return os.getpid()


# -- tests -----------------------------------------------------------------------


@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_results_come_back_in_rank_order(dist_pool: DistributedPool) -> None:
    n = dist_pool.world_size
    expected = [(r, n, str(r), str(r), str(n), "1", 1) for r in range(n)]
    assert dist_pool.run(_rank_info) == expected


@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_all_reduce_sums_over_ranks(dist_pool: DistributedPool) -> None:
    """Compare with a single-process reference: the sum over ranks of each rank's input."""
    n = dist_pool.world_size
    reference = torch.arange(4, dtype=torch.float32) * 0.5 * sum(r + 1 for r in range(n))
    for result in dist_pool.run(_all_reduce, 0.5, length=4):
        torch.testing.assert_close(result, reference)


def test_a_raising_rank_becomes_rank_failure_with_its_traceback(dist_pool: DistributedPool) -> None:
    dist_pool.run(_pid)  # make sure the pool is up before recording its pids
    pids = dist_pool.pids
    with pytest.raises(RankFailure) as info:
        dist_pool.run(_raise_on_rank_one)
    message = str(info.value)
    assert "failed on rank(s) [1]" in message
    assert "ValueError: rank one refuses" in message
    assert "in _raise_on_rank_one" in message  # the remote traceback's frame
    assert isinstance(info.value.failures[1], ValueError)
    # Rank 0 finished and rank 1 raised: nobody is stuck, so the pool lives on.
    assert dist_pool.run(_pid) == pids


def test_run_expect_errors_returns_outcomes_and_elapsed(dist_pool: DistributedPool) -> None:
    outcomes = dist_pool.run_expect_errors(_raise_everywhere, timeout=30)
    outcomes.assert_all_raised(ValueError, match=r"shapes disagree on rank \d", within=30)
    assert [str(e) for e in outcomes] == [f"shapes disagree on rank {r}" for r in range(2)]
    assert 0 < outcomes.elapsed < 30
    mixed = dist_pool.run_expect_errors(_raise_on_rank_one)
    assert mixed[0] == "fine" and isinstance(mixed[1], ValueError)
    with pytest.raises(AssertionError, match="rank 0: expected ValueError, got 'fine'"):
        mixed.assert_all_raised(ValueError)


def test_a_hanging_rank_times_out_and_the_next_run_gets_fresh_workers(
    dist_pool: DistributedPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist_pool, "timeout", 3.0)
    dist_pool.run(_pid)
    pids, starts = dist_pool.pids, dist_pool.num_starts
    begin = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        dist_pool.run(_sleep_on_rank_one, 1000)
    assert time.monotonic() - begin < 3.0 + 5.0  # the timeout, the stack dump and the kill
    assert info.value.stuck_ranks == (1,)
    message = str(info.value)
    assert "rank(s) [1]" in message and "rank(s) [0] finished" in message
    assert "_sleep_on_rank_one" in message  # where rank 1 was stuck, from its stack dump
    assert not dist_pool.alive
    assert dist_pool.run(_sleep_on_rank_one, 0) == [0, 1]
    assert dist_pool.num_starts == starts + 1 and set(dist_pool.pids).isdisjoint(pids)


def test_ranks_stuck_after_another_raised_are_killed_after_the_grace(
    dist_pool: DistributedPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist_pool, "grace", 1.0)
    begin = time.monotonic()
    with pytest.raises(RankFailure) as info:
        dist_pool.run(_raise_then_others_wait_in_all_reduce)
    assert time.monotonic() - begin < 1.0 + 5.0
    assert info.value.stuck_ranks == (1,)
    assert "rank 0 gave up" in str(info.value) and "pool was restarted" in str(info.value)
    assert not dist_pool.alive


def test_a_dead_worker_is_reported_and_replaced(dist_pool: DistributedPool) -> None:
    with pytest.raises(RankFailure) as info:
        dist_pool.run(_die_on_rank_one)
    failure = info.value.failures[1]
    assert isinstance(failure, RemoteError) and failure.type_name == "WorkerDied"
    assert "exit code 3" in str(info.value)
    assert dist_pool.run(_rank_info)[1][0] == 1


def test_run_expect_errors_reports_a_stuck_rank_and_restarts(dist_pool: DistributedPool) -> None:
    outcomes = dist_pool.run_expect_errors(_sleep_on_rank_one, 1000, timeout=2)
    assert outcomes[0] == 0 and outcomes.stuck_ranks == (1,)
    assert isinstance(outcomes[1], RemoteError) and outcomes[1].type_name == "RankTimeout"
    assert 2 <= outcomes.elapsed < 2 + 5
    with pytest.raises(AssertionError, match="rank 1: expected ValueError, got RankTimeout"):
        outcomes.assert_all_raised(ValueError)
    assert not dist_pool.alive
    assert dist_pool.run(_pid)  # and the next job restarts it
