"""Ranks that would create different groups at the same point raise (NOTE [group agreement]
in sbpflow/comm/_groups.py), instead of meeting in torch's group rendezvous with the wrong
peers or waiting there until gloo's connect timeout.

On 4 ranks:
- two 2-stage pipelines (ranks 0-1 and ranks 2-3), built on every rank but each called only on
  its own ranks: the ranks of at least one pipeline raise where their first step makes its
  lanes, naming both groups, and a rank that does not raise has computed its pipeline's loss
  exactly;
- a ZBV pipeline of 8 stages (two per rank, in a V), whose ranks make the lanes between its
  consecutive stages when its step starts (mostly groups of two other ranks, which the ranks
  reach at different times), trains as plain torch does: the check never waits for a rank
  outside the group it makes;
- a group ranks 0-2 make and rank 3 skips: rank 3 raises at once at the next group every rank
  makes; ranks 0-2 raise naming rank 3, at once if rank 3's entry is there when they compare,
  else when its members' wait times out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.comm import _groups
from sbpflow.comm._errors import CollectiveError
from sbpflow.sbp import broadcast
from sbpflow.testing import DistributedPool, RemoteError, get_pool

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
    the one on ranks 2-3 (their first steps would make their first groups). Returns
    the loss on the rank holding the last stage."""
    graphs = [TwoStages((0, 1)), TwoStages((2, 3))]
    batches = [
        (
            torch.ones(4, 4).to_global(g.placements[0], broadcast),
            torch.zeros(4, 4).to_global(g.placements[1], broadcast),
        )
        for g in graphs
    ]
    rank = sbpflow.env.get_rank()
    mine = 0 if rank < 2 else 1
    loss = graphs[mine](*batches[mine])
    return loss.to_local().item() if rank in graphs[mine].placements[1] else None


def _expected_loss() -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return F.mse_loss(model(torch.ones(4, 4)), torch.zeros(4, 4)).item()


_V = [0, 1, 2, 3, 3, 2, 1, 0]  # the rank of each stage in a V


class VShaped(sbpflow.nn.Graph):
    """8 stages of Linear(4, 4) and tanh in a V over 4 ranks (ZBV); SGD."""

    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        self.model = model
        for s, stage in enumerate(model):
            placement = sbpflow.placement("cpu", [_V[s]])
            stage.to_global(placement, broadcast)
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(4)
        self.config.set_pipeline_schedule("zbv")
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _stages() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(8)))


def _steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(2)]


def v_shaped_losses() -> list[float]:
    graph = VShaped(_stages())
    first, last = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [0])
    every = sbpflow.placement("cpu", [0, 1, 2, 3])
    return [
        graph(x.to_global(first, broadcast), y.to_global(last, broadcast))
        .to_global(every, broadcast)
        .to_local()
        .item()
        for x, y in _steps()
    ]


def _plain_losses() -> list[float]:
    model = _stages()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _steps():
        total = 0.0
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = F.mse_loss(model(xm), ym)
            (loss / 4).backward()
            total += loss.item() / 4
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def rank_three_skips() -> Any:
    """Ranks 0-2 make a group of ranks 0-2 that rank 3 skips (a tag of its own, so that it is
    new); then every rank makes a group of all four."""
    rank = sbpflow.env.get_rank()
    if rank != 3:
        _groups.group_of("cpu", [(0, 1, 2)], rank, tag="made by ranks 0-2")
    _groups.group_of("cpu", [(0, 1, 2, 3)], rank, tag="made by every rank")
    return "made"


@pytest.fixture
def pool() -> Iterator[DistributedPool]:
    """A pool of its own per test: a failed group creation leaves the ranks' group counts apart."""
    with DistributedPool(4, timeout=60.0, env={"SBPFLOW_TIMEOUT": str(TIMEOUT_S)}) as pool:
        yield pool


def _message(error: Any) -> str:
    if isinstance(error, RemoteError):
        assert error.type_name == "CollectiveError", error
    else:
        assert isinstance(error, CollectiveError), error
    return str(error)


def test_pipelines_called_on_their_own_ranks_raise(pool: DistributedPool) -> None:
    outcomes = list(pool.run_expect_errors(own_pipelines_only, timeout=WITHIN_S))
    raised = [
        rank
        for rank, got in enumerate(outcomes)
        if isinstance(got, BaseException)
        and "the ranks create different groups at the same point" in _message(got)
    ]
    assert {0, 1} <= set(raised) or {2, 3} <= set(raised), outcomes
    for rank in raised:
        message = str(outcomes[rank])
        assert "creates a gloo group of ranks [0, 1]" in message, (rank, message)
        assert "creates a gloo group of ranks [2, 3]" in message, (rank, message)
        assert "test_group_agreement.py" in message, (rank, message)
    for rank, got in enumerate(outcomes):
        if not isinstance(got, BaseException) and got is not None:
            assert got == pytest.approx(_expected_loss(), abs=1e-6), (rank, outcomes)


def test_a_pipeline_whose_ranks_make_its_groups_at_different_times_trains() -> None:
    """On the shared pool: nothing fails here, so nothing is left for the next job."""
    for rank, losses in enumerate(get_pool(4).run(v_shaped_losses)):
        assert losses == pytest.approx(_plain_losses(), abs=1e-5, rel=1e-5), rank


def test_a_rank_that_skipped_a_group_is_named(pool: DistributedPool) -> None:
    outcomes = pool.run_expect_errors(rank_three_skips, timeout=WITHIN_S)
    assert outcomes.elapsed < WITHIN_S, outcomes.elapsed
    *others, skipped = list(outcomes)
    message = _message(skipped)
    assert "the ranks create different groups at the same point" in message, message
    assert "rank 3 creates a gloo group of ranks [0, 1, 2, 3]" in message, message
    assert "rank 0 creates a gloo group of ranks [0, 1, 2] (a group of its own" in message, message
    for rank, error in enumerate(others):
        # Rank 3 made its entry before or after this rank compared: named either way.
        message = _message(error)
        assert (
            "rank 3 creates a gloo group of ranks [0, 1, 2, 3]" in message
            or "rank(s) [3] created no group" in message
        ), (rank, message)


def rank_zero_compares_late() -> Any:
    """``rank_three_skips`` with the race made certain: ranks 1 and 2 compare before rank 3
    publishes its group and go on to the group's rendezvous; rank 0 compares after, sees rank
    3's group, raises, and never joins that rendezvous."""
    rank = sbpflow.env.get_rank()
    if rank == 0:
        compare = _groups._check_same

        def late(n: int, group: str) -> None:
            time.sleep(2.0)
            compare(n, group)

        _groups._check_same = late  # type: ignore[assignment]
    if rank == 3:
        time.sleep(1.0)
        _groups.group_of("cpu", [(0, 1, 2, 3)], rank, tag="made by every rank")
    else:
        _groups.group_of("cpu", [(0, 1, 2)], rank, tag="made by ranks 0-2")
    return "made"


def test_members_left_waiting_in_a_rendezvous_name_the_disagreement(pool: DistributedPool) -> None:
    """The members that went on to the group's rendezvous raise the same named error as the
    rank that compared later, not torch's store timeout."""
    outcomes = pool.run_expect_errors(rank_zero_compares_late, timeout=WITHIN_S)
    for rank, error in enumerate(outcomes):
        message = _message(error)
        assert "rank 3 creates a gloo group of ranks [0, 1, 2, 3]" in message, (rank, message)
