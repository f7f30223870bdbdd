"""Parts 2 and 3: real compute, against torch.distributed.pipelining and across stage counts.

The model: stages of ``4 x (Linear(1024, 1024), ReLU)``; batch 256 in 8 micro-batches, MSE
loss, SGD; gloo ranks with one thread each.

Part 2, 2 ranks, 2 stages: torch's ``PipelineStage`` with ``ScheduleGPipe`` /
``Schedule1F1B`` (``loss_fn=mse_loss``; it scales each micro-batch's gradient by 1/8) and
``sbpflow.nn.Graph`` with the schedule of the same name, and the same 2 stages on one rank
with the same accumulation (the other rank waits). The variants are interleaved: every
repetition runs each once, in an order rotating from one repetition to the next; a step
starts after a barrier and its time is the slowest rank's. Host CPU per action: the CPU
time of the rank's main thread (``time.thread_time``) in each compute action (sbpflow: the
runtime's actions; torch: ``forward_one_chunk`` / ``backward_one_chunk`` of the stage), and
in each whole step.

Part 4, 2 ranks, 2 stages: the split backward's weight pass. ``sbpflow.nn.Graph`` with
``1f1b`` and with ``zero_bubble`` on the same stages, interleaved: step time, and host CPU of
the main thread per B (1f1b) and per I and W (zero_bubble). The weight pass starts from the
gradients the input pass kept, so I + W costs about what B does.

Part 3, 4 ranks: the same stages as two 2-stage pipelines at once (ranks 0-1 and ranks 2-3)
and as one 4-stage pipeline (ranks 0-3), interleaved in one run: host CPU per forward and per
backward action on each rank. Stage-local execution makes it the same: a rank runs its own
stage and stand-ins for the others. Four ranks compute and send at once in both, so a
thread's CPU time per action is compared under the same contention for the cores and caches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sbpflow
from bench._ranks import join_world
from bench.pipeline._timed import Chain, StepGraph
from sbpflow.comm import collectives
from sbpflow.nn.pipeline import StepRecord
from sbpflow.nn.pipeline.runtime import _step
from sbpflow.sbp import broadcast

WIDTH, LAYERS, BATCH, M = 1024, 4, 256, 8
SCHEDULES = ("gpipe", "1f1b")
SPLIT_SCHEDULES = ("1f1b", "zero_bubble")  # part 4
# Part 5: micro-batch counts of 2 stages, and of 4 stages on 2 ranks (each half as deep).
BUBBLE_MICROBATCHES, V_MICROBATCHES = (2, 4, 8), (4, 8)
V_SCHEDULES = {  # sbpflow's schedule: (its stages' ranks, torch's schedule of the same order)
    "interleaved_1f1b": ([0, 1, 0, 1], "ScheduleInterleaved1F1B"),
    "interleaved_zero_bubble": ([0, 1, 0, 1], "ScheduleInterleavedZeroBubble"),
    "zbv": ([0, 1, 1, 0], "ScheduleZBVZeroBubble"),
}
# Per action kind, its CPU time and the part of it in transfers ("moves", part 3 only); I
# and W are the halves of a split backward (part 4 only).
KINDS = ("F", "B", "F moves", "B moves", "I", "W")


def stage_module(seed: int, num_layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(num_layers):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


class _ActionCpu:
    """Thread CPU time per compute action kind ("F", "B") of this rank, accumulated; with
    ``transfers`` (part 3), also the part of each action spent moving tensors between stages."""

    def __init__(self, transfers: _TransferCpu | None = None) -> None:
        self.transfers = transfers
        self.seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}

    def clear(self) -> None:
        self.seconds = {kind: [] for kind in KINDS}

    def timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            moved = self.transfers.seconds if self.transfers is not None else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind].append(time.thread_time() - start)
                if self.transfers is not None:
                    self.seconds[f"{kind} moves"].append(self.transfers.seconds - moved)

        return run


class _TransferCpu:
    """The thread CPU time this rank spends in ``collectives.exchange`` (the stage-to-stage
    transfers: posting the sends, copying them, receiving), accumulated."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self) -> Callable[[], None]:
        original = collectives.exchange

        def exchange(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        collectives.exchange = exchange  # type: ignore[assignment]

        def undo() -> None:
            collectives.exchange = original  # type: ignore[assignment]

        return undo


def _sbp_graph(
    schedule: str,
    num_stages: int,
    first_rank: int = 0,
    m: int = M,
    ranks: list[int] | None = None,
) -> tuple[Any, tuple[Any, Any]]:
    """The pipeline of ``num_stages`` stages, one per rank from ``first_rank`` on (or stage i on
    ``ranks[i]``, each ``LAYERS * 2 // len(ranks)`` layers), and its batch of ``m``
    micro-batches of ``BATCH // M`` rows."""
    if ranks is None:
        ranks, layers = [first_rank + r for r in range(num_stages)], LAYERS
    else:
        layers = LAYERS * 2 // len(ranks)  # the same model, cut into more stages
    placements = [sbpflow.placement("cpu", [r]) for r in ranks]
    model = Chain([stage_module(s, layers) for s in range(len(ranks))])
    for stage, placement in zip(model.stages, placements, strict=True):
        stage.to_global(placement, broadcast)
    torch.manual_seed(100)
    x, y = torch.randn(BATCH // M * m, WIDTH), torch.randn(BATCH // M * m, WIDTH)
    graph = StepGraph(model, placements, schedule, m)
    return graph, (x.to_global(placements[0], broadcast), y.to_global(placements[-1], broadcast))


def _torch_step(schedule: str, rank: int, cpu: _ActionCpu) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = stage_module(rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    stage.forward_one_chunk = cpu.timed("F", stage.forward_one_chunk)  # type: ignore[method-assign]
    stage.backward_one_chunk = cpu.timed("B", stage.backward_one_chunk)  # type: ignore[method-assign]
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = cls(stage, n_microbatches=M, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    torch.manual_seed(100)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()

    return step


def _one_rank_step(rank: int) -> Callable[[], None]:
    model = nn.Sequential(stage_module(0), stage_module(1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(100)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        if rank == 0:
            for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
                (F.mse_loss(model(xm), ym) / M).backward()
            opt.step()
            opt.zero_grad()

    return step


def _patched_actions(cpu: _ActionCpu, halves: bool = False) -> Callable[[], None]:
    """Time the runtime's compute actions on this rank (with ``halves``, I and W apart from
    B); returns the undo."""
    original = _step.run_action

    def run_action(action: Any, scope: Any, build: Any) -> None:
        kind = action.kind.value
        if kind != "F" and not (halves and kind in ("I", "W")):
            kind = "B"
        cpu.timed(kind, original)(action, scope, build)

    _step.run_action = run_action  # type: ignore[assignment]

    def undo() -> None:
        _step.run_action = original  # type: ignore[assignment]

    return undo


def _interleaved(
    steps: dict[str, Callable[[], None]], reps: int, cpus: dict[str, _ActionCpu]
) -> dict[str, dict[str, Any]]:
    """Each repetition runs every step once, in an order rotating by one; warmup dropped.

    ``cpu_step``: the CPU time of the rank's main thread in a whole step (median), every
    transfer, loss and optimizer step included: the same work for sbpflow and torch, where
    the CPU per action covers what each counts as the action (torch's leaves out the sends,
    receives and the loss, which sbpflow's forward and backward include)."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    step_cpu: dict[str, list[float]] = {n: [] for n in names}
    per_action: dict[str, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in names}
    for rep in range(2 + reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            cpu = cpus.get(name)
            if cpu is not None:
                cpu.clear()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            steps[name]()
            used = time.thread_time() - start_cpu
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= 2:
                times[name].append(elapsed.item())
                step_cpu[name].append(used)
                if cpu is not None:
                    for kind in KINDS:
                        per_action[name][kind] += cpu.seconds[kind]

    def median(samples: list[float]) -> float | None:  # a few preempted actions skew a mean
        return statistics.median(samples) if samples else None

    return {
        n: {
            "times": times[n],
            "cpu_step": median(step_cpu[n]),
            "cpu_f": median(per_action[n]["F"]),
            "cpu_b": median(per_action[n]["B"]),
            "moves_f": median(per_action[n]["F moves"]),
            "moves_b": median(per_action[n]["B moves"]),
            "cpu_i": median(per_action[n]["I"]),
            "cpu_w": median(per_action[n]["W"]),
        }
        for n in names
    }


def worker_vs_torch(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    steps: dict[str, Callable[[], None]] = {}
    cpus: dict[str, _ActionCpu] = {}
    graphs = {}
    for schedule in SCHEDULES:
        cpus[f"torch {schedule}"] = cpu = _ActionCpu()
        steps[f"torch {schedule}"] = _torch_step(schedule, rank, cpu)
        graph, batch = _sbp_graph(schedule, 2)
        graphs[schedule] = graph
        steps[f"sbpflow {schedule}"] = lambda graph=graph, batch=batch: graph(*batch)
        cpus[f"sbpflow {schedule}"] = _ActionCpu()
    steps["one rank"] = _one_rank_step(rank)
    sbp_cpu = _ActionCpu()
    undo = _patched_actions(sbp_cpu)

    def sbp_step(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            sbp_cpu.clear()
            fn()
            cpus[name].seconds = sbp_cpu.seconds

        return run

    for name in list(steps):
        if name.startswith("sbpflow"):
            steps[name] = sbp_step(name, steps[name])
    try:
        results = _interleaved(steps, reps, cpus)
    finally:
        undo()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (results, graphs["1f1b"].last_step()))
    if rank == 0:
        record = StepRecord.combine(r for _, r in gathered if r.ranks)
        queue.put(([res for res, _ in gathered], record))
    dist.barrier()


def worker_weight_pass(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    steps: dict[str, Callable[[], None]] = {}
    cpus: dict[str, _ActionCpu] = {}
    sbp_cpu = _ActionCpu()
    for schedule in SPLIT_SCHEDULES:
        graph, batch = _sbp_graph(schedule, 2)
        cpus[schedule] = _ActionCpu()

        def run(graph: Any = graph, batch: Any = batch, name: str = schedule) -> None:
            sbp_cpu.clear()
            graph(*batch)
            cpus[name].seconds = sbp_cpu.seconds

        steps[schedule] = run
    undo = _patched_actions(sbp_cpu, halves=True)
    try:
        results = _interleaved(steps, reps, cpus)
    finally:
        undo()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()


def _torch_stages_step(cls_name: str, ranks: list[int], m: int, rank: int) -> Callable[[], None]:
    """torch's ``PipelineStage``s of this rank (stage i on ``ranks[i]``) under schedule
    ``cls_name``, the model and batch of ``_sbp_graph`` with the same ``ranks`` and ``m``."""
    from torch.distributed import pipelining

    layers = LAYERS * 2 // len(ranks)
    ids = [i for i, r in enumerate(ranks) if r == rank]
    modules = [stage_module(i, layers) for i in ids]
    stages = [
        pipelining.PipelineStage(module, i, len(ranks), torch.device("cpu"))
        for module, i in zip(modules, ids, strict=True)
    ]
    pipe = getattr(pipelining, cls_name)(stages, n_microbatches=m, loss_fn=F.mse_loss)
    opt = torch.optim.SGD([p for module in modules for p in module.parameters()], lr=1e-3)
    torch.manual_seed(100)
    x, y = torch.randn(BATCH // M * m, WIDTH), torch.randn(BATCH // M * m, WIDTH)
    args = (x,) if 0 in ids else ()
    kwargs: dict[str, Any] = {"target": y, "losses": []} if len(ranks) - 1 in ids else {}

    def step() -> None:
        pipe.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()

    return step


def worker_bubble(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    """Part 5: step times of 1f1b and zero_bubble on 2 stages for each count in
    ``BUBBLE_MICROBATCHES``, and of the schedules of ``V_SCHEDULES`` on 4 stages (sbpflow and
    torch) for each count in ``V_MICROBATCHES``, interleaved in one run."""
    join_world(rank, world, port)
    steps: dict[str, Callable[[], None]] = {}
    for m in BUBBLE_MICROBATCHES:
        for schedule in SPLIT_SCHEDULES:
            graph, batch = _sbp_graph(schedule, 2, m=m)
            steps[f"sbpflow {schedule} 2 m={m}"] = lambda g=graph, b=batch: g(*b)
    for m in V_MICROBATCHES:
        for schedule, (ranks, torch_name) in V_SCHEDULES.items():
            graph, batch = _sbp_graph(schedule, 4, m=m, ranks=ranks)
            steps[f"sbpflow {schedule} 4 m={m}"] = lambda g=graph, b=batch: g(*b)
            steps[f"torch {schedule} 4 m={m}"] = _torch_stages_step(torch_name, ranks, m, rank)
    results = _interleaved(steps, reps, {})
    if rank == 0:
        queue.put({name: r["times"] for name, r in results.items()})
    dist.barrier()


def worker_stage_counts(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    steps: dict[str, Callable[[], None]] = {}
    cpus: dict[str, _ActionCpu] = {}
    transfers = _TransferCpu()
    sbp_cpu = _ActionCpu(transfers)
    for schedule in SCHEDULES:
        for stages in (2, 4):
            name = f"{schedule} {stages} stages"
            # 2 stages: ranks 0-1 run one pipeline while ranks 2-3 run another alike. Each
            # runs once on every rank first (an sbpflow program runs on every rank: that is
            # where the groups of its transfers are made); after that the two pipelines
            # exchange nothing with each other.
            graph, batch = _sbp_graph(schedule, stages, first_rank=0)
            if stages == 2:
                other = _sbp_graph(schedule, stages, first_rank=2)
                for pipeline, its_batch in ((graph, batch), other):
                    pipeline(*its_batch)
                if rank >= 2:
                    graph, batch = other
            cpus[name] = _ActionCpu(transfers)

            def run(graph: Any = graph, batch: Any = batch, name: str = name) -> None:
                sbp_cpu.clear()
                graph(*batch)
                cpus[name].seconds = sbp_cpu.seconds

            steps[name] = run
    undo = _patched_actions(sbp_cpu)
    undo_transfers = transfers.install()
    try:
        results = _interleaved(steps, reps, cpus)
    finally:
        undo_transfers()
        undo()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
