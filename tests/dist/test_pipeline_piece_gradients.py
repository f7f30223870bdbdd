"""Gradients of the parameters of a stage that runs on its pieces (NOTE [parameter pieces are
leaves] in sbpflow/nn/pipeline/runtime/_held_here.py).

2 stages on 2 gloo ranks through ``sbpflow.nn.Graph``, 4 micro-batches, against the same
model trained in this process with the same accumulation:

- each weight's gradient is in the parameter's ``.grad`` as soon as the stage's backward
  has computed it: a probe at the last stage's input sees every parameter of the stage with
  a gradient in the first micro-batch's backward (as in plain torch, where AccumulateGrad
  runs as soon as its gradient is ready);
- ``loss.backward(inputs=...)`` naming some parameters of the last stage, of the first
  stage (held by the other rank: NOTE [backward into some inputs] in
  sbpflow/nn/pipeline/runtime/_passes.py), or of both trains exactly those, as the
  single-process ``backward(inputs=...)`` does, with 2 stages and with 4 stages interleaved
  on the 2 ranks;
- a gradient hook a user put on a parameter runs, as in the single process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast
from sbpflow.testing import get_pool

B = Broadcast()
_M, _TOL, _STEPS = 4, 1e-5, 2


class _SeenAtInput(torch.autograd.Function):
    """Identity; in backward, notes which of ``stage.watched`` have a ``.grad`` by then."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stage: ProbedStage) -> torch.Tensor:
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.stage.seen.append([p.grad is not None for p in ctx.stage.watched])
        return grad, None


class ProbedStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.watched: list[torch.Tensor] = []  # the global parameters, set after to_global
        self.seen: list[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x = _SeenAtInput.apply(x, self)
        return self.layers(x)


class Chain(nn.Module):
    """Two probed stages; ``tied``: the output times the first stage's first weight again."""

    def __init__(self, tied: bool = False, num_stages: int = 2) -> None:
        super().__init__()
        self.stages = nn.ModuleList([ProbedStage() for _ in range(num_stages)])
        self.tied = tied
        self.tied_to: sbpflow.Placement | None = None  # the last stage's, once global

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        if self.tied:
            w = self.stages[0].layers[0].weight
            x = x @ (w if self.tied_to is None else w.to_global(self.tied_to, B))
        return x


# What ``backward(inputs=...)`` names in each case: the first linear of these stages.
# "tied": the first stage's first weight is used again by the last stage.
NAMED_STAGES = {
    "inputs": (1,),
    "inputs first stage": (0,),
    "inputs both stages": (0, 1),
    "inputs, tied": (1,),
    "inputs first stage, tied": (0,),
}


def _inputs(model: Chain, case: str) -> list[torch.Tensor] | None:
    """The parameters ``backward(inputs=...)`` names in ``case`` (None: no ``inputs``)."""
    if case not in NAMED_STAGES:
        return None
    last = len(model.stages) - 1  # the "last" stage named as 1 is the model's last
    stages = [last if s == 1 else s for s in NAMED_STAGES[case]]
    return [p for s in stages for p in model.stages[s].layers[0].parameters()]


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: Chain, placements: list[Any], case: str, schedule: str) -> None:
        super().__init__()
        self.model = model
        self.case = case
        for s, placement in enumerate(placements):
            self.model.stages[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward(inputs=_inputs(self.model.origin, self.case))
        return loss


def _double(grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(_STEPS)
    ]


def _reference(model: Chain, case: str) -> list[torch.Tensor]:
    """The same training in this process: micro-batch gradients summed, divided by _M."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        for xm, ym in zip(x.chunk(_M), y.chunk(_M), strict=True):
            F.mse_loss(model(xm), ym).backward(inputs=_inputs(model, case))
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= _M
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


# The 2-stage 1F1B pipeline of every case, and 4 stages on the 2 ranks (0, 1, 0, 1) with
# interleaved 1F1B, where each rank runs its micro-batches on worker threads.
LAYOUTS = {"2 stages": ((0, 1), "1f1b"), "4 stages interleaved": ((0, 1, 0, 1), "interleaved_1f1b")}


def train_job(case: str, layout: str = "2 stages") -> dict[str, Any]:
    """Train ``_STEPS`` steps; the parameters (gathered) against the reference's, and what the
    probe at the last stage's input saw in the first micro-batch's backward."""
    ranks, schedule = LAYOUTS[layout]
    placements = [sbpflow.placement("cpu", [r]) for r in ranks]
    everyone = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = Chain(tied="tied" in case, num_stages=len(ranks))
    reference = copy.deepcopy(model)
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, B)
        stage.watched = list(stage.parameters())
    if model.tied:
        model.tied_to = placements[-1]
    if case == "hook":
        for m in (model, reference):
            for stage in m.stages:
                stage.layers[0].weight.register_hook(_double)
    graph = TrainGraph(model, placements, case, schedule)
    for x, y in _batches():
        graph(x.to_global(placements[0], B), y.to_global(placements[-1], B))
    want = _reference(reference, case)
    errors = [
        (p.detach().to_global(everyone, B).to_local() - r).abs().max().item()
        for p, r in zip(model.parameters(), want, strict=True)
    ]
    moved = [
        (p.detach().to_global(everyone, B).to_local() - r).abs().max().item()
        for p, r in zip(model.parameters(), _initial_parameters(len(ranks)), strict=True)
    ]
    return {"errors": errors, "moved": moved, "seen": model.stages[-1].seen}


def _initial_parameters(num_stages: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach() for p in Chain(num_stages=num_stages).parameters()]


@pytest.mark.parametrize(
    ("case", "layout"),
    [
        *((case, "2 stages") for case in ("all", "hook", *NAMED_STAGES)),
        *((case, "4 stages interleaved") for case in ("all", *NAMED_STAGES)),
    ],
)
def test_piece_gradients_train_like_one_process(case: str, layout: str) -> None:
    """Parameters equal the single-process reference within 1e-5 after 2 steps; with
    ``backward(inputs=...)`` exactly the named parameters moved."""
    model = Chain(num_stages=len(LAYOUTS[layout][0]))
    named = {id(p) for p in _inputs(model, case) or ()}
    trained = [id(p) in named for p in model.parameters()]
    for rank, got in enumerate(get_pool(2).run(train_job, case, layout)):
        assert max(got["errors"]) <= _TOL, (case, layout, rank, got["errors"])
        if named:
            assert [m > 0 for m in got["moved"]] == trained, (layout, rank, got["moved"])
        else:
            assert all(m > 0 for m in got["moved"]), (case, layout, rank, got["moved"])


def test_weight_gradients_reach_grad_as_soon_as_computed() -> None:
    """On the rank holding the last stage, the probe at the stage's input runs after every
    layer's backward of micro-batch 0: each parameter of the stage already has its ``.grad``,
    as in plain torch (the first micro-batch of each step starts with no gradients)."""
    got = get_pool(2).run(train_job, "all")[1]
    first_of_each_step = got["seen"][::_M]
    assert len(got["seen"]) == _STEPS * _M, got["seen"]
    for seen in first_of_each_step:
        assert seen and all(seen), got["seen"]
