"""The pipeline runtime: ``sbpflow.nn.Graph`` runs each schedule, on 4 ranks and on 2.

Layouts, each trained 2 steps with SGD with momentum through a graph for each of
the four schedules: 4 stages on 4 ranks; 4 stages with the first stage's weight
used again (tied) by the last; 2 stages x 2-way data parallel (parameters B,
batch S(0)); 2 stages x 2-way tensor parallel (column- then row-parallel
linears); and, on 2 ranks, interleaved 1F1B with 4 stages dealt over 2 ranks.
Every rank also trains a plain copy of the model on the whole batch in one
process (the single-process reference): the losses and final parameters must
agree within 1e-5 (the loss is a mean, so the mean of the micro-batch gradients
is the full-batch gradient).

Each rank's record of the step (``graph.last_step()``) must be the schedule's
action list for its stage, in order, transfers included (with a tied weight,
its extra messages ride along: the compute order must still be the schedule's).
Activation memory is measured, not read off the schedule: each stage ends in a
probe whose autograd node saves a marker tensor, freed when the backward that
releases the stage's graph runs; the most markers alive at once per stage must be
``m`` for GPipe, at most ``num_stages`` for 1F1B (exactly that on stage 0) and
for zero bubble.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

B, S0, S1 = Broadcast(), Split(0), Split(1)
_STEPS, _TOL = 2, 1e-5
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

# -- activation probes ---------------------------------------------------------------------

_live: dict[int, int] = {}  # stage -> markers alive now on this rank
_peak: dict[int, int] = {}  # stage -> most alive at once


def _released(stage: int) -> None:
    _live[stage] -= 1


class _ProbeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stage: int) -> torch.Tensor:
        local = x.to_local() if isinstance(x, sbpflow.GlobalTensor) else x
        marker = torch.empty(0)
        ctx.save_for_backward(marker)
        if local.numel():  # this rank holds the stage
            _live[stage] = _live.get(stage, 0) + 1
            _peak[stage] = max(_peak.get(stage, 0), _live[stage])
            weakref.finalize(marker, _released, stage)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Probe(nn.Module):
    """Counts the micro-batches whose graph on this stage is alive (a saved marker tensor)."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ProbeFn.apply(x, self.stage)


# -- models ----------------------------------------------------------------------------------


class FourStages(nn.Module):
    """Four stages; with ``tied`` the last multiplies by the first stage's weight (8 x 6)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.s0 = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Probe(0))
        self.s1 = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Probe(1))
        self.s2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Probe(2))
        self.s3 = nn.Sequential(nn.Linear(8, 8 if tied else 6), Probe(3))
        self.tied = tied
        self.tied_to: sbpflow.Placement | None = None  # where the last stage uses the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.s3(self.s2(self.s1(self.s0(x))))
        if not self.tied:
            return h
        w = self.s0[0].weight
        if self.tied_to is not None:
            w = w.to_global(self.tied_to, B)  # the tied weight boxed to the last stage
        return h @ w


class TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s0 = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), Probe(0))
        self.s1 = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 6), Probe(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s1(self.s0(x))


def _tensor_parallel(name: str, t: torch.Tensor) -> Any:
    """Column-parallel first linear (weight and bias S(0)), row-parallel second (weight S(1))."""
    if name.startswith("0."):
        return S0
    return S1 if name == "2.weight" else B


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: nn.Module, placements: list[Any], schedule: str, m: int) -> None:
        super().__init__()
        self.model = model
        for stage_id, placement in enumerate(placements):
            getattr(self.model, f"s{stage_id}").config.set_stage(stage_id, placement)
        self.config.set_gradient_accumulation_steps(m)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(_optimizer(model))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch_size, 6, generator=gen), torch.randn(batch_size, 6, generator=gen))
        for _ in range(_STEPS)
    ]


def _reference(model: nn.Module, batch_size: int) -> list[float]:
    """Plain full-batch training in this process."""
    opt = _optimizer(model)
    losses = []
    for x, y in _batches(batch_size):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _place(layout: str, num_ranks: int) -> tuple[list[Any], Any, Any]:
    """Stage placements and the (placement, sbp) of the inputs and of the targets."""
    pl = [sbpflow.placement("cpu", [r]) for r in range(num_ranks)]
    if layout in ("pp x dp", "pp x tp"):
        first, last = sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3])
        batch = S0 if layout == "pp x dp" else B
        return [first, last], (first, batch), (last, batch)
    if layout.startswith("interleaved"):
        stages = [pl[0], pl[1], pl[0], pl[1]]
        return stages, (pl[0], B), (pl[1], B)
    return pl, (pl[0], B), (pl[3], B)


def train_job(layout: str, schedule: str) -> dict[str, Any]:
    """Train ``layout`` through a graph running ``schedule``; return what the test compares."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    everyone = sbpflow.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    tied = layout.endswith("tied")
    reference: nn.Module = TwoStages() if layout.startswith("pp x") else FourStages(tied)
    model = copy.deepcopy(reference)
    placements, (x_pl, x_sbp), (y_pl, y_sbp) = _place(layout, world)
    for i, placement in enumerate(placements):
        stage = getattr(model, f"s{i}")
        stage.to_global(placement, B)
        if layout == "pp x tp":
            stage.to_global(placement, _tensor_parallel)
    if tied:
        model.tied_to = placements[-1]
    m = 8 if layout == "pipeline" else 4
    batch_size = 2 * m
    graph = TrainGraph(model, placements, schedule, m)
    _live.clear()
    _peak.clear()
    losses = []
    for x, y in _batches(batch_size):
        gx = x.to_global(x_pl, B).to_global(sbp=x_sbp)
        gy = y.to_global(y_pl, B).to_global(sbp=y_sbp)
        losses.append(graph(gx, gy).to_global(everyone, B).to_local().item())
    peaks = dict(_peak)
    want = _reference(reference, batch_size)
    errors = {}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.detach().to_global(everyone, B).to_local()
        errors[name] = (full - ref.detach()).abs().max().item()
    record = graph.last_step()
    holder = next(p.flat_ranks[0] for p in placements if rank in p.flat_ranks)
    sched = graph.schedule()
    return {
        "losses": losses,
        "reference": want,
        "param_errors": errors,
        "ran": [str(a) for a in record.actions_of(rank)],
        "planned": [str(a) for a in sched.actions[holder]],
        "stages": list(sched.stages_of(holder)),
        "record_peaks": dict(record.peak_live_microbatches),
        "probe_peaks": peaks,
        "m": m,
        "num_stages": sched.num_stages,
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
    }


