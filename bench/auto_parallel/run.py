"""Auto-parallel: the plan's step against hand-written layouts, predicted against measured.

One run spawns 2 gloo ranks on this machine (4 for the 2x2 mesh). Every rank plans with ``sbpflow.auto_parallel``
(default prices, AdamW state counted) and trains with AdamW, one step at a time
(zero_grad, forward, mean-square loss of the output, backward, optimizer.step). Just before
and just after each case's steps it measures the machine's prices
(``sbpflow.boxing.calibrate`` for the collectives, ``calibrate_compute`` for compute and
the wait per collective beyond the collectives' measured prices; rank 0's numbers shared); the predicted step is the plan's strategies priced with each
(``sbpflow.auto_parallel.reprice``), averaged. Four comparisons, each its variants interleaved:

- ``mlp``: bench/tp's 4 residual blocks ``x + down(GELU(up(LayerNorm(x))))`` (256 -> 1024 ->
  256, 512 rows), the batch fixed broadcast: the plan (``plan.apply``, its module boundaries
  followed) vs sbpflow's hand Megatron layout (``Module.to_global``, propagation) vs DTensor
  ``parallelize_module`` (``up`` ColwiseParallel, ``down`` RowwiseParallel).
- ``llama``: a Hugging Face Llama (hidden 256, intermediate 1024, 4 layers, 8 heads over 4
  key/value heads, vocabulary 1024), a batch of 2 x 128 tokens fixed broadcast: the plan vs
  sbpflow with torchtitan's layout (q, k, v, gate, up split by output features; o, down by
  input features; the rest broadcast) vs DTensor with torchtitan's plan (Colwise q, k, v,
  gate, up; Rowwise o, down).
- ``dp``: 4 blocks 64 -> 256 -> 64 and 4096 rows, nothing fixed, no budget: the plan vs hand
  data parallelism (parameters broadcast, batch ``split(0)``).
- ``mlp_budget``, ``llama_budget``: the ``mlp`` and ``llama`` models, nothing fixed, under
  a budget clearly below the replicated layout's predicted peak (parameters broadcast,
  batch split; a quarter of its parameter, gradient and optimizer-state bytes taken off:
  sharding them all over 2 ranks saves half): the plan vs the hand layouts the issue
  names, hand data parallelism, sbpflow ``fully_shard`` (each block or decoder layer, then
  the root; batch ``split(0)``) and the Megatron / torchtitan layout (batch broadcast).
  The plan is compared with the fastest of those whose measured peak fits the budget, and
  its own measured peak with the budget. (The ``fsdp`` case these replace, 4 blocks 64 ->
  256 -> 64 over 4096 rows, is no budget test: its activations are 20 of its 25 MiB and
  the step peaks in the loss's backward, before any gradient exists, so sharding every
  parameter and its optimizer state saves 0.75 MiB of the peak, 3%, less than its
  prediction's margin; its replicated layout measured within the budget it was given.)

On the 2x2 mesh (``--meshes 2x2``: 4 ranks, axis 0 data, axis 1 tensor parallel), the
``mlp`` and ``llama`` cases again, the batch fixed ``(split(0), broadcast)``: the plan vs
sbpflow's hand layout on axis 1 (Megatron / torchtitan's) broadcast on axis 0 (data
parallel, its gradients all-reduced in the default buckets) vs DTensor ``parallelize_module``
with the same plan on the ``tp`` sub-mesh of a ``(2, 2)`` DeviceMesh, wrapped in DDP over
the ``dp`` sub-mesh (``_pre_dp_module_transform``, torch's way of composing the two), each
rank fed its data-axis piece of the batch (its loss averaged over the data axis for the
check). 4 ranks on a 2-core host are slow: ``--reps-2x2`` (default 3) steps per run.

Measured per variant: the median step (the slower rank's), the collectives one step ran
(``sbpflow.boxing.trace``; DTensor's are not traced), the peak bytes of one step (the CPU
allocator's largest net growth during the step, from torch.profiler's memory events, on
top of what the rank holds at its start) and the bytes one rank holds in parameters,
gradients and optimizer state after a step (local pieces, the larger rank's). Every
variant's first loss must equal one plain process's.

Usage (from the repository root)::

    python bench/auto_parallel/run.py                            # 3 runs of 5 repetitions
    python bench/auto_parallel/run.py --runs 1 --reps 5          # a quick run
    python bench/auto_parallel/run.py --meshes 2x2 --cases mlp   # the 2x2 rows only
    python bench/auto_parallel/run.py --out docs/benchmarks.md   # write the docs section
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from sbpflow._global import GlobalTensor  # noqa: E402
from sbpflow.auto_parallel import calibrate_compute, reprice  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

WARMUP = 2
PLAN = "auto_parallel plan"
START, END = "<!-- bench:auto_parallel:start -->", "<!-- bench:auto_parallel:end -->"
CASES = ("mlp", "llama", "dp", "mlp_budget", "llama_budget")
BUDGET_CASES = ("mlp_budget", "llama_budget")
# of the replicated layout's parameter, gradient and optimizer-state bytes, what a budget
# case's budget takes off its predicted peak (sharding them all over 2 ranks saves half)
BUDGET_CUT = 0.25
# mesh shapes: "2" is 2 ranks (every case), "2x2" 4 ranks, axis 0 data and axis 1 tensor
# parallel (the mlp and llama cases, the batch split on axis 0 and broadcast on axis 1)
MESHES = {"2": (2,), "2x2": (2, 2)}
CASES_2D = ("mlp", "llama")
# collective block sizes the calibration times: the bench's tensors are 4 KiB to 2 MiB
CALIBRATION_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)


class Block(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, inner)
        self.down = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _mlp(dim: int, inner: int, rows: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim, inner) for _ in range(4)])
    return model, torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))


def _llama() -> tuple[nn.Module, torch.Tensor]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(1))
    return model, ids


def _data_parallel_too(layout: Callable[[str, torch.Tensor], Any]) -> Callable[..., Any]:
    """A 1-D tensor-parallel layout on axis 1 of a 2x2 mesh, broadcast on the data axis 0."""

    def both(name: str, t: torch.Tensor) -> Any:
        return (broadcast, layout(name, t))

    return both


def megatron_mlp(name: str, _t: torch.Tensor) -> Any:
    if name.endswith(("up.weight", "up.bias")):
        return split(0)
    return split(1) if name.endswith("down.weight") else broadcast


def torchtitan_llama(name: str, _t: torch.Tensor) -> Any:
    module = name.split(".")[-2]
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return split(0)
    return split(1) if module in ("o_proj", "down_proj") else broadcast


def _output(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _step_fn(model: nn.Module, inputs: Any) -> Callable[[], torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _output(model(inputs)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    step.optimizer = opt  # type: ignore[attr-defined]
    step.model = model  # type: ignore[attr-defined]
    return step


def _state_bytes(step: Any) -> float:
    """Bytes this rank holds in parameters, gradients and optimizer state (local pieces)."""

    def local(t: torch.Tensor) -> float:
        if isinstance(t, (GlobalTensor, DTensor)):
            t = t.to_local()
        return float(t.numel() * t.element_size())

    total = 0.0
    for p in step.model.parameters():
        total += local(p.detach())
        if p.grad is not None:
            total += local(p.grad)
    for state in step.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                total += local(value)
    return total


def _dtensor(model: nn.Module, layers: Any, plan: dict[str, Any], mesh: tuple[int, ...]) -> Any:
    """DTensor ``parallelize_module`` of each of ``layers`` with ``plan`` on the tensor axis
    (the last); on a 2x2 mesh, DDP over the data axis too (``_pre_dp_module_transform``:
    torch's way of composing them). Returns the model and the process group its loss is
    averaged over (None: the loss is whole on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    names = ("dp", "tp") if len(mesh) == 2 else ("tp",)
    device_mesh = init_device_mesh("cpu", mesh, mesh_dim_names=names)
    for layer in layers:
        parallelize_module(layer, device_mesh["tp"], plan)
    if len(mesh) == 1:
        return model, None
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel

    _pre_dp_module_transform(model)
    group = device_mesh["dp"].get_group()
    return DistributedDataParallel(model, process_group=group), group


def _peak_bytes(step: Any, inputs: Any) -> float:
    """This rank's peak bytes in one step: what it holds at the start (parameters,
    optimizer state, the batch; gradients are cleared first, as the step's zero_grad would)
    plus the CPU allocator's largest net growth during the step, read from torch.profiler's
    memory events ("Total Allocated", taken from its value before the step's first event:
    the profiler keeps counting across sessions)."""
    from torch.profiler import ProfilerActivity, profile

    step.optimizer.zero_grad()
    start = _state_bytes(step) + sum(_local_bytes(x) for x in _leaves(inputs))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and "Total Allocated" in e["args"]),
        key=lambda e: e["ts"],
    )
    if not memory:
        return start
    base = float(memory[0]["args"]["Total Allocated"]) - float(memory[0]["args"]["Bytes"])
    return start + max(0.0, *(float(e["args"]["Total Allocated"]) - base for e in memory))


