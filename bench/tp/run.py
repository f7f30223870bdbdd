"""Tensor-parallel step time and communication: sbpflow vs DTensor's ``parallelize_module``.

One run spawns 2 gloo ranks on this machine; each trains the same model, 4 residual blocks
``x + down(GELU(up(LayerNorm(x))))`` (256 -> 1024 -> 256, 512 rows, the input broadcast), one
SGD step at a time (zero_grad, forward, mean-square loss, backward, optimizer.step), with

- DTensor: each block ``parallelize_module(block, mesh, {"up": ColwiseParallel(), "down":
  RowwiseParallel()})``, the baseline of the ratios;
- sbpflow: the Megatron layout given to ``Module.to_global`` and nothing else (``up``
  weight and bias ``split(0)``, ``down.weight`` ``split(1)``, everything else broadcast;
  converted as broadcast first, then boxed). No plan: layout propagation finds the
  collectives.

Before timing, one untimed step of each is recorded: DTensor's under ``CommDebugMode``
(extended here to add up bytes), sbpflow's under ``sbpflow.boxing.trace()``. Both count
the collectives of a step by kind and the bytes the busiest rank sends, priced alike
(all_reduce 2(p-1)/p of the tensor, all_gather and reduce_scatter (p-1)/p of the whole
tensor). The first steps' losses of the two must agree.

The variants are interleaved (NOTE [timing] in bench/boxing/run.py): every repetition runs
each once, in an order rotating from one repetition to the next; a step starts after a
barrier and its time is the slower rank's. Warmup steps are dropped. The CPU time of a step
(``time.process_time``: every thread of the rank's process, gloo's included; the slower
rank's) is shown too: the machine's other load disturbs it much less than the step time.
``--runs`` repeats the whole run (fresh processes); the target (sbpflow's median step at
most 1.00x DTensor's) is judged on the median of the runs' median ratios and on the worst
run, and the collectives and bytes of a step on sbpflow's being at most DTensor's.

Usage (from the repository root)::

    python bench/tp/run.py                                # 3 runs of 20 repetitions
    python bench/tp/run.py --runs 1 --reps 5              # a quick run
    python bench/tp/run.py --out docs/benchmarks.md       # write the docs section
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, verdict, write_section  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

HIDDEN, INNER, ROWS, BLOCKS = 256, 1024, 512, 4
WARMUP = 3
WORLD = 2
BASELINE = "DTensor parallelize_module"
SBPFLOW = "sbpflow, layout only"
TARGET = 1.00
START, END = "<!-- bench:tp:start -->", "<!-- bench:tp:end -->"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, INNER)
        self.down = nn.Linear(INNER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def make_model() -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def megatron(name: str, tensor: torch.Tensor) -> Any:
    """``up`` column-parallel, ``down`` row-parallel (its bias, added after the sum, broadcast)."""
    if name.endswith(("up.weight", "up.bias")):
        return split(0)
    if name.endswith("down.weight"):
        return split(1)
    return broadcast


class CommBytesMode(CommDebugMode):
    """``CommDebugMode`` that also adds up the bytes the busiest rank sends per collective."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_sent = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented:
            self.bytes_sent += _funcol_bytes(str(func), args)
        return out


def _funcol_bytes(name: str, args: Any) -> float:
    """Bytes sent by each rank of a functional collective, priced as sbpflow's planner does."""
    if "_c10d_functional" not in name and "c10d_functional" not in name:
        return 0.0
    tensor = args[0]
    if not isinstance(tensor, torch.Tensor):
        return 0.0
    size = tensor.numel() * tensor.element_size()
    p = WORLD
    if "all_reduce" in name:
        return 2 * (p - 1) / p * size
    if "all_gather" in name:
        return (p - 1) / p * size * p
    if "reduce_scatter" in name:
        return (p - 1) / p * size
    if "all_to_all" in name:
        return (p - 1) / (p * p) * size
    return 0.0


def _sbpflow_bytes(trace: Any) -> float:
    return float(
        sum(
            step.bytes_per_rank for plan in trace.plans for step in plan.steps if step.is_collective
        )
    )


def _variants(world: int) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, Any]]:
    """The step of each variant (returning its loss, never read while timed: reading a
    global value is a collective) and a record of one step of each."""
    torch.manual_seed(0)
    base = make_model()
    x = torch.randn(ROWS, HIDDEN)
    placement = sbpflow.placement("cpu", list(range(world)))
    mesh = init_device_mesh("cpu", (world,))

    dtensor_model = copy.deepcopy(base)
    for block in dtensor_model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    sbp_model = copy.deepcopy(base).to_global(placement, broadcast).to_global(placement, megatron)
    gx = x.to_global(placement, broadcast)

    def step_fn(model: nn.Module, inputs: Any) -> Callable[[], torch.Tensor]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = model(inputs).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    steps = {BASELINE: step_fn(dtensor_model, x), SBPFLOW: step_fn(sbp_model, gx)}
    with CommBytesMode() as comm:
        want = float(steps[BASELINE]())
    with sbpflow.boxing.trace() as t:
        got = float(steps[SBPFLOW]())
    record = {
        "losses": (want, got),
        BASELINE: (
            {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()},
            comm.bytes_sent,
        ),
        SBPFLOW: (dict(t.collectives()), _sbpflow_bytes(t)),
        "fallbacks": list(t.fallbacks),
    }
    return dict(steps), record


