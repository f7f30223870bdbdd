"""Joining the benchmark's world from a spawned worker."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import sbpflow


def join_world(rank: int, world: int, port: int) -> None:
    """Become rank ``rank`` of ``world`` gloo ranks on this host, one thread each (2 cores)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    sbpflow.env.ensure_initialized()


def slowest_rank_times(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each sample replaced by the slowest rank's (every rank passes the same names and counts)."""
    out = {}
    for name, samples in times.items():
        slowest = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = slowest.tolist()
    return out


def interleaved_step_times(
    variants: dict[str, Callable[[], Any]], warmup: int, reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times and CPU times (ms, the slower rank's) of each variant, interleaved: every
    repetition runs each variant once, in an order rotating from one repetition to the next,
    each step after a barrier; the first ``warmup`` repetitions are dropped. The CPU time is
    ``time.process_time`` (every thread of the rank's process, gloo's included)."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            variants[name]()
            elapsed = torch.tensor(
                [time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64
            )
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= warmup:
                times[name].append(elapsed[0].item() * 1e3)
                cpu_times[name].append(elapsed[1].item() * 1e3)
    return times, cpu_times
