"""Part 1: the schedules themselves, measured with stages that wait a fixed time.

4 gloo ranks. One stage per rank (4 stages) for gpipe, 1f1b and zero_bubble; two per rank
(8 stages: dealt round-robin, or as a V for zbv and dualpipev) for the others. Each stage is
a tiny linear and a timed wait of ``T / v`` in forward and ``2T / v`` in backward, or
``T / v`` per half of a split backward (the first stage has no input gradient to compute, so
its weight half waits ``2T / v``): a rank's work is the same under every schedule. The input
half's wait sits on the activation's path and the weight half's on the weight's, so each
runs where its half computes (the weight pass starts from the gradients the input pass kept
and does not run the activation's path again). The waits
sleep, so four ranks on a machine with fewer cores measure the schedule, not the CPU. The
bubble is measured from the runtime's record of the last step (``graph.last_step()``,
combined over the ranks): 1 - computing time / (ranks x makespan), a rank waiting for a
message being idle.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sbpflow
from bench._ranks import join_world
from sbpflow.nn.pipeline import (
    SCHEDULE_NAMES,
    ActionKind,
    StepRecord,
    build_schedule,
    current_action,
)
from sbpflow.sbp import broadcast

T = 0.05  # seconds of a rank's forward wait (long next to the runtime's own work per action)
P = 4  # pipeline ranks
WIDTH, ROWS = 16, 4  # the tiny linear and rows per micro-batch
SCHEDULES = SCHEDULE_NAMES  # every schedule, in the docs' order
MICROBATCHES = (8, 16)
_V_SHAPED = ("zbv", "dualpipev")


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in ("gpipe", "1f1b", "zero_bubble") else 2


def stage_ranks(schedule: str) -> list[int]:
    if schedule in _V_SHAPED:
        return list(range(P)) + list(range(P))[::-1]
    return list(range(P)) * stages_per_rank(schedule)


def formula(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble fraction of ``schedule`` with F = I = W (docs/pipeline-schedules.md)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)  # the zero-bubble family


def _waits_here(x: torch.Tensor, seconds: float) -> float:
    local = x.to_local() if isinstance(x, sbpflow.GlobalTensor) else x
    return seconds if local.numel() else 0.0  # only the ranks holding the stage wait


class TimedWait(torch.autograd.Function):
    """On the activation's path: waits ``seconds`` in forward, and in backward for the input
    half (in a B, or an I; in a W only on the first stage, whose I does not reach it, or on
    a rank holding several stages, whose W runs the backward again: then only there)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, first: bool) -> torch.Tensor:
        ctx.seconds = _waits_here(x, seconds)
        ctx.first = first
        time.sleep(ctx.seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        action = current_action()
        kind = action.kind if action is not None else ActionKind.BACKWARD
        if kind is not ActionKind.BACKWARD_WEIGHT or ctx.first:
            time.sleep(ctx.seconds)
        return grad, None, None


class TimedWeight(torch.autograd.Function):
    """On the weight's path: waits ``seconds`` in backward (the weight half, in a B or a W)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = _waits_here(w, seconds)
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class TimedStage(nn.Module):
    def __init__(self, seconds: float, first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seconds, self.first = seconds, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = TimedWeight.apply(self.linear.weight, self.seconds)
        y = F.linear(x, weight, self.linear.bias)
        return TimedWait.apply(y, self.seconds, self.first)


class Chain(nn.Module):
    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


class StepGraph(sbpflow.nn.Graph):
    def __init__(self, model: Chain, placements: list[Any], schedule: str, m: int) -> None:
        super().__init__()
        self.model = model
        for i, placement in enumerate(placements):
            self.model.stages[i].config.set_stage(i, placement)
        self.config.set_gradient_accumulation_steps(m)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def timed_chain(schedule: str) -> Chain:
    v = stages_per_rank(schedule)
    torch.manual_seed(0)
    return Chain([TimedStage(T / v, i == 0) for i in range(P * v)])


def step_time(graph: Any, batch: tuple[Any, ...]) -> float:
    """One call of ``graph`` after a barrier; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    graph(*batch)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def one_rank_time(model: nn.Module, m: int, rows: int, width: int) -> float:
    """One step of the plain model on this rank alone, with m micro-batches of accumulation."""
    x, y = torch.randn(m * rows, width), torch.randn(m * rows, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
            F.mse_loss(model(xm), ym).backward()
        opt.step()
        opt.zero_grad()
        best = min(best, time.perf_counter() - start)
    return best


def worker(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    results = {}
    for m in MICROBATCHES:
        for schedule in SCHEDULES:
            model = timed_chain(schedule)
            placements = [sbpflow.placement("cpu", [r]) for r in stage_ranks(schedule)]
            for stage, placement in zip(model.stages, placements, strict=True):
                stage.to_global(placement, broadcast)
            graph = StepGraph(model, placements, schedule, m)
            x = torch.randn(m * ROWS, WIDTH).to_global(placements[0], broadcast)
            y = torch.randn(m * ROWS, WIDTH).to_global(placements[-1], broadcast)
            step_time(graph, (x, y))  # warmup
            times, records = [], []
            for _ in range(reps):
                times.append(step_time(graph, (x, y)))
                records.append(graph.last_step())
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records)
            steps = [
                StepRecord.combine(mine[i] for mine in gathered if mine[i].ranks)
                for i in range(reps)
            ]
            # The bubble of each timed step; the step with the median one stands for the row
            # (one preempted step on this shared host would move a single step's bubble).
            steps.sort(key=lambda record: record.bubble_fraction)
            results[(schedule, m)] = {"times": times, "record": steps[len(steps) // 2]}
    if rank == 0:
        one = {m: one_rank_time(timed_chain("1f1b"), m, ROWS, WIDTH) for m in MICROBATCHES}
        queue.put((results, one))
    dist.barrier()


def rows(results: dict[Any, Any], one: dict[int, float]) -> tuple[list[str], list[str]]:
    """The table's rows, and the rows off the 5-point target."""
    import statistics

    lines, misses = [], []
    for (schedule, m), got in results.items():
        v = stages_per_rank(schedule)
        record: StepRecord = got["record"]
        want = formula(schedule, P, m, v)
        bubble = record.bubble_fraction
        ranks = stage_ranks(schedule)
        schedule_data = build_schedule(schedule, len(ranks), ranks, m)
        sim = schedule_data.simulate(forward_time=1.0 / v, backward_time=2.0 / v)
        step = statistics.median(got["times"])
        peak = max(record.peak_live_microbatches.values())
        bound = max(schedule_data.peak_live_microbatches.values())
        if abs(bubble - want) > 0.05:
            misses.append(f"{schedule} m={m}: bubble {bubble:.1%} vs formula {want:.1%}")
        lines.append(
            f"| {schedule} | {v} | {m} | {want:.1%} | {sim.bubble_fraction:.1%} | "
            f"**{bubble:.1%}** | {peak} ({bound}) | {step * 1e3:.0f} | {one[m] * 1e3:.0f} | "
            f"{one[m] / step:.2f}x |"
        )
    return lines, misses
