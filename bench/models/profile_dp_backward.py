"""Python calls in a data-parallel GPT-2 backward: sbpflow global DP against torch DDP.

The model, batch and optimizer of ``bench/models/profile_dp.py`` on 2 gloo ranks; after
warm-up steps, ``--steps`` backward passes of each variant run under ``cProfile`` on rank 0
(the other phases run unprofiled). Prints, per variant, the Python function calls per
backward and the functions with the most own time (``--top``), so what sbpflow does per
parameter per step beyond what torch DDP does can be read off. With ``PROFILE_DUMP=prefix``
rank 0 also writes each variant's ``pstats`` file to ``prefix-<variant>.prof``.

Usage (from the repository root)::

    python bench/models/profile_dp_backward.py --modes eager,compiled
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._ranks import join_world  # noqa: E402
from bench.models.profile_dp import gpt2_variants  # noqa: E402
from bench.models.run import WORLD  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402


def _worker(rank: int, compiled: bool, port: int, steps: int, top: int, q: Any) -> None:
    warnings.filterwarnings("ignore")
    join_world(rank, WORLD, port)
    report = {}
    for name, phases in gpt2_variants(rank, compiled, None).items():
        for _ in range(3):
            for phase in phases.values():
                phase()
        profile = cProfile.Profile()
        for _ in range(steps):
            dist.barrier()
            phases["zero_grad"]()
            phases["forward"]()
            profile.enable()
            phases["backward"]()
            profile.disable()
            phases["step"]()
        stats = pstats.Stats(profile, stream=io.StringIO())
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("tottime").print_stats(top)
        if rank == 0 and os.environ.get("PROFILE_DUMP"):
            stats.dump_stats(f"{os.environ['PROFILE_DUMP']}-{name.split()[0]}.prof")
        calls = sum(s[1] for s in stats.stats.values())  # type: ignore[attr-defined]
        report[name] = (calls / steps, out.getvalue())
    if rank == 0:
        q.put(report)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for mode in args.modes.split(","):
        queue = mp.get_context("spawn").SimpleQueue()
        load = os.getloadavg()[0]
        mp.start_processes(
            _worker,
            args=(mode == "compiled", free_port(), args.steps, args.top, queue),
            nprocs=WORLD,
            start_method="spawn",
        )
        report = queue.get()
        print(f"\n## {mode} (load {load:.1f})")
        for name, (calls, table) in report.items():
            print(f"### {name}: {calls:.0f} Python calls per backward")
            print(table)


if __name__ == "__main__":
    main()
