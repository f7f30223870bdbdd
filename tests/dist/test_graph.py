"""``sbpflow.nn.Graph`` on 2 ranks against single-process training on the whole batch.

A two-stage model (stage 0 on rank 0, stage 1 on rank 1) and a data-parallel one
(parameters broadcast, batch split on dim 0) train for 3 steps through a graph with
gradient accumulation, SGD with momentum and a learning-rate scheduler. The loss is a
mean, so the graph's step (the mean of the micro-batch gradients) must equal one
full-batch step: every rank also trains a plain copy on the whole batch in one process
(the single-process reference), and the returned losses and final parameters must agree
within 1e-5. Mistakes (a stage's parameters on another placement, stage ids that skip or
repeat, a batch the micro-batch count does not divide) must be errors on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

B, S0 = Broadcast(), Split(0)
_STEPS, _TOL = 3, 1e-5


class TwoStages(nn.Module):
    def __init__(self, handoff: sbpflow.Placement | None) -> None:
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.stage1 = nn.Linear(16, 3)
        self.handoff = handoff  # None: the graph moves stage 1's input (set_stage's placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage0(x)
        if self.handoff is not None:
            h = h.to_global(self.handoff, B)
        return self.stage1(h)


class TrainGraph(sbpflow.nn.Graph):
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, stages: list[Any], steps: int
    ) -> None:
        super().__init__()
        self.model = model
        for stage_id, (name, placement) in enumerate(stages):
            getattr(self.model, name).config.set_stage(stage_id=stage_id, placement=placement)
        self.config.set_gradient_accumulation_steps(steps)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        self.add_optimizer(optimizer, lr_sch=scheduler)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _batches(batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch_size, 6, generator=gen), torch.randn(batch_size, 3, generator=gen))
        for _ in range(_STEPS)
    ]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def _reference(model: nn.Module) -> list[float]:
    """Plain full-batch training in this process, stepping the same scheduler once per step."""
    opt = _optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def graph_job(layout: str) -> dict[str, Any]:
    """Train through a graph laid out as ``layout``; return what the test compares."""
    p0, p1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    both = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    reference = TwoStages(None)
    model = copy.deepcopy(reference)
    if layout == "data parallel":
        model.to_global(both, B)
        stages: list[Any] = []
        x_layout, y_layout = (both, S0), (both, S0)
    else:
        model.handoff = p1 if layout == "explicit handoff" else None
        model.stage0.to_global(p0, B)
        model.stage1.to_global(p1, B)
        stages = [("stage0", p0), ("stage1", p1)]
        x_layout, y_layout = (p0, B), (p1, B)
    optimizer = _optimizer(model)
    graph = TrainGraph(model, optimizer, stages, steps=4)

    losses, placements = [], set()
    for x, y in _batches():
        gx = x.to_global(x_layout[0], B).to_global(sbp=x_layout[1])
        gy = y.to_global(y_layout[0], B).to_global(sbp=y_layout[1])
        loss = graph(gx, gy)
        assert isinstance(loss, sbpflow.GlobalTensor) and not loss.requires_grad
        placements.add(str(loss.placement))
        losses.append(loss.item())
    want_losses = _reference(reference)  # trains ``reference`` in place
    errors = {}
    for (name, p), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.detach().to_global(both, B)  # every rank gets the logical value
        errors[name] = (full.to_local() - want.detach()).abs().max().item()
    grads_left = [n for n, p in model.named_parameters() if p.grad is not None]
    return {
        "losses": losses,
        "reference": want_losses,
        "param_errors": errors,
        "loss_placements": sorted(placements),
        "grads_left": grads_left,
        "lr": optimizer.param_groups[0]["lr"],
    }


@pytest.mark.parametrize(
    ("layout", "loss_placement"),
    [
        ("explicit handoff", "placement('cpu', [1])"),
        ("graph handoff", "placement('cpu', [1])"),
        ("data parallel", "placement('cpu', [0, 1])"),
    ],
)
def test_graph_matches_full_batch_training(layout: str, loss_placement: str) -> None:
    """Two pipeline stages (the activation moved by the model's to_global, or by the graph
    from set_stage's placement) and data parallelism, 4 micro-batches per step: the returned
    losses and final parameters equal single-process full-batch training; the scheduler
    stepped once per call and the optimizer's zero_grad ran after the step."""
    for rank, got in enumerate(get_pool(2).run(graph_job, layout)):
        assert got["losses"] == pytest.approx(got["reference"], abs=_TOL, rel=_TOL), (rank, got)
        bad = {n: e for n, e in got["param_errors"].items() if e > _TOL}
        assert not bad, f"rank {rank}: parameters differ from the reference: {bad}"
        assert got["loss_placements"] == [loss_placement], got
        assert got["grads_left"] == [], got
        assert got["lr"] == pytest.approx(0.2 * 0.5**_STEPS), got


# -- mistakes: an error on every rank, not a hang ----------------------------------------


def mistake_job(mistake: str) -> None:
    p0, p1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    torch.manual_seed(0)
    model = TwoStages(p1)
    model.stage0.to_global(p1 if mistake == "stage off its placement" else p0, B)
    model.stage1.to_global(p1, B)
    stages = [("stage0", p0), ("stage1", p1)]
    graph = TrainGraph(model, _optimizer(model), stages, steps=4)
    if mistake == "stage ids skip":
        graph.model.stage1.config.set_stage(stage_id=2, placement=p1)
    if mistake == "stage ids repeat":
        graph.model.stage1.config.set_stage(stage_id=0, placement=p1)
    batch_size = 6 if mistake == "batch not divisible" else 8
    x, y = _batches(batch_size)[0]
    graph(x.to_global(p0, B), y.to_global(p1, B))


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (
            "stage off its placement",
            r"parameter '0\.weight' of module 'model\.stage0' \(stage 0\) is on "
            r"placement\('cpu', \[1\]\), but the stage is on placement\('cpu', \[0\]\)",
        ),
        ("stage ids skip", r"stage ids must be 0\.\.1 with none skipped, got \[0, 2\]"),
        (
            "stage ids repeat",
            r"stage id 0 is set on 2 modules \('model\.stage0', 'model\.stage1'\)",
        ),
        (
            "batch not divisible",
            r"into 4 micro-batches along dim 0, but positional argument 0 has batch size 6",
        ),
    ],
)
def test_mistakes_are_errors_on_every_rank(mistake: str, message: str) -> None:
    """Each mistake raises the same ValueError on both ranks, promptly (no rank waits in a
    collective for the other)."""
    outcomes = get_pool(2).run_expect_errors(mistake_job, mistake, timeout=60)
    outcomes.assert_all_raised(ValueError, match=message, within=30)


