"""Data-parallel step time: torch DDP vs sbpflow DDP vs sbpflow global-tensor data parallelism.

Two models, each in its own fresh processes per run (2 gloo ranks on this machine), trained
one SGD step at a time (zero_grad, forward, MSE loss, backward, optimizer.step):

**MLP** (~10M parameters, fp32, batch 32 per rank), every bucket 25 MB:

- torch DDP: ``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)``, otherwise
  its defaults (gradient_as_bucket_view=False): the baseline of the ratios. A cap given
  applies to every bucket, the first one included (both libraries' rule);
- torch DDP, bucket view: the same with ``gradient_as_bucket_view=True``, for reference;
- sbpflow DDP: ``sbpflow.nn.parallel.DistributedDataParallel`` (bucket_cap_mb=25);
- sbpflow global DP: the model ``to_global(placement, broadcast)`` with
  ``sync_gradients(model, bucket_cap_mb=25)``; each rank's batch made global ``split(0)`` in
  the hot-loop form (``shape=`` the logical shape, ``check_meta=False``: no metadata exchange);
- sbpflow global DP, checked batch: the same with the batch made global by
  ``to_global_batch`` (the default ``check_meta=True``: one metadata exchange per tensor);
- sbpflow global DP, default buckets: no ``sync_gradients`` (the buckets a global model gets
  with nothing to call: 25 MB, the first 1 MiB), for reference.

**Residual** (4 blocks ``x + Linear(1024->256)(GELU(Linear(256->1024)(LayerNorm(x))))`` then
``Linear(256, 256)``, 2.1M parameters, batch 512 per rank), every library at its defaults:

- torch DDP: ``DistributedDataParallel(model)``: the baseline of the eager ratios;
- sbpflow DDP: ``sbpflow.nn.parallel.DistributedDataParallel(model)``;
- sbpflow global DP: the model ``to_global(placement, broadcast)`` and nothing else; the batch
  in the hot-loop form as above;
- sbpflow global DP, checked batch: the same with ``x.to_global(placement, split(0))`` as
  written in the docs (its default metadata exchange, one per tensor), for reference;
- torch compiled DDP: ``torch.compile(DistributedDataParallel(model))``: the baseline of the
  compiled ratio;
- sbpflow global DP, compiled: ``torch.compile`` of the global model (the loss and the
  optimizer step eager in both).

The variants of a model are interleaved (NOTE [timing] in bench/boxing/run.py): every
repetition runs each once, in an order rotating from one repetition to the next; a step
starts after a barrier and its time is the maximum over ranks. Warmup steps are dropped; min
and median over repetitions are printed, with their ratios to the baseline's, and the median
CPU time of a step (``time.process_time``: every thread of the rank's process, gloo's
included; the slower rank's), which the machine's other load disturbs much less than the
step time. ``--runs`` repeats the whole run (fresh processes); the targets are judged on the
median over runs of each run's median ratio, and on the worst run.

Usage (from the repository root)::

    python bench/ddp/run.py                                # both models, 3 runs of 20
    python bench/ddp/run.py --model residual --runs 1 --reps 5   # a quick run
    python bench/ddp/run.py --out docs/benchmarks.md       # write the docs sections
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
from bench._report import machine, verdict, write_section  # noqa: E402
from sbpflow.nn.parallel import DistributedDataParallel, sync_gradients  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402
from sbpflow.utils.data import to_global_batch  # noqa: E402

WARMUP = 3
WORLD = 2
START, END = "<!-- bench:ddp:start -->", "<!-- bench:ddp:end -->"


@dataclass(frozen=True)
class Suite:
    """One model's variants: ``targets`` maps each variant to (target on its median ratio to
    ``baseline``, or None for a reference row; baseline)."""

    name: str
    title: str
    describe: str
    targets: dict[str, tuple[float | None, str]]
    variants: Callable[[int], dict[str, Callable[[], None]]]
    warmup: int = WARMUP


# -- MLP: every bucket 25 MB ------------------------------------------------------------
MLP_WIDTHS = (1024, 2048, 2048, 1024, 1024)  # 9.4M parameters
MLP_BATCH = 32


def make_mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(MLP_WIDTHS):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# -- residual blocks: every library at its defaults ---------------------------------------
RES_DIM, RES_HIDDEN, RES_BLOCKS, RES_BATCH = 256, 1024, 4, 512


class ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(RES_DIM)
        self.up = nn.Linear(RES_DIM, RES_HIDDEN)
        self.down = nn.Linear(RES_HIDDEN, RES_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def make_residual() -> nn.Sequential:
    return nn.Sequential(*[ResidualBlock() for _ in range(RES_BLOCKS)], nn.Linear(RES_DIM, RES_DIM))


def _step_fn(
    model: nn.Module, inputs: Callable[[], tuple[Any, Any]], loss_fn: nn.Module
) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        xb, yb = inputs()
        loss_fn(model(xb), yb).backward()
        opt.step()

    return step


def _batches(
    world: int, rows: int, fan_in: int, fan_out: int
) -> tuple[Callable[[], tuple[Any, Any]], Callable[[], tuple[Any, Any]], Any]:
    """This rank's batch as local tensors and in the hot-loop global form, and the placement."""
    placement = sbpflow.placement("cpu", list(range(world)))
    x, y = torch.randn(rows, fan_in), torch.randn(rows, fan_out)

    def local_batch() -> tuple[Any, Any]:
        return x, y

    def global_batch() -> tuple[Any, Any]:
        return tuple(  # type: ignore[return-value]
            t.to_global(
                placement, split(0), shape=(world * t.shape[0], t.shape[1]), check_meta=False
            )
            for t in (x, y)
        )

    return local_batch, global_batch, placement


