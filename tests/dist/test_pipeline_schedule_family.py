"""Every pipeline schedule run by ``sbpflow.nn.Graph`` on 2 ranks, watched from the model.

Four stages on two ranks for the schedules with several stages per rank (looped BFS,
interleaved zero bubble, zero bubble dealt round-robin: stages 0 and 2 on rank 0; ZBV and
DualPipeV: stages 0 and 3 on rank 0, a V), two stages for GPipe, 1F1B and zero bubble;
each with and without a weight of the first stage used again (tied) by the last. Every
rank also trains a plain copy of the model on the whole batch in one process (the
single-process reference): the losses and final parameters must agree within 1e-5 (the
loss is a mean, so the mean of the micro-batch gradients is the full-batch gradient).

What ran is observed from the outside (tests/dist/_pipeline_observer.py): probes in each
stage log its forwards and the arrival of its output's gradient, with the micro-batch
found from the data; that order must be the schedule's. The probes' markers count the
micro-batches each stage holds: per stage exactly what the schedule's lists say
(``Schedule.peak_live_microbatches``), per rank at most the schedule's memory bound. A test
of the test runs the runtime with two backwards swapped and sees the check fail. A probe at
the loss counts the backward passes that start there: one per micro-batch on every rank,
where a split backward's weight pass reuses what its input pass computed (NOTE [weight
pass] in sbpflow/nn/pipeline/runtime/_weight_pass.py): on ranks holding several stages too;
two on a rank holding only the first stage, whose weight pass runs its whole backward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast
from sbpflow.testing import get_pool

from . import _pipeline_observer as observer

B = Broadcast()
_STEPS, _TOL, _M, _ROWS = 2, 1e-5, 4, 2
MULTI = ("looped_bfs", "interleaved_zero_bubble", "zero_bubble rr", "zbv", "dualpipev")
SINGLE = ("gpipe", "1f1b", "zero_bubble")


def _bound(schedule: str, p: int, m: int) -> int:
    """Stage-micro-batches a rank may hold at once (live until B or W)."""
    return {
        "gpipe": m,
        "1f1b": p,
        "zero_bubble": p,
        "zero_bubble rr": 2 * p,
        "interleaved_zero_bubble": 2 * p,
        "looped_bfs": 2 * m,
        "zbv": 2 * p,
        "dualpipev": 2 * p + 1,
    }[schedule]


class Chain(nn.Module):
    """Observed stages of linears (tanh between); ``tied``: the output times stage 0's weight."""

    def __init__(self, num_stages: int, tied: bool) -> None:
        super().__init__()
        widths = [6] + [8] * num_stages
        if not tied:
            widths[-1] = 6
        self.stages = nn.ModuleList(
            observer.ObservedStage(
                s,
                nn.Sequential(nn.Linear(widths[s], widths[s + 1]), nn.Tanh())
                if s < num_stages - 1
                else nn.Linear(widths[s], widths[s + 1]),
            )
            for s in range(num_stages)
        )
        self.tied = tied
        self.tied_to: sbpflow.Placement | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        if self.tied:
            w = self.stages[0].layers[0].weight  # 8 x 6
            if self.tied_to is not None:
                w = w.to_global(self.tied_to, B)
            x = x @ w
        return observer.at_loss(x)


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: Chain, placements: list[Any], schedule: str) -> None:
        super().__init__()
        self.model = model
        for s, placement in enumerate(placements):
            self.model.stages[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(_optimizer(model))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = _M * _ROWS
    return [
        (torch.randn(n, 6, generator=gen), torch.randn(n, 6, generator=gen)) for _ in range(_STEPS)
    ]


def _layout(schedule: str) -> tuple[str, list[int]]:
    if schedule in SINGLE:
        return schedule, [0, 1]
    if schedule in ("zbv", "dualpipev"):
        return schedule, [0, 1, 1, 0]
    return schedule.removesuffix(" rr"), [0, 1, 0, 1]


def train_job(
    schedule: str, tied: bool, swap_backwards: bool = False, unsplit: bool = False
) -> dict[str, Any]:
    """Train through a graph running ``schedule``; log the last step from the model's probes.

    ``swap_backwards``: rank 0's runtime runs its last two backwards in the other order
    (for the test of the test). ``unsplit``: no weight pass can be split by stage (a rank
    holding several stages then runs the backward again).
    """
    name, ranks = _layout(schedule)
    rank = sbpflow.env.get_rank()
    everyone = sbpflow.placement("cpu", [0, 1])
    placements = [sbpflow.placement("cpu", [r]) for r in ranks]
    torch.manual_seed(0)
    observer.start(log=False)
    reference = Chain(len(ranks), tied)
    model = copy.deepcopy(reference)
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, B)
    if tied:
        model.tied_to = placements[-1]
    graph = TrainGraph(model, placements, name)
    losses = []
    with _last_backwards_swapped_on_rank_0(swap_backwards), _unsplit(unsplit):
        for step, (x, y) in enumerate(_batches()):
            if step == _STEPS - 1:
                observer.start()
            gx, gy = x.to_global(placements[0], B), y.to_global(placements[-1], B)
            losses.append(graph(gx, gy).to_global(everyone, B).to_local().item())
    events, (stage_peaks, rank_peak) = observer.events(), observer.peaks()
    observer.start(log=False)
    want = _reference(reference)
    errors = {
        n: (p.detach().to_global(everyone, B).to_local() - r.detach()).abs().max().item()
        for (n, p), r in zip(model.named_parameters(), reference.parameters(), strict=True)
    }
    sched = graph.schedule()
    x_last = _batches()[-1][0]
    return {
        "losses": losses,
        "reference": want,
        "param_errors": errors,
        "events": events,
        "first_inputs": [float(x_last[k * _ROWS : (k + 1) * _ROWS].sum()) for k in range(_M)],
        "planned": [a for a in sched.actions[rank] if a.is_compute],
        "stages": list(sched.stages_of(rank)),
        "stage_peaks": stage_peaks,
        "rank_peak": rank_peak,
        "schedule_peaks": dict(sched.peak_live_microbatches),
        "schedule_rank_peak": sched.peak_live_per_rank[rank],
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
        "backwards_from_loss": observer.backwards_from_loss(events),
    }