# -- mixed precision -------------------------------------------------------------------------


class AmpGraph(sbpflow.nn.Graph):
    """bf16 autocast in build, the loss scaled by a GradScaler the graph steps through."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, stages: list[Any]):
        super().__init__()
        self.model = model
        for stage_id, (name, placement) in enumerate(stages):
            getattr(self.model, name).config.set_stage(stage_id=stage_id, placement=placement)
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(optimizer)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        self.set_grad_scaler(self.scaler)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(self.model(x), y)
        self.scaler.scale(loss).backward()
        return loss


def _amp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = _batches()
    # Step 1, first micro-batch: tanh saturates (the loss stays finite) but the weight gradient
    # is 0 * inf = nan, so the scaler skips the step and halves its scale.
    batches[1][0][0, 0] = float("inf")
    return batches


def amp_job() -> dict[str, Any]:
    """Train 3 steps through AmpGraph on two stages and, in this process, by hand."""
    p0, p1 = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    both = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    reference = TwoStages(None)
    model = copy.deepcopy(reference)
    model.handoff = p1
    model.stage0.to_global(p0, B)
    model.stage1.to_global(p1, B)
    graph = AmpGraph(model, _optimizer(model), [("stage0", p0), ("stage1", p1)])
    losses = [graph(x.to_global(p0, B), y.to_global(p1, B)).item() for x, y in _amp_batches()]

    opt = _optimizer(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    want = []
    for x, y in _amp_batches():
        micro = []
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(reference(xm), ym)
            scaler.scale(loss).backward()
            micro.append(loss.item())
        for p in reference.parameters():
            p.grad /= 2
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        want.append(sum(micro) / 2)
    errors = {}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.detach().to_global(both, B).to_local()
        errors[name] = (full - ref.detach()).abs().max().item()
    return {
        "losses": losses,
        "reference": want,
        "param_errors": errors,
        "scale": graph.scaler.get_scale(),
        "ref_scale": scaler.get_scale(),
    }


def test_graph_with_autocast_and_grad_scaler() -> None:
    """bf16 autocast and a GradScaler over two pipeline stages, 2 micro-batches: an inf in one
    micro-batch's input makes the step's gradients non-finite, so both ranks skip that step and
    back off the scale once; and the losses, scale and parameters match the
    same training by hand in one process within 1e-5 (the same bf16 ops run in both)."""
    for rank, got in enumerate(get_pool(2).run(amp_job)):
        assert got["scale"] == got["ref_scale"] == 2.0**7, (rank, got)  # one backoff
        assert got["losses"] == pytest.approx(got["reference"], abs=_TOL, rel=_TOL), (rank, got)
        bad = {n: e for n, e in got["param_errors"].items() if not e <= _TOL}
        assert not bad, f"rank {rank}: parameters differ from the reference: {bad}"
