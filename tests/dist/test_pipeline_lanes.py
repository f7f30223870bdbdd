"""The lanes of a pipelined step are made before its first action (NOTE [lanes] in
sbpflow/nn/pipeline/runtime/_transfers.py), not by the first transfer in the middle of it.

On 2 ranks, the 2-stage model of test_pipeline_early_receives through ``sbpflow.nn.Graph``
with 1F1B: no compute action of the first step (nor of the next) makes a process group, the
step's transfers run on the two lanes of the stages' pair of placements, and training
equals plain torch on one process.

On 4 ranks, stages whose transfers are not between stages next to each other: eight stages
laid out as a V (ZBV: stages s and 7 - s on rank s) or four stages one per rank (1F1B, stage
s on rank 3 - s), with a skip connection from stage 0's output into stage 2 (rank 0 to rank 2,
or 3 to 1), and the input on every rank (stage 0's hook moves it from a placement no stage is
on). No process group is
made between the lanes being set up and the end of either step, and the losses and final
weights equal plain torch's training of the same model on one process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.comm import _groups, _p2p
from sbpflow.nn.pipeline.runtime import _step
from sbpflow.testing import get_pool

from .test_pipeline_early_receives import (
    _M,
    _TOL,
    B,
    TrainGraph,
    _batches,
    _reference,
    _staged_model,
)


def lanes_job() -> dict[str, Any]:
    """Two steps; per compute action, how many groups it made; the transfer groups made."""
    model, placements = _staged_model()
    both = sbpflow.placement("cpu", [0, 1])
    graph = TrainGraph(model, placements, "1f1b")
    made: list[int] = []
    original = _step.run_action

    def counted(*args: Any) -> None:
        before = _groups._created[0]
        original(*args)
        made.append(_groups._created[0] - before)

    _step.run_action = counted  # type: ignore[assignment]
    try:
        losses = []
        for x, y in _batches(steps=2):
            loss = graph(x.to_global(placements[0], B), y.to_global(placements[1], B))
            losses.append(loss.to_global(both, B).to_local().item())
    finally:
        _step.run_action = original  # type: ignore[assignment]
    tags = sorted(repr(tag) for (_, members, tag) in _p2p._ready if members == (0, 1))
    ref_losses, _ = _reference(steps=2)
    return {"made": made, "tags": tags, "losses": losses, "ref_losses": ref_losses}


def test_the_lanes_are_made_before_the_first_action() -> None:
    for rank, got in enumerate(get_pool(2).run(lanes_job)):
        assert len(got["made"]) == 2 * 2 * _M, (rank, got["made"])  # F and B, 2 steps
        assert not any(got["made"]), (rank, got["made"])
        pair = (sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1]))
        assert {repr((pair, 0)), repr((pair, 1))} <= set(got["tags"]), (rank, got["tags"])
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=_TOL, rel=_TOL), rank


class _Join(nn.Module):
    """A stage taking the previous stage's output and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x + skip))


class _Skip(nn.Module):
    """Stages of linears with tanh; stage 2 also takes stage 0's output."""

    def __init__(self, num_stages: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            _Join() if s == 2 else nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            for s in range(num_stages)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.stages[0](x)
        x = self.stages[1](first)
        x = self.stages[2](x, first)
        for stage in self.stages[3:]:
            x = stage(x)
        return x


class _SkipGraph(sbpflow.nn.Graph):
    def __init__(self, model: _Skip, placements: list[Any], schedule: str) -> None:
        super().__init__()
        self.model = model
        for s, placement in enumerate(placements):
            self.model.stages[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


# Each case's skip connection crosses a pair of ranks the other's lanes do not join
# (the pool's processes keep their groups from one test to the next).
_RANKS = {"zbv": [0, 1, 2, 3, 3, 2, 1, 0], "1f1b": [3, 2, 1, 0]}


def skip_job(schedule: str) -> dict[str, Any]:
    """Two steps with a skip connection; the groups made in each step after its lanes were
    set up, the losses and weights, and plain torch's."""
    ranks = _RANKS[schedule]
    placements = [sbpflow.placement("cpu", [r]) for r in ranks]
    everyone = sbpflow.placement("cpu", [0, 1, 2, 3])
    torch.manual_seed(0)
    reference = _Skip(len(ranks))
    model = copy.deepcopy(reference)
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, B)
    graph = _SkipGraph(model, placements, schedule)
    made = [0]
    set_up: list[int] = []
    original_new_group, original_make_lanes = dist.new_group, _step.make_lanes

    def new_group(*args: Any, **kwargs: Any) -> Any:
        made[0] += 1
        return original_new_group(*args, **kwargs)

    def make_lanes(*args: Any, **kwargs: Any) -> None:
        original_make_lanes(*args, **kwargs)
        set_up.append(made[0])

    dist.new_group, _step.make_lanes = new_group, make_lanes  # type: ignore[assignment]
    losses, after = [], []
    try:
        for x, y in _batches(steps=2):
            # x on every rank: stage 0's hook moves it from a placement no stage is on
            loss = graph(x.to_global(everyone, B), y.to_global(placements[-1], B))
            after.append(made[0])
            losses.append(loss.to_global(everyone, B).to_local().item())
    finally:
        dist.new_group, _step.make_lanes = original_new_group, original_make_lanes  # type: ignore[assignment]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for x, y in _batches(steps=2):
        total = 0.0
        for xm, ym in zip(x.chunk(_M), y.chunk(_M), strict=True):
            loss = F.mse_loss(reference(xm), ym)
            (loss / _M).backward()
            total += loss.item() / _M
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)
    errors = [
        (p.detach().to_global(everyone, B).to_local() - r.detach()).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    return {
        "in_step": [a - s for s, a in zip(set_up, after, strict=True)],
        "losses": losses,
        "ref_losses": ref_losses,
        "errors": errors,
    }


@pytest.mark.parametrize("schedule", ["zbv", "1f1b"])
def test_transfers_between_stages_not_next_to_each_other_make_no_group_in_a_step(
    schedule: str,
) -> None:
    for rank, got in enumerate(get_pool(4).run(skip_job, schedule)):
        assert got["in_step"] == [0, 0], (rank, got["in_step"])
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=_TOL, rel=_TOL), rank
        assert max(got["errors"]) < _TOL, (rank, got["errors"])
