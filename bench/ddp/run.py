"""Data-parallel step time: torch DDP vs sbpflow DDP vs sbpflow global-tensor data parallelism.

One run spawns 2 gloo ranks on this machine; each trains the same MLP (~10M parameters,
fp32) one SGD step at a time (zero_grad, forward, MSE loss, backward, optimizer.step) with

- torch DDP: ``torch.nn.parallel.DistributedDataParallel`` (bucket_cap_mb=25);
- sbpflow DDP: ``sbpflow.nn.parallel.DistributedDataParallel`` (bucket_cap_mb=25);
- sbpflow global DP: the model ``to_global(placement, broadcast)`` with
  ``sync_gradients(model)``, each rank's batch ``to_global(placement, split(0))``;
- sbpflow global DP, per-parameter: the same without ``sync_gradients`` (one synchronous
  all_reduce per parameter in its gradient hook), for reference.

The variants are interleaved (NOTE [timing] in bench/boxing/run.py): every repetition runs
each once, in an order rotating from one repetition to the next; a step starts after a
barrier and its time is the maximum over ranks. Warmup steps are dropped; min and median
over repetitions are printed.

Usage (from the repository root)::

    python bench/ddp/run.py              # 2 ranks, 20 repetitions
    python bench/ddp/run.py --reps 5     # a quick run
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
import time
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
from bench._report import machine  # noqa: E402
from sbpflow.nn.parallel import DistributedDataParallel, sync_gradients  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

WIDTHS = (1024, 2048, 2048, 1024, 1024)  # 9.4M parameters
BATCH_PER_RANK = 32
WARMUP = 3


def make_mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _variants(rank: int, world: int) -> dict[str, Callable[[], None]]:
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
        return x.to_global(placement, split(0)), y.to_global(placement, split(0))

    torch_ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=25)
    ours_ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=25)
    global_model = copy.deepcopy(base).to_global(placement, broadcast)
    sync_gradients(global_model, bucket_cap_mb=25)
    per_param = copy.deepcopy(base).to_global(placement, broadcast)
    return {
        "torch DDP": step_fn(torch_ddp, local_batch),
        "sbpflow DDP": step_fn(ours_ddp, local_batch),
        "sbpflow global DP (sync_gradients)": step_fn(global_model, global_batch),
        "sbpflow global DP (per-parameter)": step_fn(per_param, global_batch),
    }


def _worker(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    sbpflow.env.ensure_initialized()
    variants = _variants(rank, world)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(WARMUP + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= WARMUP:
                times[name].append(elapsed.item())
    if rank == 0:
        queue.put(times)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _worker, args=(world, free_port(), args.reps, queue), nprocs=world, start_method="spawn"
    )
    times = queue.get()
    num_params = sum(p.numel() for p in make_mlp().parameters())
    print(f"{machine()}; {world} gloo ranks, 1 thread each")
    print(
        f"MLP {' -> '.join(map(str, WIDTHS))} ({num_params / 1e6:.1f}M parameters, fp32), "
        f"batch {BATCH_PER_RANK} per rank, {args.reps} repetitions after {WARMUP} warmup"
    )
    print(f"{'variant':<38} {'min ms':>8} {'median ms':>10}")
    for name, values in times.items():
        ms = [v * 1e3 for v in values]
        print(f"{name:<38} {min(ms):8.1f} {statistics.median(ms):10.1f}")


if __name__ == "__main__":
    main()