def mlp_variants(world: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    base = make_mlp()
    local_batch, global_batch, placement = _batches(world, MLP_BATCH, MLP_WIDTHS[0], MLP_WIDTHS[-1])
    loss_fn = nn.MSELoss()

    def checked_global_batch() -> tuple[Any, Any]:
        return to_global_batch(local_batch(), placement)

    def global_model() -> nn.Module:
        return copy.deepcopy(base).to_global(placement, broadcast)

    synced, synced_checked = global_model(), global_model()
    sync_gradients(synced, bucket_cap_mb=25)
    sync_gradients(synced_checked, bucket_cap_mb=25)
    torch_ddp = nn.parallel.DistributedDataParallel
    return {
        "torch DDP": _step_fn(
            torch_ddp(copy.deepcopy(base), bucket_cap_mb=25), local_batch, loss_fn
        ),
        "torch DDP, bucket view": _step_fn(
            torch_ddp(copy.deepcopy(base), bucket_cap_mb=25, gradient_as_bucket_view=True),
            local_batch,
            loss_fn,
        ),
        "sbpflow DDP": _step_fn(
            DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=25), local_batch, loss_fn
        ),
        "sbpflow global DP": _step_fn(synced, global_batch, loss_fn),
        "sbpflow global DP, checked batch": _step_fn(synced_checked, checked_global_batch, loss_fn),
        "sbpflow global DP, default buckets": _step_fn(global_model(), global_batch, loss_fn),
    }


