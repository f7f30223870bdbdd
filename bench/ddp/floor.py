"""What any Python tensor subclass costs on the residual model: plain torch vs a minimal
wrapper subclass vs sbpflow global tensors, one rank, no communication.

The residual model of ``bench/ddp/run.py`` trained one SGD step at a time on one rank
(batch 512, one thread), in three forms, interleaved in one process (each repetition runs
each once, in an order rotating from one repetition to the next):

- **plain**: the model and batch as plain tensors;
- **floor**: every parameter and the batch wrapped in the minimal ``__torch_dispatch__``
  subclass of ``bench/_floor.py`` (``Floor``: unwrap, run the op, wrap; no layouts):
  the least any eager tensor subclass in Python pays per op, a floor for any
  framework whose global tensor is one (sbpflow's, DTensor);
- **sbpflow**: ``model.to_global(placement, broadcast)`` on a one-rank placement, the batch
  ``split(0)``: the global data-parallel program of ``bench/ddp`` without its reduction.

Every op of the step then dispatches to Python once per call: the model's forward, the
autograd formulas of its backward (each ``t`` of a weight, each ``detach`` of a gradient
accumulated) and the optimizer's ``add_``. ``--runs`` fresh processes; the median step time
of each form, and its ratio to plain's, per run.

Usage (from the repository root)::

    python bench/ddp/floor.py                 # 3 runs of 40 steps
    python bench/ddp/floor.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._floor import Floor, floor_model  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from bench.ddp.run import RES_BATCH, RES_DIM, _step_fn, make_residual  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

FORMS = ("plain", "floor", "sbpflow")
WARMUP = 5
SECTION_START, SECTION_END = "<!-- bench:ddp-floor:start -->", "<!-- bench:ddp-floor:end -->"


def one_run(reps: int) -> dict[str, float]:
    """Median step ms of each form, in this process (a one-rank gloo world)."""
    join_world(0, 1, free_port())
    torch.manual_seed(0)
    base = make_residual()
    placement = sbpflow.placement("cpu", [0])
    x, y = torch.randn(RES_BATCH, RES_DIM), torch.randn(RES_BATCH, RES_DIM)
    gx, gy = (t.to_global(placement, split(0), shape=t.shape, check_meta=False) for t in (x, y))
    fx, fy = Floor.wrap(x), Floor.wrap(y)
    loss = nn.MSELoss()
    steps = {
        "plain": _step_fn(copy.deepcopy(base), lambda: (x, y), loss),
        "floor": _step_fn(floor_model(base), lambda: (fx, fy), loss),
        "sbpflow": _step_fn(
            copy.deepcopy(base).to_global(placement, broadcast), lambda: (gx, gy), loss
        ),
    }
    times, _ = interleaved_step_times(steps, WARMUP, reps)
    return {form: statistics.median(samples) for form, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40, help="timed steps per form and run")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.reps)))
        return
    rows, floor_ratios, sbp_ratios = [], [], []
    for run in range(args.runs):
        out = (
            subprocess.run(
                [sys.executable, __file__, "--one-run", "--reps", str(args.reps)],
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        medians = json.loads(out)
        plain = medians["plain"]
        floor_ratios.append(medians["floor"] / plain)
        sbp_ratios.append(medians["sbpflow"] / medians["floor"])
        rows.append(
            f"| {run + 1} | {plain:.1f} | {medians['floor']:.1f} | {medians['sbpflow']:.1f} | "
            f"{medians['floor'] / plain:.3f} | {medians['sbpflow'] / plain:.3f} | "
            f"{medians['sbpflow'] / medians['floor']:.3f} |"
        )
    table = "\n".join(
        [
            "| run | plain ms | floor ms | sbpflow ms | floor / plain | sbpflow / plain | "
            "sbpflow / floor |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    summary = (
        f"Median of the runs: floor / plain {statistics.median(floor_ratios):.3f}, "
        f"sbpflow / floor {statistics.median(sbp_ratios):.3f}."
    )
    print(machine())
    print(table)
    print(summary)
    if args.out is not None:
        text = f"""{SECTION_START}
### Data parallelism: what a Python tensor subclass costs by itself

`python bench/ddp/floor.py --reps {args.reps} --runs {args.runs} --out docs/benchmarks.md`.
Machine: {machine()}; one rank, one thread, no communication. The residual model above,
one SGD step at a time, as **plain** torch tensors, as **floor** (every parameter and the
batch wrapped in the minimal `__torch_dispatch__` subclass of `bench/dispatch`: unwrap, run
the op, wrap, nothing else) and as **sbpflow** global tensors on a one-rank placement
(`to_global(placement, broadcast)`, the batch `split(0)`); interleaved in one process, median
step time over {args.reps} steps per form, {args.runs} fresh processes:

{table}

{summary} A tensor subclass that does nothing but unwrap and wrap already adds
floor / plain - 1 to this model's step, because every op of the step (the forward's, the
backward formulas', the optimizer's) enters Python; torch DDP computes at plain speed, its
reduction in C++. So no eager global tensor built on a Python subclass reaches torch DDP's
step on this model; `torch.compile` of the global model traces the dispatch away (the
compiled row above).
{SECTION_END}"""
        write_section(args.out, text, SECTION_START, SECTION_END)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
