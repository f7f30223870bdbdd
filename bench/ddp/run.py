"""Data-parallel step time: torch DDP vs sbpflow DDP vs sbpflow global-tensor data parallelism.

One run spawns 2 gloo ranks on this machine; each trains the same MLP (~10M parameters,
fp32) one SGD step at a time (zero_grad, forward, MSE loss, backward, optimizer.step) with

- torch DDP: ``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)``, otherwise
  its defaults (gradient_as_bucket_view=False): the baseline of the ratios. A cap given
  applies to every bucket, the first one included (both libraries' rule);
- torch DDP, bucket view: the same with ``gradient_as_bucket_view=True``, for reference;
- sbpflow DDP: ``sbpflow.nn.parallel.DistributedDataParallel`` (bucket_cap_mb=25);
- sbpflow global DP: the model ``to_global(placement, broadcast)`` with
  ``sync_gradients(model)``; each rank's batch made global ``split(0)`` in the hot-loop form
  (``shape=`` the logical shape, ``check_meta=False``: no metadata exchange);
- sbpflow global DP, checked batch: the same with the batch made global by
  ``to_global_batch`` (the default ``check_meta=True``: one metadata exchange per tensor);
- sbpflow global DP, per-parameter: without ``sync_gradients`` (one synchronous all_reduce
  per parameter in its gradient hook), for reference.

The variants are interleaved (NOTE [timing] in bench/boxing/run.py): every repetition runs
each once, in an order rotating from one repetition to the next; a step starts after a
barrier and its time is the maximum over ranks. Warmup steps are dropped; min and median
over repetitions are printed, with their ratios to torch DDP's, and the median CPU time of
a step (``time.process_time``: every thread of the rank's process, gloo's included; the
slower rank's), which the machine's other load disturbs much less than the step time. ``--runs`` repeats the
whole run (fresh processes); the targets are judged on each run's median ratios.

Usage (from the repository root)::

    python bench/ddp/run.py                                # 3 runs of 20 repetitions
    python bench/ddp/run.py --runs 1 --reps 5              # a quick run
    python bench/ddp/run.py --out docs/benchmarks.md       # write the docs section
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from sbpflow.nn.parallel import DistributedDataParallel, sync_gradients  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402
from sbpflow.utils.data import to_global_batch  # noqa: E402

WIDTHS = (1024, 2048, 2048, 1024, 1024)  # 9.4M parameters
BATCH_PER_RANK = 32
WARMUP = 3
WORLD = 2
BASELINE = "torch DDP"
# name -> the target on its median ratio to torch DDP's (None: shown for reference)
TARGETS: dict[str, float | None] = {
    BASELINE: None,
    "torch DDP, bucket view": None,
    "sbpflow DDP": 1.00,
    "sbpflow global DP": 1.05,
    "sbpflow global DP, checked batch": None,
    "sbpflow global DP, per-parameter": None,
}
START, END = "<!-- bench:ddp:start -->", "<!-- bench:ddp:end -->"


def make_mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _variants(world: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    base = make_mlp()
    placement = sbpflow.placement("cpu", list(range(world)))
    x = torch.randn(BATCH_PER_RANK, WIDTHS[0])
    y = torch.randn(BATCH_PER_RANK, WIDTHS[-1])
    loss_fn = nn.MSELoss()

    def step_fn(model: nn.Module, inputs: Callable[[], tuple[Any, Any]]) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            xb, yb = inputs()
            loss_fn(model(xb), yb).backward()
            opt.step()

        return step

    def local_batch() -> tuple[Any, Any]:
        return x, y

    def global_batch() -> tuple[Any, Any]:
        return tuple(  # type: ignore[return-value]
            t.to_global(
                placement, split(0), shape=(world * t.shape[0], t.shape[1]), check_meta=False
            )
            for t in (x, y)
        )

    def checked_global_batch() -> tuple[Any, Any]:
        return to_global_batch((x, y), placement)

    def global_model() -> nn.Module:
        return copy.deepcopy(base).to_global(placement, broadcast)

    synced, synced_checked = global_model(), global_model()
    sync_gradients(synced, bucket_cap_mb=25)
    sync_gradients(synced_checked, bucket_cap_mb=25)
    torch_ddp = nn.parallel.DistributedDataParallel
    variants = {
        BASELINE: step_fn(torch_ddp(copy.deepcopy(base), bucket_cap_mb=25), local_batch),
        "torch DDP, bucket view": step_fn(
            torch_ddp(copy.deepcopy(base), bucket_cap_mb=25, gradient_as_bucket_view=True),
            local_batch,
        ),
        "sbpflow DDP": step_fn(
            DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=25), local_batch
        ),
        "sbpflow global DP": step_fn(synced, global_batch),
        "sbpflow global DP, checked batch": step_fn(synced_checked, checked_global_batch),
        "sbpflow global DP, per-parameter": step_fn(global_model(), global_batch),
    }
    assert list(variants) == list(TARGETS)
    return variants


def _worker(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    times, cpu_times = interleaved_step_times(_variants(world), WARMUP, reps)
    if rank == 0:
        queue.put((times, cpu_times))
    dist.barrier()


def _one_run(reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times and CPU times (ms, the slower rank's) of each variant."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(WORLD, free_port(), reps, queue), nprocs=WORLD, start_method="spawn"
    )
    return queue.get()


def _table(
    times: dict[str, list[float]], cpu_times: dict[str, list[float]]
) -> tuple[list[str], dict[str, float]]:
    """Markdown rows of one run, and each variant's median ratio to the baseline."""
    base_min, base_med = min(times[BASELINE]), statistics.median(times[BASELINE])
    base_cpu = statistics.median(cpu_times[BASELINE])
    rows = [
        "| variant | min ms | median ms | / torch DDP (min) | / torch DDP (median) "
        "| CPU ms (median) | CPU / torch DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for name, ms in times.items():
        lo, med, cpu = min(ms), statistics.median(ms), statistics.median(cpu_times[name])
        ratios[name] = med / base_med
        rows.append(
            f"| {name} | {lo:.1f} | {med:.1f} | {lo / base_min:.2f} | {med / base_med:.2f} "
            f"| {cpu:.1f} | {cpu / base_cpu:.2f} |"
        )
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed steps per variant and run")
    parser.add_argument("--runs", type=int, default=3, help="whole runs, fresh processes each")
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    num_params = sum(p.numel() for p in make_mlp().parameters())
    header = [
        f"Machine: `{machine()}`; {WORLD} gloo ranks on this host, one thread each.",
        "",
        f"MLP {' -> '.join(map(str, WIDTHS))} ({num_params / 1e6:.1f}M parameters, fp32), "
        f"batch {BATCH_PER_RANK} per rank, SGD; {args.reps} timed steps per variant and run "
        f"after {WARMUP} warmup, variants interleaved; a step's time is the slower rank's.",
    ]
    print("\n".join(header), flush=True)
    per_run: list[dict[str, float]] = []
    tables: list[list[str]] = []
    for run in range(args.runs):
        rows, ratios = _table(*_one_run(args.reps))
        per_run.append(ratios)
        tables.append(rows)
        print(f"\nrun {run + 1} of {args.runs} (load average {os.getloadavg()[0]:.1f})")
        print("\n".join(rows), flush=True)
    load = f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (1 min)"
    targeted = [name for name, target in TARGETS.items() if target is not None]
    summary = [
        "| run | " + " | ".join(f"{n} / torch DDP (median)" for n in targeted) + " |",
        "|---|" + "---|" * len(targeted),
    ]
    for run, ratios in enumerate(per_run):
        summary.append(f"| {run + 1} | " + " | ".join(f"{ratios[n]:.2f}" for n in targeted) + " |")
    verdicts = []
    for name in targeted:
        target = TARGETS[name]
        assert target is not None
        worst = max(r[name] for r in per_run)
        middle = statistics.median(r[name] for r in per_run)
        verdicts.append(
            f"- {name}: target <= {target:.2f}x; median of the runs {middle:.2f}x: "
            f"{'met' if middle <= target else 'missed'}; worst run {worst:.2f}x: "
            f"{'met' if worst <= target else 'missed'}"
        )
    print(f"\nload average {load}\n" + "\n".join([*summary, "", *verdicts]))
    if args.out:
        lines = [
            START,
            "## Data parallelism: torch DDP vs sbpflow DDP vs global-tensor DP",
            "",
            *header,
            "",
            f"Load average {load}.",
            "",
            f"Reproduce: `python bench/ddp/run.py --runs {args.runs} --reps {args.reps} "
            f"--out {args.out}`",
            "",
            "Median step time over torch DDP's, each run:",
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