@contextlib.contextmanager
def _last_backwards_swapped_on_rank_0(swap: bool) -> Iterator[None]:
    """While the block runs, rank 0's runtime runs its last two backwards in swapped order."""
    from sbpflow.nn.pipeline.runtime import _step

    planned = _step.compute_order

    def swapped(schedule: Any, holder: int | None, num_microbatches: int) -> list[Any]:
        order = planned(schedule, holder, num_microbatches)
        if holder == 0:
            last = [i for i, a in enumerate(order) if a.kind.value != "F"][-2:]
            order[last[0]], order[last[1]] = order[last[1]], order[last[0]]
        return order

    if swap:
        _step.compute_order = swapped  # type: ignore[assignment]
    try:
        yield
    finally:
        _step.compute_order = planned  # type: ignore[assignment]


@contextlib.contextmanager
def _unsplit(on: bool) -> Iterator[None]:
    """While the block runs, no weight pass splits by stage (NOTE [weight pass on several
    stages] in sbpflow/nn/pipeline/runtime/_workers.py)."""
    from sbpflow.nn.pipeline.runtime._weight_pass import WeightPass

    if not on:
        yield
        return
    split = WeightPass.split
    WeightPass.split = lambda self, window_of: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        WeightPass.split = split  # type: ignore[method-assign]