def _local_bytes(t: torch.Tensor) -> float:
    if isinstance(t, (GlobalTensor, DTensor)):
        t = t.to_local()
    return float(t.numel() * t.element_size())


def _leaves(inputs: Any) -> list[torch.Tensor]:
    return [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)


def _calibrated(placement: Any, clock: str = "wall") -> tuple[Any, Any]:
    """This machine's collective and compute prices, measured on every rank (rank 0's
    broadcast); the runtime's own boxing keeps the default constants. ``clock="cpu"`` times
    them in this process's CPU time (``time.perf_counter`` stands in for
    ``time.process_time`` meanwhile: a benchmark's device, not the library's), which other
    jobs on a shared machine hardly move, to set beside each step's CPU time."""
    from sbpflow.boxing import cost

    wall = time.perf_counter
    if clock == "cpu":
        time.perf_counter = time.process_time  # type: ignore[assignment]
    try:
        collectives = sbpflow.boxing.calibrate(placement, sizes=CALIBRATION_SIZES, save=False)
        compute = calibrate_compute(
            placement, repeats=11 if clock == "cpu" else 5, cost_model=collectives.model
        )
    finally:
        time.perf_counter = wall  # type: ignore[assignment]
    cost.reset()
    return collectives.model, compute


def _placement(mesh: tuple[int, ...]) -> Any:
    ranks = torch.arange(math.prod(mesh)).reshape(mesh).tolist()
    return sbpflow.placement("cpu", ranks)