def _worker(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    # DTensor's module hooks on blocks whose input needs no gradient (the first one) warn.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    variants, record = _variants(world)
    times, record["cpu_times"] = interleaved_step_times(variants, WARMUP, reps)
    if rank == 0:
        queue.put((times, record))
    dist.barrier()


def _one_run(reps: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(WORLD, free_port(), reps, queue), nprocs=WORLD, start_method="spawn"
    )
    return queue.get()


def _comm_rows(record: dict[str, Any]) -> tuple[list[str], bool]:
    rows = ["| variant | collectives per step | by kind | KiB sent per rank |", "|---|---|---|---|"]
    for name in (BASELINE, SBPFLOW):
        counts, nbytes = record[name]
        kinds = ", ".join(f"{op} {n}" for op, n in sorted(counts.items())) or "none"
        rows.append(f"| {name} | {sum(counts.values())} | {kinds} | {nbytes / 1024:.0f} |")
    (base_counts, base_bytes), (counts, nbytes) = record[BASELINE], record[SBPFLOW]
    ok = sum(counts.values()) <= sum(base_counts.values()) and nbytes <= base_bytes
    return rows, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed steps per variant and run")
    parser.add_argument("--runs", type=int, default=3, help="whole runs, fresh processes each")
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    header = [
        f"Machine: `{machine()}`; {WORLD} gloo ranks on this host, one thread each.",
        "",
        f"{BLOCKS} residual blocks `x + down(GELU(up(LayerNorm(x))))` ({HIDDEN} -> {INNER} -> "
        f"{HIDDEN}), {ROWS} rows, input broadcast, fp32, SGD; {args.reps} timed steps per "
        f"variant and run after {WARMUP} warmup, variants interleaved; a step's time is the "
        "slower rank's.",
    ]
    print("\n".join(header), flush=True)
    ratios, tables, comm_ok = [], [], []
    comm_rows: list[str] = []
    for run in range(args.runs):
        times, record = _one_run(args.reps)
        want, got = record["losses"]
        assert abs(want - got) <= 1e-5 * max(1.0, abs(want)), f"losses differ: {want} vs {got}"
        assert not record["fallbacks"], record["fallbacks"]
        base_med = statistics.median(times[BASELINE])
        cpu = {name: statistics.median(ms) for name, ms in record["cpu_times"].items()}
        rows = [
            "| variant | min ms | median ms | / DTensor (median) | CPU ms (median) "
            "| CPU / DTensor |",
            "|---|---|---|---|---|---|",
        ]
        for name, ms in times.items():
            med = statistics.median(ms)
            rows.append(
                f"| {name} | {min(ms):.1f} | {med:.1f} | {med / base_med:.2f} | {cpu[name]:.1f} "
                f"| {cpu[name] / cpu[BASELINE]:.2f} |"
            )
        ratios.append(statistics.median(times[SBPFLOW]) / base_med)
        tables.append(rows)
        comm_rows, ok = _comm_rows(record)
        comm_ok.append(ok)
        print(f"\nrun {run + 1} of {args.runs} (load average {os.getloadavg()[0]:.1f})")
        print(f"first step's loss: DTensor {want:.6f}, sbpflow {got:.6f}")
        print("\n".join([*rows, "", *comm_rows]), flush=True)
    load = f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (1 min)"
    summary = ["| run | sbpflow / DTensor (median step) |", "|---|---|"]
    summary += [f"| {run + 1} | {r:.2f} |" for run, r in enumerate(ratios)]
    verdicts = [
        verdict("step time", TARGET, ratios),
        "- collectives and bytes per step at most DTensor's: "
        f"{'met' if all(comm_ok) else 'missed'} in {sum(comm_ok)} of {len(comm_ok)} runs",
    ]
    print(f"\nload average {load}\n" + "\n".join([*summary, "", *verdicts]))
    if args.out:
        lines = [
            START,
            "## Tensor parallelism: sbpflow's layout propagation vs DTensor's parallelize_module",
            "",
            *header,
            "",
            f"Load average {load}.",
            "",
            f"Reproduce: `python bench/tp/run.py --runs {args.runs} --reps {args.reps} "
            f"--out {args.out}`",
            "",
            "Communication of one step (every run alike):",
            "",
            *comm_rows,
            "",
            "Median step time over DTensor's, each run:",
            "",
            *summary,
            "",
            *verdicts,
            "",
            f"Run {args.runs} in full:",
            "",
            *tables[-1],
            END,
        ]
        write_section(args.out, "\n".join(lines), START, END)


if __name__ == "__main__":
    main()