def _reference(model: nn.Module) -> list[float]:
    """Plain full-batch training in this process."""
    opt = _optimizer(model)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _observed_and_expected(
    results: list[dict[str, Any]], i0: bool, whole: bool = False
) -> tuple[Any, Any]:
    observed = observer.observed_order(
        [got["events"] for got in results], results[0]["first_inputs"]
    )
    expected = [
        observer.expected_order(got["planned"], i0, whole or _first_stage_only(got))
        for got in results
    ]
    return observed, expected


def _first_stage_only(got: dict[str, Any]) -> bool:
    """Whether the rank holds the first stage only, whose weight pass runs its whole backward
    from the loss (sbpflow/nn/pipeline/runtime/_step.py: there I computes nothing inside
    the stage)."""
    return got["stages"] == [0] and any(a.kind.value == "W" for a in got["planned"])


def _check(results: list[dict[str, Any]], schedule: str, tied: bool, whole: bool = False) -> None:
    _, ranks = _layout(schedule)
    for rank, got in enumerate(results):
        where = f"{schedule}, tied={tied}, rank {rank}"
        assert got["losses"] == pytest.approx(got["reference"], abs=_TOL, rel=_TOL), (where, got)
        bad = {n: e for n, e in got["param_errors"].items() if not e <= _TOL}
        assert not bad, f"{where}: parameters differ from the reference: {bad}"
        assert got["grads_left"] == [], (where, got["grads_left"])
        for stage in got["stages"]:
            assert got["stage_peaks"][stage] == got["schedule_peaks"][stage], (where, got)
        assert got["rank_peak"] == got["schedule_rank_peak"], (where, got)
        assert got["rank_peak"] <= _bound(schedule, 2, _M), (where, got["rank_peak"])
        # One backward pass from the loss per micro-batch where a split backward's weight
        # pass reuses what its input pass computed (a rank holding a later stage, or several
        # stages), two where it runs the backward again.
        want = _M * (2 if whole or _first_stage_only(got) else 1)
        assert got["backwards_from_loss"] == want, (where, got["backwards_from_loss"], want)
    # I on the first stage computes inside it only when a weight of it crossed placements.
    i0 = tied and ranks[0] != ranks[-1]
    observed, expected = _observed_and_expected(results, i0, whole)
    observer.check_order(observed, expected)


@pytest.mark.parametrize("schedule", [*SINGLE, *MULTI])
def test_each_schedule_trains_exactly_and_runs_its_order(schedule: str) -> None:
    """With and without a weight tied between the first and the last stage: losses and
    parameters equal single-process full-batch training; the order the probes saw on each
    rank is the schedule's; the micro-batches held per stage are the schedule's count and
    per rank within its memory bound."""
    pool = get_pool(2)
    for tied in (False, True):
        _check(pool.run(train_job, schedule, tied), schedule, tied)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv"])
def test_a_weight_pass_not_split_by_stage_runs_the_backward_again(schedule: str) -> None:
    """On a rank holding several stages, a micro-batch whose weight pass cannot be split by
    stage (forced here) runs its backward again from the loss in W, stage by stage: losses
    and parameters still equal single-process training, the order and the micro-batches held
    per stage are still the schedule's, and the loss sees two backward passes per
    micro-batch."""
    pool = get_pool(2)
    for tied in (False, True):
        _check(pool.run(train_job, schedule, tied, False, True), schedule, tied, whole=True)


def test_the_order_check_fails_when_the_runtime_runs_another_order() -> None:
    """The test of the test: rank 0's runtime runs its last two backwards swapped (GPipe,
    two stages; the gradients it receives are then used for the wrong micro-batches, so
    training is silently wrong). The probes see the swapped order and the check fails;
    the same run unswapped passes it."""
    pool = get_pool(2)
    good = pool.run(train_job, "gpipe", False)
    observer.check_order(*_observed_and_expected(good, False))
    bad = pool.run(train_job, "gpipe", False, True)
    with pytest.raises(AssertionError, match="rank 0 ran another order than its schedule"):
        observer.check_order(*_observed_and_expected(bad, False))
