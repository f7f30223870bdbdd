"""Stage-local execution: a rank runs only the stages it holds (NOTE [stages held elsewhere]).

On 2 ranks, a 4-stage model through ``sbpflow.nn.Graph``:

- each stage's layers count their calls on each rank: after the first call of a stage with
  inputs of a kind (which runs everywhere, its ops skipped on empty pieces, to learn the
  stage's outputs), a rank never calls the layers of a stage it does not hold;
- with dropout in every stage and between stages, the pipelined step draws exactly what the
  same graph without stages draws on one placement (the logical program: NOTE [micro-batch
  random streams] in sbpflow/_rng.py), whatever the schedule: equal losses and parameters
  within 1e-5;
- mistakes are errors or warnings on every rank, never silent: a build that records no
  backward, or runs it itself (``torch.autograd.backward(loss)``), raises naming
  ``loss.backward()``; parameters on several placements without ``set_stage`` warn once.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast
from sbpflow.testing import get_pool

B = Broadcast()
_M, _TOL = 4, 1e-5
_LAYOUTS = {  # the rank of each stage
    "gpipe": [0, 1],
    "1f1b": [0, 1],
    "zero_bubble": [0, 1, 0, 1],
    "interleaved_1f1b": [0, 1, 0, 1],
    "zbv": [0, 1, 1, 0],
}


class Counted(nn.Module):
    """A linear and tanh (and dropout) that counts its calls on this rank."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.dropout(torch.tanh(self.linear(x)))


class Chain(nn.Module):
    """``num_stages`` stages; ``handoffs``: move the activation onto each stage's placement."""

    def __init__(
        self, num_stages: int, dropout: float = 0.0, handoffs: list[Any] | None = None
    ) -> None:
        super().__init__()
        self.stages = nn.ModuleList(Counted(dropout) for _ in range(num_stages))
        self.between = dropout
        self.handoffs = handoffs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s, stage in enumerate(self.stages):
            if self.handoffs is not None:
                x = x.to_global(self.handoffs[s], B)
            x = F.dropout(stage(x), self.between)  # outside the stages too
        return x


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: Chain, placements: list[Any] | None, schedule: str) -> None:
        super().__init__()
        self.model = model
        for s, placement in enumerate(placements or []):
            self.model.stages[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(steps)
    ]


def calls_job(schedule: str) -> dict[str, Any]:
    """Three steps; each stage's layer calls on this rank, per step."""
    placements = [sbpflow.placement("cpu", [r]) for r in _LAYOUTS[schedule]]
    torch.manual_seed(0)
    model = Chain(len(placements))
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, B)
    graph = TrainGraph(model, placements, schedule)
    calls = []
    for x, y in _batches(3):
        for stage in model.stages:
            stage.calls = 0
        graph(x.to_global(placements[0], B), y.to_global(placements[-1], B))
        calls.append([stage.calls for stage in model.stages])
    rank = sbpflow.env.get_rank()
    return {"calls": calls, "held": [rank in p for p in placements]}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_a_rank_never_runs_the_stages_it_does_not_hold(schedule: str) -> None:
    """Step 1 calls every stage once on every rank (the first call learns a stage's outputs;
    its ops are skipped on empty pieces), then the held stages once per micro-batch; steps 2
    and 3 call the held stages once per micro-batch and the others never."""
    for rank, got in enumerate(get_pool(2).run(calls_job, schedule)):
        first, *later = got["calls"]
        for s, held in enumerate(got["held"]):
            assert first[s] == (_M if held else 1), (rank, s, got)
            for step in later:
                assert step[s] == (_M if held else 0), (rank, s, got)


def dropout_job(schedule: str) -> dict[str, Any]:
    """Train 2 steps with dropout through a staged graph and through the same graph without
    stages (every parameter on both ranks, broadcast); return both runs' losses and weights."""
    both = sbpflow.placement("cpu", [0, 1])
    placements = [sbpflow.placement("cpu", [r]) for r in _LAYOUTS[schedule]]
    torch.manual_seed(0)
    staged = Chain(len(placements), dropout=0.25)
    plain = copy.deepcopy(staged).to_global(both, B)
    for stage, placement in zip(staged.stages, placements, strict=True):
        stage.to_global(placement, B)
    runs = {}
    for name, model, where in [("staged", staged, placements), ("plain", plain, None)]:
        sbpflow.manual_seed(7)
        graph = TrainGraph(model, where, schedule)
        x_at = placements[0] if where else both
        y_at = placements[-1] if where else both
        losses = [
            graph(x.to_global(x_at, B), y.to_global(y_at, B)).to_global(both, B).to_local().item()
            for x, y in _batches(2)
        ]
        weights = [p.detach().to_global(both, B).to_local() for p in model.parameters()]
        runs[name] = (losses, weights)
    return runs


@pytest.mark.parametrize("schedule", list(_LAYOUTS))
def test_dropout_follows_the_logical_program(schedule: str) -> None:
    """The staged step's dropout masks are those of the same graph without stages (the
    losses would differ by far more than 1e-5 with any other mask), whatever the order the
    schedule runs the micro-batches in."""
    for rank, runs in enumerate(get_pool(2).run(dropout_job, schedule)):
        (staged, staged_w), (plain, plain_w) = runs["staged"], runs["plain"]
        assert staged == pytest.approx(plain, abs=_TOL, rel=_TOL), (rank, staged, plain)
        for a, b in zip(staged_w, plain_w, strict=True):
            assert (a - b).abs().max().item() <= _TOL, rank


# -- mistakes: an error or a warning on every rank, never silent ----------------------------


class NoBackward(TrainGraph):
    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), y)


class AutogradBackward(TrainGraph):
    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        torch.autograd.backward(loss)
        return loss


def mistake_job(kind: str) -> None:
    placements = [sbpflow.placement("cpu", [r]) for r in (0, 1)]
    torch.manual_seed(0)
    model = Chain(2)
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, B)
    graph = {"no backward": NoBackward, "autograd backward": AutogradBackward}[kind](
        model, placements, "1f1b"
    )
    x, y = _batches(1)[0]
    graph(x.to_global(placements[0], B), y.to_global(placements[-1], B))


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("no backward", r"build did not call backward on micro-batch 0.*Call loss\.backward\(\)"),
        (
            "autograd backward",
            r"build ran a backward pass while the pipelined step ran its forward.*"
            r"torch\.autograd\.backward\(loss\).*Call loss\.backward\(\) in build",
        ),
    ],
)
def test_a_build_without_a_recorded_backward_is_an_error_on_every_rank(
    kind: str, message: str
) -> None:
    outcomes = get_pool(2).run_expect_errors(mistake_job, kind, timeout=60)
    outcomes.assert_all_raised(ValueError, match=message, within=30)


def unstaged_job() -> list[str]:
    """A model on two placements trained without set_stage: the warnings of two calls."""
    placements = [sbpflow.placement("cpu", [r]) for r in (0, 0, 1, 1)]
    torch.manual_seed(0)
    model = Chain(4, handoffs=placements)
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, B)
    graph = TrainGraph(model, None, "1f1b")
    x, y = _batches(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            graph(x.to_global(placements[0], B), y.to_global(placements[-1], B))
    return [str(w.message) for w in caught if "set_stage" in str(w.message)]


def test_parameters_on_several_placements_without_stages_warn_once() -> None:
    for rank, messages in enumerate(get_pool(2).run(unstaged_job)):
        assert len(messages) == 1, (rank, messages)
        assert "parameters sit on 2 placements" in messages[0], messages
        assert "config.set_stage(stage_id, placement)" in messages[0], messages
