"""What AdamW's step costs on global parameters: the ``dp-gpt2`` parameters, one process.

The optimizer step of ``bench/models/run.py``'s GPT-2 (torch's default AdamW: on CPU the
per-parameter loop, 8 dispatched ops per parameter) on three kinds of the same parameters:
plain tensors (what ``torch.compile(DDP(model))`` steps), the minimal ``__torch_dispatch__``
subclass ``bench/_floor.Floor`` and sbpflow global tensors (broadcast on one rank, the layout
of data parallelism; the step is local on every layout, so one rank shows it). Gradients are
set once to fixed values and every kind steps the same values.

Two sizes: the model's own (``full``: the kernels' time included) and ``tiny``, each
parameter replaced by 4 elements (the same 52 parameters and 416 dispatched ops per step,
nearly no kernel time): there the difference between the kinds is the per-op cost of each.
Kinds are interleaved (each repetition steps every kind once, in a rotating order); medians
over ``--reps`` steps, wall and CPU (``time.process_time``) time, in ms, with the load average;
one thread, as each rank of ``run.py`` has.
Then the number of ops that reached sbpflow's dispatcher in one step, by op.

With ``--profile`` the sbpflow step of the chosen size also runs under ``cProfile`` (own
time per function, the top ``--top``).

Usage (from the repository root)::

    python bench/models/profile_optimizer.py
    python bench/models/profile_optimizer.py --sizes tiny --reps 200 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._floor import Floor  # noqa: E402
from bench.models.run import gpt2  # noqa: E402
from sbpflow.sbp import broadcast  # noqa: E402

KINDS = ("plain", "floor", "sbpflow")


def _optimizer(kind: str, shapes: list[torch.Size]) -> torch.optim.Optimizer:
    placement = sbpflow.placement("cpu", [0])
    make: Callable[[torch.Tensor], torch.Tensor] = {
        "plain": lambda t: t,
        "floor": Floor.wrap,
        "sbpflow": lambda t: t.to_global(placement, broadcast),
    }[kind]
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(make(torch.randn(shape, generator=gen)))
        p.grad = make(torch.randn(shape, generator=gen))
        params.append(p)
    return torch.optim.AdamW(params, lr=1e-4)


def _shapes(size: str) -> list[torch.Size]:
    shapes = [p.shape for p in gpt2().parameters()]
    return shapes if size == "full" else [torch.Size([4]) for _ in shapes]


def _dispatched(optimizer: torch.optim.Optimizer) -> Counter[str]:
    dispatcher = sbpflow.GlobalTensor._op_dispatcher
    inner, counts = dispatcher.dispatch, Counter[str]()

    def counted(func: Any, args: Any, kwargs: Any) -> Any:
        counts[str(func)] += 1
        return inner(func, args, kwargs)

    dispatcher.dispatch = counted  # type: ignore[method-assign]
    try:
        optimizer.step()
    finally:
        del dispatcher.dispatch  # the method again
    return counts


def measure(size: str, reps: int) -> dict[str, tuple[float, float]]:
    """Per kind, the median (wall ms, CPU ms) of a step."""
    optimizers = {kind: _optimizer(kind, _shapes(size)) for kind in KINDS}
    for optimizer in optimizers.values():
        for _ in range(3):
            optimizer.step()
    wall: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for rep in range(reps):
        for kind in KINDS[rep % 3 :] + KINDS[: rep % 3]:
            start, cpu_start = time.perf_counter(), time.process_time()
            optimizers[kind].step()
            wall[kind].append((time.perf_counter() - start) * 1e3)
            cpu[kind].append((time.process_time() - cpu_start) * 1e3)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in KINDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,full")
    parser.add_argument("--reps", type=int, default=0, help="default: 200 tiny, 20 full")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for size in args.sizes.split(","):
        load = os.getloadavg()[0]
        result = measure(size, args.reps or (200 if size == "tiny" else 20))
        print(f"\n## AdamW step, GPT-2 parameters, {size} (load {load:.1f})")
        print("| kind | wall ms | CPU ms | CPU / plain |")
        print("|---|---:|---:|---:|")
        for kind, (w, c) in result.items():
            print(f"| {kind} | {w:.2f} | {c:.2f} | {c / result['plain'][1]:.2f} |")
        optimizer = _optimizer("sbpflow", _shapes(size))
        optimizer.step()
        counts = _dispatched(optimizer)
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))
        print(f"dispatched per step: {sum(counts.values())} ({ops})")
        if args.profile:
            profile = cProfile.Profile()
            for _ in range(5):
                profile.enable()
                optimizer.step()
                profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
