"""How close calibrated plan costs come to measured boxing time, for 64 MiB CPU tensors.

    python bench/planner/calibration_check.py            # starts 4 ranks itself
    python -m sbpflow.distributed.launch --nproc_per_node 4 bench/planner/calibration_check.py

Rank 0 prints the calibration, then one row per layout change: the plan's
estimate (``plan.cost``), the measured time of ``to_global`` (fastest of
``--repeats`` runs, the slowest rank's time of each run, metadata check off
so only boxing is timed), and measured / estimated. Calibration results are
stored as usual (``$SBPFLOW_CACHE_DIR``, default ``~/.cache/sbpflow``);
``--no-save`` leaves that file alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import sbpflow
from sbpflow import sbp
from sbpflow.comm import _bench

CASES = [
    ("S(0) -> B", sbp.split(0), sbp.broadcast),
    ("P -> B", sbp.partial_sum, sbp.broadcast),
    ("P -> S(0)", sbp.partial_sum, sbp.split(0)),
    ("S(0) -> S(1)", sbp.split(0), sbp.split(1)),
]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nproc", type=int, default=4, help="ranks to start when run directly (default 4)"
    )
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--no-save", action="store_true", help="do not write the calibration file")
    return parser.parse_args()


def _time_boxing(x: sbpflow.GlobalTensor, dst: object, repeats: int) -> float:
    """Fastest of ``repeats`` runs; each run counts as long as its slowest rank took."""
    best = float("inf")
    x.to_global(sbp=dst, check_meta=False)  # warm up: groups, plan cache, allocator
    for _ in range(repeats):
        _bench.max_over_world([0.0])  # start together
        start = time.perf_counter()
        x.to_global(sbp=dst, check_meta=False)
        elapsed = _bench.max_over_world([time.perf_counter() - start])[0]
        best = min(best, elapsed)
    return best


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    sbpflow.env.ensure_initialized()
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    start = time.perf_counter()
    calibration = sbpflow.boxing.calibrate(save=not args.no_save)
    if rank == 0:
        print(f"calibrated in {time.perf_counter() - start:.1f} s")
        print(calibration, flush=True)

    placement = sbpflow.placement("cpu", list(range(world)))
    side = int((args.mib * 2**20 / 4) ** 0.5)  # a square float32 tensor of about --mib MiB
    shape = (side, side)
    rows = []
    for name, src, dst in CASES:
        x = sbpflow.ones(*shape, placement=placement, sbp=src)
        plan = sbpflow.boxing.plan(shape, torch.float32, (placement, src), (placement, dst))
        measured = _time_boxing(x, dst, args.repeats)
        rows.append((name, " + ".join(s.op for s in plan.steps), plan.cost, measured))
        del x

    if rank == 0:
        mib = side * side * 4 / 2**20
        print(
            f"\n{mib:.0f} MiB float32 tensor {list(shape)} on {world} CPU ranks "
            f"({os.cpu_count()} CPU cores), fastest of {args.repeats} runs"
        )
        print("| layout change | plan | estimated | measured | measured / estimated |")
        print("|---|---|---:|---:|---:|")
        for name, ops, estimate, measured in rows:
            print(
                f"| {name} | {ops} | {estimate * 1e3:.1f} ms | {measured * 1e3:.1f} ms | "
                f"{measured / estimate:.2f} |"
            )


def main() -> None:
    args = _parse()
    if "RANK" not in os.environ:  # run directly: start the ranks through the launcher
        command = [
            sys.executable,
            "-m",
            "sbpflow.distributed.launch",
            "--nproc_per_node",
            str(args.nproc),
            __file__,
            *sys.argv[1:],
        ]
        raise SystemExit(subprocess.call(command))
    run(args)


if __name__ == "__main__":
    main()
