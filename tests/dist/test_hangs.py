"""Hangs that explain themselves: ranks that diverge raise errors naming each rank's call.

Rank 0 alone reads a partial-sum loss (``loss.item()`` under ``if rank == 0``)
while rank 1 goes on to its next sbpflow call. Whatever that call is, both
ranks must raise a ``CollectiveError`` within the collective timeout (10 s
here) instead of hanging or being aborted by gloo, and rank 0's message must
name rank 1's call and the line of this file that made it (NOTE [call
agreement], NOTE [what the ranks were doing]). Nothing is computed here, so
there is no single-process reference: the checks are on the errors. A control
job run in step first shows the same calls succeed when every rank makes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.comm._errors import CollectiveError
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool, RemoteError

TIMEOUT_S = 10
WITHIN_S = 3 * TIMEOUT_S  # the timeout, plus process start and the harness's polling


def _line_of(marker: str) -> str:
    """``test_hangs.py:N`` of the line of this file holding ``marker`` in a comment."""
    lines = Path(__file__).read_text().splitlines()
    (number,) = [i for i, text in enumerate(lines, 1) if f"# {marker}" in text]
    return f"{Path(__file__).name}:{number}"


def _partial_loss() -> sbpflow.GlobalTensor:
    pl = sbpflow.placement("cpu", [0, 1])
    loss = sbpflow.ones(4, 3, placement=pl, sbp=split(0)).sum()
    assert loss.sbp == (sbpflow.sbp.partial_sum,), loss.sbp
    return loss


def in_step() -> float:
    """Both ranks make the calls the diverging jobs make, in the same order."""
    loss = _partial_loss()
    value = loss.item()
    loss.to_global(sbp=broadcast)
    a = sbpflow.ones(4, 3, placement=loss.placement, sbp=split(0))
    torch.mm(a, sbpflow.ones(3, 2, placement=loss.placement, sbp=split(0)))
    return value


def rank_one_goes_on_to_to_global() -> float:
    loss = _partial_loss()
    if sbpflow.env.get_rank() == 0:
        return loss.item()  # rank 0 reads alone
    loss.to_global(sbp=broadcast)  # rank 1 converts
    return 0.0


def ranks_read_at_two_lines() -> float:
    loss = _partial_loss()
    if sbpflow.env.get_rank() == 0:
        return loss.item()  # rank 0 reads the loss
    return (loss * 2).item()  # rank 1 reads another tensor of the same shape


def rank_one_goes_on_to_an_op() -> float:
    loss = _partial_loss()
    a = sbpflow.ones(4, 3, placement=loss.placement, sbp=split(0))
    b = sbpflow.ones(3, 2, placement=loss.placement, sbp=split(0))
    if sbpflow.env.get_rank() == 0:
        return loss.item()  # rank 0 reads, rank 1 is busy elsewhere
    torch.mm(a, b)  # rank 1 boxes b to broadcast
    return 0.0


@pytest.fixture(scope="module")
def pool() -> Iterator[DistributedPool]:
    """A private 2-rank pool whose collectives time out after 10 s."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": str(TIMEOUT_S)}) as pool:
        yield pool


def _errors_of(pool: DistributedPool, job: Callable[[], Any]) -> list[str]:
    outcomes = pool.run_expect_errors(job, timeout=WITHIN_S)
    assert outcomes.elapsed < WITHIN_S, outcomes.elapsed
    messages = []
    for rank, error in enumerate(outcomes):
        if isinstance(error, RemoteError):
            assert error.type_name == "CollectiveError", (rank, error)
        else:
            assert isinstance(error, CollectiveError), (rank, error)
        messages.append(str(error))
    return messages


def test_rank_zero_reading_alone_names_rank_one_call_at_once(pool: DistributedPool) -> None:
    """Both ranks in user-level calls: the call agreement fails at once, on both ranks."""
    assert pool.run(in_step) == [12.0, 12.0]
    zero, one = _errors_of(pool, rank_one_goes_on_to_to_global)
    reads, converts = _line_of("rank 0 reads alone"), _line_of("rank 1 converts")
    assert f"rank 1 was in to_global (boxing) at {converts} while rank 0 waited in item() " in zero
    assert f"at {reads}" in zero
    assert "reading a partial global tensor (item()) is a collective: call it on every rank" in zero
    # A partial tensor's piece is not its value: the hint never offers to_local() as the value.
    assert "sbpflow.env.print0" in zero and "to_local() is only this rank's part of the sum" in zero
    assert f"rank 0 was in item() at {reads} while rank 1 waited in to_global" in one
    assert pool.run(in_step) == [12.0, 12.0]  # the ranks are still in step


def test_two_ranks_reading_different_tensors_raise(pool: DistributedPool) -> None:
    """Same call, same metadata, different lines: an error, not a mix of the two tensors."""
    zero, one = _errors_of(pool, ranks_read_at_two_lines)
    first, second = _line_of("rank 0 reads the loss"), _line_of("rank 1 reads another tensor")
    assert f"rank 1 was in item() at {second} while rank 0 waited in item() at {first}" in zero
    assert f"rank 0 was in item() at {first} while rank 1 waited in item() at {second}" in one


def test_a_rank_busy_in_an_op_is_named_at_the_timeout(pool: DistributedPool) -> None:
    """Rank 1 boxes an op's input on another group: both wait, and both fail at the timeout
    with the other's call read from the store. (Last: the timed-out groups are unusable.)"""
    zero, one = _errors_of(pool, rank_one_goes_on_to_an_op)
    reads, boxes = _line_of("rank 0 reads, rank 1 is busy elsewhere"), _line_of("rank 1 boxes b")
    assert f"timed out after the collective timeout ({TIMEOUT_S} s)" in zero
    assert f"failed in item() at {reads}, a collective: every rank in it must reach it" in zero
    assert re.search(
        rf"Rank 1 was last in aten\.mm\.default \(boxing its inputs\) at {boxes}\.", zero
    ), zero
    assert f"failed in aten.mm.default (boxing its inputs) at {boxes}, a collective" in one
    assert f"Rank 0 was last in item() at {reads}" in one, one