def _variants(
    case: str, mesh: tuple[int, ...]
) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, Any]]:
    """The step of each variant, and what to report: the plan's predictions, the losses."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    placement = _placement(mesh)
    two_d = len(mesh) == 2
    whole = placement, (broadcast,) * len(mesh)
    # the batch as the runtime gets it: broadcast (1-D), split on the data axis (2x2)
    batch_sbp = (split(0), broadcast) if two_d else (broadcast,)
    # the local batch of a DTensor rank: its data-axis piece on the 2x2 mesh
    local = slice(None)
    if case.startswith("llama"):
        base, x = _llama()
    elif case.startswith("mlp"):
        base, x = _mlp(256, 1024, 512)
    else:
        base, x = _mlp(64, 256, 4096)
    if two_d:
        rows = x.shape[0] // mesh[0]
        start = dist.get_rank() // mesh[1] * rows
        local = slice(start, start + rows)
    budget = None
    fixed = {0: batch_sbp} if case in ("mlp", "llama") else None
    if case in BUDGET_CASES:
        budget = _budget(base, placement, x)
    plan = sbpflow.auto_parallel(
        base,
        placement,
        x,
        fixed=fixed,
        memory_budget=budget,
    )
    planned = plan.apply(copy.deepcopy(base))
    gx = x.to_global(*whole).to_global(sbp=plan.input_sbp[0])
    steps = {PLAN: _step_fn(planned, gx)}
    batches = {PLAN: gx}
    groups: dict[str, Any] = {}  # the DTensor variant's loss is its data-axis piece's
    if case in ("mlp", "llama"):
        hand_name, dt_name, tp_layout = (
            ("sbpflow hand Megatron", "DTensor parallelize_module", megatron_mlp)
            if case == "mlp"
            else (
                "sbpflow hand torchtitan layout",
                "DTensor parallelize_module (torchtitan plan)",
                torchtitan_llama,
            )
        )
        if two_d:
            hand_name = hand_name.replace("hand", "hand data parallel x")
            dt_name += " + DDP"
            tp_layout = _data_parallel_too(tp_layout)
        hand = copy.deepcopy(base).to_global(*whole).to_global(placement, tp_layout)
        batches[hand_name] = x.to_global(*whole).to_global(sbp=batch_sbp)
        steps[hand_name] = _step_fn(hand, batches[hand_name])
        if case == "mlp":
            tp = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        else:
            tp = {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            }
        dt = copy.deepcopy(base)
        layers = dt if case == "mlp" else dt.model.layers
        dt, groups[dt_name] = _dtensor(dt, layers, tp, mesh)
        steps[dt_name] = _step_fn(dt, x[local])
        batches[dt_name] = x[local]
    elif case == "dp":
        hand = copy.deepcopy(base).to_global(*whole)
        batches["sbpflow hand data parallel"] = x.to_global(*whole).to_global(sbp=split(0))
        steps["sbpflow hand data parallel"] = _step_fn(hand, batches["sbpflow hand data parallel"])
    else:
        from sbpflow.nn.parallel import fully_shard

        hand = copy.deepcopy(base).to_global(*whole)
        batches["sbpflow hand data parallel"] = x.to_global(*whole).to_global(sbp=split(0))
        steps["sbpflow hand data parallel"] = _step_fn(hand, batches["sbpflow hand data parallel"])
        sharded = copy.deepcopy(base)
        for block in sharded if case == "mlp_budget" else sharded.model.layers:
            fully_shard(block, placement)
        fully_shard(sharded, placement)
        batches["sbpflow fully_shard"] = x.to_global(*whole).to_global(sbp=split(0))
        steps["sbpflow fully_shard"] = _step_fn(sharded, batches["sbpflow fully_shard"])
        name, layout = (
            ("sbpflow hand Megatron", megatron_mlp)
            if case == "mlp_budget"
            else ("sbpflow hand torchtitan layout", torchtitan_llama)
        )
        hand = copy.deepcopy(base).to_global(*whole).to_global(placement, layout)
        batches[name] = x.to_global(*whole)
        steps[name] = _step_fn(hand, batches[name])
    want = float(_output(base(x)).pow(2).mean())
    losses = {name: _loss(step(), groups.get(name)) for name, step in steps.items()}  # untimed
    memory = plan.memory
    record = {
        "want": want,
        "losses": losses,
        "predicted_ms": plan.step_seconds * 1e3,
        "predicted_peak": memory.peak,
        "predicted_state": memory.parameters + memory.gradients + memory.optimizer_state,
        "budget": budget,
        "layouts": sorted({str(s) for s in plan.param_sbp.values()}),
        "collectives": _count(c for c in plan.collectives() if c.is_collective),
        "batches": batches,
        "repriced": (plan, base, x),
    }
    return steps, record


def _budget(model: nn.Module, placement: Any, x: torch.Tensor) -> float:
    """A budget clearly under the replicated layout's predicted peak (parameters broadcast,
    the batch split: data parallelism): ``BUDGET_CUT`` of its parameter, gradient and
    optimizer-state bytes taken off."""
    pins: dict[Any, Any] = {name: broadcast for name, _ in model.named_parameters()}
    pins[0] = split(0)
    replicated = sbpflow.auto_parallel(model, placement, x, fixed=pins).memory
    state = replicated.parameters + replicated.gradients + replicated.optimizer_state
    return replicated.peak - BUDGET_CUT * state


def _loss(loss: torch.Tensor, group: Any) -> float:
    """The whole batch's loss: a data-parallel piece's averaged over its group (equal pieces)."""
    if group is not None:
        loss = loss.clone()
        dist.all_reduce(loss, group=group)
        loss /= dist.get_world_size(group)
    return float(loss)


def _count(ops: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for c in ops:
        op = c if isinstance(c, str) else c.op
        found[op] = found.get(op, 0) + 1
    return dict(sorted(found.items()))


def _worker(
    rank: int, port: int, mesh: tuple[int, ...], cases: list[str], reps: int, queue: Any
) -> None:
    join_world(rank, math.prod(mesh), port)
    warnings.filterwarnings("ignore")
    results = {}
    placement = _placement(mesh)
    for case in cases:
        steps, record = _variants(case, mesh)
        # the plan's strategies, op by op, priced with this machine's constants measured
        # just before and just after the case's steps (the load drifts), averaged
        before = _calibrated(placement)
        before_cpu = _calibrated(placement, "cpu")
        times, cpu = interleaved_step_times(steps, WARMUP, reps)
        after = _calibrated(placement)
        after_cpu = _calibrated(placement, "cpu")
        plan, base, x = record.pop("repriced")
        priced = [
            reprice(plan, base, x, cost_model=cost, compute_model=compute)
            for cost, compute in (before, after)
        ]
        record["calibrated_ms"] = statistics.mean(p.step_seconds for p in priced) * 1e3
        record["cpu_ms"] = statistics.median(cpu[PLAN])
        record["calibrated_cpu_ms"] = 1e3 * statistics.mean(
            reprice(plan, base, x, cost_model=cost, compute_model=compute).step_seconds
            for cost, compute in (before_cpu, after_cpu)
        )
        record["calibrated_parts"] = [
            statistics.mean(getattr(p, part) for p in priced) * 1e3
            for part in ("compute_seconds", "boxing_seconds", "optimizer_seconds")
        ]
        record["compute_model"] = f"{before[1]}, {after[1]}"
        held, peak, ran = {}, {}, {}
        batches = record.pop("batches")
        for name, step in steps.items():
            with sbpflow.boxing.trace() as traced:
                step()
            ran[name] = _count(traced.collectives().elements())
            mine = torch.tensor(
                [_state_bytes(step), _peak_bytes(step, batches[name])], dtype=torch.float64
            )
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            held[name], peak[name] = mine.tolist()
        record.update(held=held, peak=peak, ran=ran)
        results[case] = (times, record)
    if rank == 0:
        queue.put(results)
    dist.barrier()


def _one_run(mesh: tuple[int, ...], cases: list[str], reps: int) -> dict[str, Any]:
    """One spawn of the mesh's ranks, every case in it."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker,
        args=(free_port(), mesh, cases, reps, queue),
        nprocs=math.prod(mesh),
        start_method="spawn",
    )
    return queue.get()