def residual_variants(world: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    base = make_residual()
    local_batch, global_batch, placement = _batches(world, RES_BATCH, RES_DIM, RES_DIM)
    loss_fn = nn.MSELoss()

    def checked_batch() -> tuple[Any, Any]:
        return tuple(t.to_global(placement, split(0)) for t in local_batch())  # type: ignore[return-value]

    def global_model() -> nn.Module:
        return copy.deepcopy(base).to_global(placement, broadcast)

    torch_ddp = nn.parallel.DistributedDataParallel
    return {
        "torch DDP": _step_fn(torch_ddp(copy.deepcopy(base)), local_batch, loss_fn),
        "sbpflow DDP": _step_fn(DistributedDataParallel(copy.deepcopy(base)), local_batch, loss_fn),
        "sbpflow global DP": _step_fn(global_model(), global_batch, loss_fn),
        "sbpflow global DP, checked batch": _step_fn(global_model(), checked_batch, loss_fn),
        "torch compiled DDP": _step_fn(
            torch.compile(torch_ddp(copy.deepcopy(base))), local_batch, loss_fn
        ),
        "sbpflow global DP, compiled": _step_fn(
            torch.compile(global_model()), global_batch, loss_fn
        ),
    }


SUITES = {
    "mlp": Suite(
        name="mlp",
        title="MLP, every bucket 25 MB",
        describe=(
            f"MLP {' -> '.join(map(str, MLP_WIDTHS))} "
            f"({sum(p.numel() for p in make_mlp().parameters()) / 1e6:.1f}M parameters, fp32), "
            f"batch {MLP_BATCH} per rank, SGD; every library with bucket_cap_mb=25"
        ),
        targets={
            "torch DDP": (None, "torch DDP"),
            "torch DDP, bucket view": (None, "torch DDP"),
            "sbpflow DDP": (1.00, "torch DDP"),
            "sbpflow global DP": (1.05, "torch DDP"),
            "sbpflow global DP, checked batch": (None, "torch DDP"),
            "sbpflow global DP, default buckets": (None, "torch DDP"),
        },
        variants=mlp_variants,
    ),
    "residual": Suite(
        name="residual",
        title="residual blocks, every library at its defaults",
        describe=(
            f"{RES_BLOCKS} residual blocks x + Linear({RES_HIDDEN}->{RES_DIM})(GELU(Linear("
            f"{RES_DIM}->{RES_HIDDEN})(LayerNorm(x)))) then Linear({RES_DIM}, {RES_DIM}) "
            f"({sum(p.numel() for p in make_residual().parameters()) / 1e6:.1f}M parameters, "
            f"fp32), batch {RES_BATCH} per rank, SGD; every library at its defaults (buckets "
            "of 25 MB, the first 1 MiB); compiled: torch.compile of the model, Inductor"
        ),
        targets={
            "torch DDP": (None, "torch DDP"),
            "sbpflow DDP": (1.00, "torch DDP"),
            "sbpflow global DP": (1.00, "torch DDP"),
            "sbpflow global DP, checked batch": (None, "torch DDP"),
            "torch compiled DDP": (None, "torch compiled DDP"),
            "sbpflow global DP, compiled": (1.05, "torch compiled DDP"),
        },
        variants=residual_variants,
        warmup=5,  # the compiled variants compile in their first steps
    ),
}


def _worker(rank: int, world: int, port: int, suite: str, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    spec = SUITES[suite]
    variants = spec.variants(world)
    assert list(variants) == list(spec.targets), (list(variants), list(spec.targets))
    times, cpu_times = interleaved_step_times(variants, spec.warmup, reps)
    if rank == 0:
        queue.put((times, cpu_times))
    dist.barrier()


def _one_run(suite: str, reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times and CPU times (ms, the slower rank's) of each variant of ``suite``."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(WORLD, free_port(), suite, reps, queue), nprocs=WORLD, start_method="spawn"
    )
    return queue.get()


def _table(
    spec: Suite, times: dict[str, list[float]], cpu_times: dict[str, list[float]]
) -> tuple[list[str], dict[str, float]]:
    """Markdown rows of one run, and each variant's median ratio to its baseline."""
    rows = [
        "| variant | min ms | median ms | / baseline (min) | / baseline (median) "
        "| CPU ms (median) | CPU / baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for name, ms in times.items():
        base = spec.targets[name][1]
        base_min, base_med = min(times[base]), statistics.median(times[base])
        base_cpu = statistics.median(cpu_times[base])
        lo, med, cpu = min(ms), statistics.median(ms), statistics.median(cpu_times[name])
        ratios[name] = med / base_med
        rows.append(
            f"| {name} | {lo:.1f} | {med:.1f} | {lo / base_min:.2f} | {med / base_med:.2f} "
            f"| {cpu:.1f} | {cpu / base_cpu:.2f} |"
        )
    return rows, ratios


def _run_suite(spec: Suite, runs: int, reps: int) -> list[str]:
    """Run ``spec`` ``runs`` times; print each run; return its markdown section."""
    load_start = os.getloadavg()[0]
    header = [
        f"### Data parallelism: {spec.title}",
        "",
        f"{spec.describe}; {reps} timed steps per variant and run after {spec.warmup} warmup, "
        "variants interleaved; a step's time is the slower rank's. Baselines: "
        + ", ".join(sorted({b for _, b in spec.targets.values()}))
        + ".",
    ]
    print("\n" + "\n".join(header), flush=True)
    per_run: list[dict[str, float]] = []
    tables: list[list[str]] = []
    for run in range(runs):
        rows, ratios = _table(spec, *_one_run(spec.name, reps))
        per_run.append(ratios)
        tables.append(rows)
        print(f"\nrun {run + 1} of {runs} (load average {os.getloadavg()[0]:.1f})")
        print("\n".join(rows), flush=True)
    load = f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (1 min)"
    targeted = [name for name, (target, _) in spec.targets.items() if target is not None]
    summary = [
        "| run | " + " | ".join(f"{n} / {spec.targets[n][1]}" for n in targeted) + " |",
        "|---|" + "---|" * len(targeted),
    ]
    for run, ratios in enumerate(per_run):
        summary.append(f"| {run + 1} | " + " | ".join(f"{ratios[n]:.2f}" for n in targeted) + " |")
    verdicts = []
    for name in targeted:
        target, base = spec.targets[name]
        assert target is not None
        verdicts.append(verdict(f"{name} / {base}", target, [r[name] for r in per_run]))
    print(f"\nload average {load}\n" + "\n".join([*summary, "", *verdicts]), flush=True)
    return [
        *header,
        "",
        f"Load average {load}. Median step time over the baseline's, each run:",
        "",
        *summary,
        "",
        *verdicts,
        "",
        f"Run {runs} in full:",
        "",
        *tables[-1],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed steps per variant and run")
    parser.add_argument("--runs", type=int, default=3, help="whole runs, fresh processes each")
    parser.add_argument("--model", choices=[*SUITES, "both"], default="both")
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args()
    chosen = list(SUITES) if args.model == "both" else [args.model]
    print(f"Machine: `{machine()}`; {WORLD} gloo ranks on this host, one thread each.")
    sections = [_run_suite(SUITES[name], args.runs, args.reps) for name in chosen]
    if args.out:
        lines = [
            START,
            "## Data parallelism: torch DDP vs sbpflow DDP vs global-tensor DP",
            "",
            f"Machine: `{machine()}`; {WORLD} gloo ranks on this host, one thread each.",
            "",
            f"Reproduce: `python bench/ddp/run.py --model {args.model} --runs {args.runs} "
            f"--reps {args.reps} --out {args.out}`",
        ]
        for section in sections:
            lines += ["", *section]
        write_section(args.out, "\n".join([*lines, END]), START, END)


if __name__ == "__main__":
    main()
