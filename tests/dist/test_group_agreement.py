"""Ranks that would create different groups at the same point raise on every rank
(NOTE [group agreement] in sbpflow/comm/_groups.py), instead of hanging in torch's group
rendezvous or connecting to another group's ranks.

On 4 ranks: two 2-stage pipelines (ranks 0-1 and ranks 2-3), each called only on its own
ranks, raise on all 4 ranks at their first transfer, naming both groups; a global op that
one rank skips raises on the other ranks within the collective timeout, naming that rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.comm._errors import CollectiveError
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool, RemoteError

TIMEOUT_S = 5
WITHIN_S = 6 * TIMEOUT_S  # the timeout, plus process start and the harness's polling


class TwoStages(sbpflow.nn.Graph):
    def __init__(self, ranks: tuple[int, int]) -> None:
        super().__init__()
        self.placements = [sbpflow.placement("cpu", [r]) for r in ranks]
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for s, placement in enumerate(self.placements):
            self.model[s].to_global(placement, broadcast)
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(2)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def own_pipelines_only() -> Any:
    """Every rank builds both pipelines; ranks 0-1 call the one on ranks 0-1 and ranks 2-3
    the one on ranks 2-3 (their first transfers would make their first groups)."""
    graphs = [TwoStages((0, 1)), TwoStages((2, 3))]
    batches = [
        (
            torch.ones(4, 4).to_global(g.placements[0], broadcast),
            torch.zeros(4, 4).to_global(g.placements[1], broadcast),
        )
        for g in graphs
    ]
    mine = 0 if sbpflow.env.get_rank() < 2 else 1
    return graphs[mine](*batches[mine])


def rank_three_skips() -> Any:
    """Ranks 0-2 gather a tensor split over them; rank 3 goes on without."""
    if sbpflow.env.get_rank() == 3:
        return "skipped"
    placement = sbpflow.placement("cpu", [0, 1, 2])
    t = sbpflow.ones(6, placement=placement, sbp=split(0))
    return t.to_global(placement, broadcast).to_local().sum().item()  # rank 3 skips this


@pytest.fixture(scope="module")
def pool() -> Iterator[DistributedPool]:
    """A pool of its own: a failed group creation leaves groups other jobs must not meet."""
    with DistributedPool(4, timeout=60.0, env={"SBPFLOW_TIMEOUT": str(TIMEOUT_S)}) as pool:
        yield pool


def _message(error: Any) -> str:
    if isinstance(error, RemoteError):
        assert error.type_name == "CollectiveError", error
    else:
        assert isinstance(error, CollectiveError), error
    return str(error)


def test_pipelines_called_on_their_own_ranks_raise_on_every_rank(pool: DistributedPool) -> None:
    outcomes = pool.run_expect_errors(own_pipelines_only, timeout=WITHIN_S)
    assert outcomes.elapsed < WITHIN_S, outcomes.elapsed
    for rank, error in enumerate(outcomes):
        message = _message(error)
        assert "the ranks create different groups at the same point" in message, (rank, message)
        assert "rank 0 creates a gloo group of ranks [0, 1]" in message, (rank, message)
        assert "rank 2 creates a gloo group of ranks [2, 3]" in message, (rank, message)
        assert "test_group_agreement.py" in message, (rank, message)


def test_a_rank_that_skips_a_global_op_is_named(pool: DistributedPool) -> None:
    outcomes = pool.run_expect_errors(rank_three_skips, timeout=WITHIN_S)
    assert outcomes.elapsed < WITHIN_S, outcomes.elapsed
    *gathering, skipping = list(outcomes)
    assert skipping == "skipped"
    for rank, error in enumerate(gathering):
        message = _message(error)
        assert "creates a gloo group of ranks [0, 1, 2]" in message, (rank, message)
        assert "rank(s) [3] created no group" in message, (rank, message)
