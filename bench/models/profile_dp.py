"""Where a data-parallel GPT-2 step goes: sbpflow global DP against torch DDP, phase by phase.

The ``dp-gpt2`` model, batch and optimizer of ``bench/models/run.py`` on 2 gloo ranks; each
variant's step split into ``zero_grad``, the forward (with the loss), ``backward`` (which
includes waiting for the gradient all_reduces still in flight at its end) and
``optimizer.step``, each timed on rank 0 (wall and CPU time, ms; medians over ``--reps``
steps, variants interleaved). One more step per variant is then profiled
(``torch.profiler``): the number of ATen ops that reached sbpflow's dispatcher in each phase,
and the gradient collectives (how many, how many bytes, when they started relative to the
backward: an all_reduce that starts before the backward's last op overlaps it).

Usage (from the repository root)::

    python bench/models/profile_dp.py                       # compiled, default AdamW
    python bench/models/profile_dp.py --modes eager,compiled --adamw default,foreach
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import join_world  # noqa: E402
from bench.models.run import BATCH_PER_RANK, SEQ, VOCAB, WORLD, gpt2  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step")


class _Counter:
    """Counts the calls that reach sbpflow's dispatcher, per phase."""

    def __init__(self) -> None:
        self.phase = "other"
        self.counts: dict[str, int] = {}
        self.ops: dict[str, int] = {}
        dispatcher = sbpflow.GlobalTensor._op_dispatcher
        inner = dispatcher.dispatch

        def counted(func: Any, args: Any, kwargs: Any) -> Any:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
            op = f"{self.phase}:{func}"
            self.ops[op] = self.ops.get(op, 0) + 1
            return inner(func, args, kwargs)

        dispatcher.dispatch = counted  # type: ignore[method-assign]


def _phases(model: Any, ids: Any, foreach: bool | None) -> dict[str, Callable[[], Any]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    held: dict[str, Any] = {}

    def forward() -> None:
        held["loss"] = model(input_ids=ids, labels=ids).loss

    def backward() -> None:
        held.pop("loss").backward()

    return {
        "zero_grad": lambda: optimizer.zero_grad(set_to_none=True),
        "forward": forward,
        "backward": backward,
        "step": optimizer.step,
    }


def gpt2_variants(
    rank: int, compiled: bool, foreach: bool | None
) -> dict[str, dict[str, Callable[[], Any]]]:
    """The phases of a GPT-2 step for torch DDP and sbpflow global DP (the same model)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    base = gpt2()
    world_ids = torch.randint(0, VOCAB, (WORLD * BATCH_PER_RANK, SEQ))
    local_ids = world_ids.chunk(WORLD)[rank].contiguous()
    placement = sbpflow.placement("cpu", list(range(WORLD)))
    maybe = torch.compile if compiled else (lambda m: m)
    ddp = _phases(maybe(DistributedDataParallel(copy.deepcopy(base))), local_ids, foreach)
    model = copy.deepcopy(base).to_global(placement, broadcast)
    ids = local_ids.to_global(placement, split(0), shape=world_ids.shape, check_meta=False)
    return {"torch DDP": ddp, "sbpflow global DP": _phases(maybe(model), ids, foreach)}


def _worker(rank: int, compiled: bool, foreach: bool | None, port: int, reps: int, q: Any) -> None:
    warnings.filterwarnings("ignore")
    join_world(rank, WORLD, port)
    counter = _Counter()
    variants = gpt2_variants(rank, compiled, foreach)
    wall = {n: {p: [] for p in PHASES} for n in variants}
    cpu = {n: {p: [] for p in PHASES} for n in variants}
    for rep in range(3 + reps):
        for name in list(variants)[rep % 2 :] + list(variants)[: rep % 2]:
            dist.barrier()
            for phase in PHASES:
                start, cpu_start = time.perf_counter(), time.process_time()
                variants[name][phase]()
                if rep >= 3:
                    wall[name][phase].append((time.perf_counter() - start) * 1e3)
                    cpu[name][phase].append((time.process_time() - cpu_start) * 1e3)
    report: dict[str, Any] = {}
    for name, phases in variants.items():
        dist.barrier()
        counter.counts, counter.ops = {}, {}
        marks: dict[str, tuple[float, float]] = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for phase in PHASES:
                counter.phase = phase
                with torch.profiler.record_function(f"phase:{phase}"):
                    phases[phase]()
            counter.phase = "other"
        events = prof.events()
        for e in events:
            if e.name.startswith("phase:"):
                marks[e.name[6:]] = (e.time_range.start, e.time_range.end)
        collectives = [
            e
            for e in events
            if e.name.startswith("gloo:") or e.name in ("c10d::allreduce_", "c10d::all_reduce_")
        ]
        gloo = [e for e in collectives if e.name.startswith("gloo:")]
        bstart, bend = marks["backward"]
        last_op = max(
            (
                e.time_range.end
                for e in events
                if bstart <= e.time_range.start <= bend
                and e.name.startswith("aten::")
                and "copy_" not in e.name
            ),
            default=bend,
        )
        report[name] = {
            "wall": {p: statistics.median(v) for p, v in wall[name].items()},
            "cpu": {p: statistics.median(v) for p, v in cpu[name].items()},
            "dispatched": dict(counter.counts),
            "ops": dict(counter.ops),
            "collectives": [
                (e.name, (e.time_range.start - bstart) / 1e3, (bend - bstart) / 1e3) for e in gloo
            ],
            "c10d": len([e for e in collectives if not e.name.startswith("gloo:")]),
            "backward_ms": (bend - bstart) / 1e3,
            "last_op_ms": (last_op - bstart) / 1e3,
        }
        if rank == 0 and os.environ.get("PROFILE_TRACE"):
            prof.export_chrome_trace(f"{os.environ['PROFILE_TRACE']}-{name.split()[0]}.json")
        if rank == 0 and os.environ.get("PROFILE_TABLE"):
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if rank == 0:
        q.put(report)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="compiled")
    parser.add_argument("--adamw", default="default")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    for mode in args.modes.split(","):
        for adamw in args.adamw.split(","):
            queue = mp.get_context("spawn").SimpleQueue()
            load = os.getloadavg()[0]
            mp.start_processes(
                _worker,
                args=(
                    mode == "compiled",
                    adamw == "foreach" or None,
                    free_port(),
                    args.reps,
                    queue,
                ),
                nprocs=WORLD,
                start_method="spawn",
            )
            report = queue.get()
            print(f"\n## {mode}, AdamW {adamw} (load {load:.1f})")
            print("| variant | " + " | ".join(f"{p} wall/cpu" for p in PHASES) + " | total |")
            print("|---|" + "---:|" * (len(PHASES) + 1))
            for name, r in report.items():
                cells = [f"{r['wall'][p]:.1f} / {r['cpu'][p]:.1f}" for p in PHASES]
                total = sum(r["wall"].values())
                print(f"| {name} | " + " | ".join(cells) + f" | {total:.1f} |")
            for name, r in report.items():
                starts = ", ".join(f"{s:.1f}" for _, s, _ in r["collectives"])
                print(
                    f"{name}: dispatched {r['dispatched']}; backward {r['backward_ms']:.1f} ms "
                    f"(last aten op at {r['last_op_ms']:.1f}); {len(r['collectives'])} gloo "
                    f"collectives starting at [{starts}] ms; {r['c10d']} c10d calls"
                )
                if r["ops"]:
                    print("  ops:", ", ".join(f"{op} x{n}" for op, n in sorted(r["ops"].items())))


if __name__ == "__main__":
    main()