def _check(results: list[dict[str, Any]], layout: str, schedule: str) -> None:
    for rank, got in enumerate(results):
        where = f"{layout}, {schedule}, rank {rank}"
        assert got["losses"] == pytest.approx(got["reference"], abs=_TOL, rel=_TOL), (where, got)
        bad = {n: e for n, e in got["param_errors"].items() if not e <= _TOL}
        assert not bad, f"{where}: parameters differ from the reference: {bad}"
        assert got["grads_left"] == [], (where, got["grads_left"])
        ran, planned = got["ran"], got["planned"]
        if layout.endswith("tied"):  # the tied weight's messages ride along the scheduled ones
            compute = [a for a in ran if a[0] in "FBIW"]
            assert compute == [a for a in planned if a[0] in "FBIW"], (where, ran, planned)
            assert set(planned) <= set(ran), (where, ran, planned)
        else:
            assert ran == planned, (where, ran, planned)
        m, p = got["m"], got["num_stages"]
        for stage in got["stages"]:
            probe, record = got["probe_peaks"][stage], got["record_peaks"][stage]
            assert probe == record, (where, stage, got["probe_peaks"], got["record_peaks"])
            if schedule == "gpipe":
                assert probe == m, (where, stage, probe)
            elif schedule != "interleaved_1f1b":
                assert probe <= p, (where, stage, probe)
        if schedule == "1f1b" and 0 in got["stages"]:
            assert got["probe_peaks"][0] == min(p, m), (where, got["probe_peaks"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_on_four_ranks(schedule: str) -> None:
    """4 stages on 4 ranks (8 micro-batches), a tied weight on the first and last stage,
    2 stages x 2-way data parallel and 2 stages x 2-way tensor parallel: losses and parameters
    equal single-process full-batch training; each rank ran exactly its schedule's list; the
    measured live activations are m (GPipe) or at most num_stages (1F1B, zero bubble)."""
    pool = get_pool(4)
    for layout in ("pipeline", "tied", "pp x dp", "pp x tp"):
        _check(pool.run(train_job, layout, schedule), layout, schedule)


@pytest.mark.parametrize("layout", ["interleaved", "interleaved tied"])
def test_interleaved_four_stages_on_two_ranks(layout: str) -> None:
    """Interleaved 1F1B with stages 0 and 2 on rank 0, 1 and 3 on rank 1 (each micro-batch's
    build parked between its stages on a rank), with and without a weight tied between the
    first and last stage: losses and parameters equal single-process full-batch training and
    each rank ran its schedule's list in order."""
    _check(get_pool(2).run(train_job, layout, "interleaved_1f1b"), layout, "interleaved_1f1b")