def _ops(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in counts.items()) or "none"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed steps per variant and run")
    parser.add_argument("--runs", type=int, default=3, help="whole runs, fresh processes each")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument(
        "--meshes",
        type=lambda text: text.split(","),
        default=list(MESHES),
        help=f"comma-separated mesh shapes among {', '.join(MESHES)} (2x2: mlp and llama)",
    )
    parser.add_argument(
        "--reps-2x2", type=int, default=3, help="timed steps per variant and run on 2x2"
    )
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args()
    unknown = [m for m in args.meshes if m not in MESHES]
    if unknown:
        parser.error(f"--meshes: unknown {unknown}; expected some of {', '.join(MESHES)}")
    load_start = os.getloadavg()[0]
    lines: list[str] = []
    jobs = []  # (mesh name, case, each run's (times, record))
    for mesh_name in args.meshes:
        mesh = MESHES[mesh_name]
        cases = [c for c in args.cases if len(mesh) == 1 or c in CASES_2D]
        reps = args.reps if len(mesh) == 1 else args.reps_2x2
        results = [_one_run(mesh, cases, reps) for _ in range(args.runs)] if cases else []
        jobs += [(mesh_name, case, [r[case] for r in results]) for case in cases]
    for mesh_name, case, runs in jobs:
        medians: dict[str, list[float]] = {}
        record: dict[str, Any] = {}
        for times, record in runs:
            for name, loss in record["losses"].items():
                want = record["want"]
                assert abs(loss - want) <= 1e-4 * max(1.0, abs(want)), (case, name, loss, want)
            for name, ms in times.items():
                medians.setdefault(name, []).append(statistics.median(ms))
        step = {name: statistics.median(ms) for name, ms in medians.items()}
        peaks = {name: statistics.median(r[1]["peak"][name] for r in runs) for name in step}
        predicted_ms = statistics.median(r[1]["calibrated_ms"] for r in runs)
        predicted_cpu = statistics.median(r[1]["calibrated_cpu_ms"] for r in runs)
        cpu_ms = statistics.median(r[1]["cpu_ms"] for r in runs)
        parts = [statistics.median(r[1]["calibrated_parts"][i] for r in runs) for i in range(3)]
        budget = record["budget"]
        # under a budget, the hand variants whose measured peak fits it
        fitting = [v for k, v in step.items() if k != PLAN and (not budget or peaks[k] <= budget)]
        best_hand = min(fitting) if fitting else math.nan
        rows = [
            f"### {case}" + ("" if mesh_name == "2" else f" on {mesh_name}"),
            "",
            f"Plan: parameter layouts {', '.join(record['layouts'])}; predicted step "
            f"{record['predicted_ms']:.1f} ms by the default prices, {predicted_ms:.1f} ms by "
            f"this machine's (median over runs; compute {parts[0]:.1f}, boxing {parts[1]:.1f}, "
            f"optimizer {parts[2]:.1f}), predicted peak {_mib(record['predicted_peak'])} "
            f"MiB per rank, of which parameters, gradients and optimizer state "
            f"{_mib(record['predicted_state'])} MiB"
            + (f"; budget {_mib(record['budget'])} MiB." if record["budget"] else ".")
            + f" Predicted collectives per step: {_ops(record['collectives'])}. Measured "
            f"compute prices (last run, before and after): {record['compute_model']}.",
            "",
            "| variant | median step ms (median of runs) | each run's median ms | / plan | "
            "collectives per step (rank 0) | measured peak MiB per rank | "
            "parameter + gradient + optimizer state MiB per rank |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, ms in step.items():
            each = ", ".join(f"{m:.0f}" for m in medians[name])
            rows.append(
                f"| {name} | {ms:.1f} | {each} | {ms / step[PLAN]:.2f} | "
                f"{_ops(record['ran'][name])} | {_mib(peaks[name])} | "
                f"{_mib(record['held'][name])} |"
            )
        fits = ""
        if budget:
            fits = (
                f" that fits the budget (measured peak <= {_mib(budget)} MiB: "
                f"{', '.join(k for k in step if k != PLAN and peaks[k] <= budget) or 'none'})"
            )
            fits += f"; the plan's measured peak is {peaks[PLAN] / budget:.3f}x the budget"
        rows += [
            "",
            f"Plan over the best hand variant{fits}: {step[PLAN] / best_hand:.2f}x; predicted over "
            f"measured step (measured prices): {predicted_ms / step[PLAN]:.2f}x; the same in "
            f"CPU time (prices timed in CPU time, the plan's median CPU ms per step, median "
            f"over runs): {predicted_cpu:.1f} / {cpu_ms:.1f} = {predicted_cpu / cpu_ms:.2f}x; "
            "predicted "
            "over measured peak "
            f"memory: {record['predicted_peak'] / peaks[PLAN]:.2f}x; predicted over measured "
            f"state bytes: {record['predicted_state'] / record['held'][PLAN]:.2f}x.",
            "",
        ]
        print("\n".join(rows), flush=True)
        lines += rows
    load = f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (1 min)"
    print(f"load average {load}")
    if args.out:
        text = [
            START,
            "## Auto-parallel: the plan vs hand-written layouts",
            "",
            f"Machine: `{machine()}`; gloo ranks on this host (2, or 4 on the 2x2 mesh), one "
            "thread each. The "
            "machine is shared with other jobs and noisy: step times move by tens of percent "
            "between runs.",
            "",
            f"Load average {load}. {args.runs} run(s) of {args.reps} timed steps per variant "
            f"({args.reps_2x2} on the 2x2 mesh) "
            f"after {WARMUP} warmup, variants interleaved; AdamW, fp32, mean-square loss of "
            "the output. Each case measures this machine's prices on every rank, just before "
            "and just after its steps "
            "(`sbpflow.boxing.calibrate` over 4 KiB-4 MiB blocks, "
            "`sbpflow.auto_parallel.calibrate_compute`); the plans are made with the "
            "default prices (deterministic), and the predicted step is their strategies "
            "priced with the measured ones (`reprice`, before and after averaged), median "
            "over runs. Measured peak: the CPU allocator's largest "
            "net growth during one step (torch.profiler memory events) on top of the "
            "parameters, optimizer state and batch held at its start (gradients cleared "
            "first), the larger rank's; DTensor's collectives are not traced. "
            "See bench/auto_parallel/run.py for the cases.",
            "",
            f"Reproduce: `python bench/auto_parallel/run.py --meshes {','.join(args.meshes)} "
            f"--runs {args.runs} --reps {args.reps} --reps-2x2 {args.reps_2x2} --out {args.out}`",
            "",
            *lines,
            END,
        ]
        write_section(args.out, "\n".join(text), START, END)


if __name__ == "__main__":
    main()
