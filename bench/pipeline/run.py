"""Pipelines run by ``sbpflow.nn.Graph``: the schedules' bubble, and real compute against torch.

Part 1 (bench/pipeline/_timed.py): every schedule on 4 gloo ranks with stages that wait a
fixed time: measured bubble against the schedule's formula (target: within 5 points), peak
live micro-batches, throughput against one rank.

Part 2 (bench/pipeline/_real.py): 2 stages of ``4 x (Linear(1024, 1024), ReLU)``, batch 256
in 8 micro-batches, MSE, SGD, 2 gloo ranks with one thread each, against torch's
``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` and against one rank, interleaved in
one run; ``--runs`` fresh runs. Targets: sbpflow/torch <= 1.05 for GPipe and 1F1B (median of
the runs' median step times), sbpflow faster than one rank.

Part 3 (bench/pipeline/_real.py): the same stages as two 2-stage pipelines at once (ranks 0-1
and 2-3) and as one 4-stage pipeline on 4 ranks, interleaved: host CPU per action on each
rank (target: the same within 10% on ranks 0 and 3, which hold the first and the last stage
in both).

Part 4 (bench/pipeline/_real.py): the stages of part 2 under ``1f1b`` and ``zero_bubble``,
interleaved: host CPU per B against per I and W of the split backward (target: I + W within
10% of B, the weight pass reusing what the input pass computed), and the step times.

Part 5 (bench/pipeline/_real.py): where the bubble matters. ``1f1b`` against ``zero_bubble`` on
the stages of part 2 with 2, 4 and 8 micro-batches, and the same layers as 4 stages on 2 ranks
under ``interleaved_1f1b``, ``interleaved_zero_bubble`` and ``zbv`` against torch's
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``,
all interleaved in one run: step times (median of ``--runs`` runs), each against its 1F1B.

Usage (from the repository root)::

    python bench/pipeline/run.py                          # print the tables
    python bench/pipeline/run.py --out docs/benchmarks.md # also write the section and the SVGs
    python bench/pipeline/run.py --parts 2 --runs 1       # one quick run of part 2
    python bench/pipeline/run.py --parts 4 --runs 1       # one quick run of part 4
    python bench/pipeline/run.py --parts 5 --runs 3       # zero bubble against 1F1B by m
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from queue import Empty
from typing import Any

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402
from bench.pipeline import _real, _timed  # noqa: E402
from sbpflow.nn.pipeline import StepRecord  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

SECTION_START, SECTION_END = "<!-- bench:pipeline:start -->", "<!-- bench:pipeline:end -->"
SVG_TIMED, SVG_REAL = "pipeline-timeline.svg", "pipeline-real-timeline.svg"


def _spawn(worker: Any, world: int, reps: int) -> Any:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(
        worker,
        args=(world, free_port(), reps, queue),
        nprocs=world,
        start_method="spawn",
        join=False,
    )
    while True:  # the result before joining: the records are larger than a pipe's buffer
        try:
            result = queue.get(timeout=5)
            break
        except Empty:
            if any(p.exitcode not in (None, 0) for p in procs.processes):
                procs.join()  # raises with the failed rank's traceback, stopping the others
            if all(p.exitcode is not None for p in procs.processes) and queue.empty():
                raise RuntimeError(
                    "the bench workers exited without a result (see above)"
                ) from None
    while not procs.join():
        pass
    return result


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


def part1(reps: int) -> tuple[str, list[str], StepRecord]:
    results, one = _spawn(_timed.worker, _timed.P, reps)
    lines, misses = _timed.rows(results, one)
    table = "\n".join(
        [
            "| schedule | stages per rank | micro-batches m | formula bubble | simulated | "
            "measured bubble | peak live on a stage (schedule's) | step ms (median) | "
            "one rank ms | speedup |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    return table, misses, results[("1f1b", 8)]["record"]


def part2(reps: int, runs: int) -> tuple[str, str, str, StepRecord]:
    """The vs-torch table (one row per run and variant), the verdict, and a recorded step."""
    lines, ratios, speedups = [], {s: [] for s in _real.SCHEDULES}, []
    record = None
    for run in range(runs):
        load = _load()
        per_rank, record = _spawn(_real.worker_vs_torch, 2, reps)
        med = {n: statistics.median(r["times"]) for n, r in per_rank[0].items()}
        for schedule in _real.SCHEDULES:
            ratio = med[f"sbpflow {schedule}"] / med[f"torch {schedule}"]
            ratios[schedule].append(ratio)
            speedup = med["one rank"] / med[f"sbpflow {schedule}"]
            speedups.append(speedup)
            cpu = [
                (r[f"sbpflow {schedule}"], r[f"torch {schedule}"]) for r in per_rank
            ]  # per rank: (sbpflow, torch)
            cpu_text = "; ".join(
                f"r{rank} F {s['cpu_f'] * 1e3:.2f}/{t['cpu_f'] * 1e3:.2f}, "
                f"B {s['cpu_b'] * 1e3:.2f}/{t['cpu_b'] * 1e3:.2f}"
                for rank, (s, t) in enumerate(cpu)
            )
            step_text = "; ".join(
                f"r{rank} {s['cpu_step'] * 1e3:.1f}/{t['cpu_step'] * 1e3:.1f}"
                for rank, (s, t) in enumerate(cpu)
            )
            lines.append(
                f"| {run + 1} | {schedule} | {med[f'torch {schedule}'] * 1e3:.1f} | "
                f"{med[f'sbpflow {schedule}'] * 1e3:.1f} | **{ratio:.3f}** | "
                f"{med['one rank'] * 1e3:.1f} | {speedup:.2f}x | {cpu_text} | {step_text} | "
                f"{load} |"
            )
    table = "\n".join(
        [
            "| run | schedule | torch ms | sbpflow ms | sbpflow / torch | one rank ms | "
            "sbpflow speedup over one rank | host CPU ms per action, sbpflow/torch | "
            "host CPU ms per step (main thread), sbpflow/torch | load average at start |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    verdict = "; ".join(
        f"{s}: sbpflow/torch median of the runs {statistics.median(r):.3f} "
        f"({'meets' if statistics.median(r) <= 1.05 else 'misses'} <= 1.05)"
        for s, r in ratios.items()
    )
    verdict += (
        f"; sbpflow faster than one rank in {sum(x > 1 for x in speedups)} of {len(speedups)} rows"
    )
    assert record is not None
    return table, verdict, _load(), record


# Part 3: each rank's stage in the two pipelines ("2 stages" is two 2-stage pipelines at once,
# ranks 0-1 and 2-3). Ranks 0 and 3 hold the first and the last stage in both: their actions
# are the same work, and the target compares them. Ranks 1 and 2 change role: an end stage of
# 2 becomes a middle stage of 4, the one role with a send and a receive in every action.
ROLES = {0: ("first", "first"), 1: ("last", "middle"), 2: ("first", "middle"), 3: ("last", "last")}


def part3(reps: int, runs: int) -> tuple[str, list[str]]:
    """Each cell: the median over ``runs`` fresh runs of a rank's median per action."""
    results = [_spawn(_real.worker_stage_counts, 4, reps) for _ in range(runs)]
    per_rank = [
        {
            name: {
                key: statistics.median(r[rank][name][key] for r in results)
                for key in ("cpu_f", "cpu_b", "moves_f", "moves_b")
            }
            for name in results[0][rank]
        }
        for rank in range(4)
    ]
    lines, misses = [], []

    def ms(value: float) -> str:
        return f"{value * 1e3:.2f}"

    for schedule in _real.SCHEDULES:
        for rank, (role_two, role_four) in ROLES.items():
            two = per_rank[rank][f"{schedule} 2 stages"]
            four = per_rank[rank][f"{schedule} 4 stages"]
            cells = []
            for key in ("cpu_f", "cpu_b"):
                change = four[key] / two[key] - 1
                cells.append(f"{ms(two[key])} | {ms(four[key])} | {change:+.1%}")
                if role_two == role_four and abs(change) > 0.10:
                    misses.append(f"{schedule} rank {rank} {key[-1].upper()}: {change:+.1%}")
            lines.append(
                f"| {schedule} | {rank} | {role_two} / {role_four} | "
                + " | ".join(cells)
                + f" | {ms(two['moves_f'])} / {ms(two['moves_b'])}"
                + f" | {ms(four['moves_f'])} / {ms(four['moves_b'])} |"
            )
    table = "\n".join(
        [
            "| schedule | rank | stage of 2 / of 4 | F ms, 2 stages | F ms, 4 stages | change "
            "| B ms, 2 stages | B ms, 4 stages | change | transfers F / B ms, 2 stages "
            "| transfers F / B ms, 4 stages |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    return table, misses


def part4(reps: int, runs: int) -> tuple[str, list[str]]:
    """One row per run and rank: B against I + W, and the step times."""
    lines, misses = [], []
    for run in range(runs):
        load = _load()
        per_rank = _spawn(_real.worker_weight_pass, 2, reps)
        for rank, results in enumerate(per_rank):
            plain, split = results["1f1b"], results["zero_bubble"]
            b, i, w = plain["cpu_b"], split["cpu_i"], split["cpu_w"]
            ratio = (i + w) / b
            if ratio > 1.10:
                misses.append(f"run {run + 1} rank {rank}: (I + W) / B = {ratio:.2f}")
            step = {n: statistics.median(r["times"]) * 1e3 for n, r in results.items()}
            lines.append(
                f"| {run + 1} | {rank} | {b * 1e3:.2f} | {i * 1e3:.2f} | {w * 1e3:.2f} | "
                f"**{ratio:.2f}** | {step['1f1b']:.1f} | {step['zero_bubble']:.1f} | {load} |"
            )
    table = "\n".join(
        [
            "| run | rank | 1f1b B ms | zero_bubble I ms | zero_bubble W ms | (I + W) / B | "
            "1f1b step ms | zero_bubble step ms | load average at start |",
            "|---|---|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    return table, misses


def part5(reps: int, runs: int) -> str:
    """Per configuration and schedule: the median step of each run (load average at its
    start), the median of the runs, and its ratio to the configuration's baseline (1f1b, or
    interleaved_1f1b on 4 stages) of the same implementation."""
    loads, medians = [], []
    for _ in range(runs):
        loads.append(_load())
        times = _spawn(_real.worker_bubble, 2, reps)
        medians.append({name: statistics.median(t) * 1e3 for name, t in times.items()})
    mid = {name: statistics.median(run[name] for run in medians) for name in medians[0]}
    lines = []
    for name in medians[0]:
        who, schedule, stages, m = name.split()
        base = f"{who} {'1f1b' if stages == '2' else 'interleaved_1f1b'} {stages} {m}"
        label = _real.V_SCHEDULES[schedule][1] if who == "torch" else schedule
        lines.append(
            f"| {stages} | {m[2:]} | {who} `{label}` | "
            + " / ".join(f"{run[name]:.1f}" for run in medians)
            + f" | {mid[name]:.1f} | **{mid[name] / mid[base]:.3f}** |"
        )
    load_text = "; ".join(f"run {i + 1}: {load}" for i, load in enumerate(loads))
    return "\n".join(
        [
            "| stages (on 2 ranks) | micro-batches m | schedule | step ms, each run's median | "
            "median of the runs | / the 1F1B of its stages |",
            "|---|---|---|---|---|---|",
            *lines,
            "",
            f"Load average at the start of each run: {load_text}; at the end: {_load()}.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed steps per row of part 1")
    parser.add_argument("--real-reps", type=int, default=9, help="steps per variant, parts 2-3")
    parser.add_argument("--runs", type=int, default=3, help="fresh runs of parts 2 and 3")
    parser.add_argument("--parts", default="1,2,3,4,5")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    where = f"{machine()}; `nproc` = {os.cpu_count()}"
    print(where)
    out: dict[str, Any] = {}
    if 1 in parts:
        out["timed"], out["misses"], out["timed_record"] = part1(args.reps)
        print(out["timed"])
        print("off target: " + "; ".join(out["misses"]) if out["misses"] else "part 1 on target")
    if 2 in parts:
        out["real"], out["verdict"], out["end_load"], out["real_record"] = part2(
            args.real_reps, args.runs
        )
        print(out["real"])
        print(out["verdict"])
    if 3 in parts:
        out["counts"], out["count_misses"] = part3(args.real_reps, args.runs)
        print(out["counts"])
        print(
            "off target: " + "; ".join(out["count_misses"])
            if out["count_misses"]
            else "part 3 on target: host CPU per action of ranks 0 and 3 within 10%"
        )
    if 4 in parts:
        out["split"], out["split_misses"] = part4(args.real_reps, args.runs)
        print(out["split"])
        print(
            "off target: " + "; ".join(out["split_misses"])
            if out["split_misses"]
            else "part 4 on target: I + W within 10% of B on every rank"
        )
    if 5 in parts:
        out["bubble"] = part5(args.real_reps, args.runs)
        print(out["bubble"])
    if args.out is not None:
        if parts != {1, 2, 3, 4, 5}:
            raise SystemExit("--out writes the whole section: run every part (--parts 1,2,3,4,5).")
        (args.out.parent / SVG_TIMED).write_text(out["timed_record"].svg())
        (args.out.parent / SVG_REAL).write_text(out["real_record"].svg())
        write_section(args.out, _section(where, out, args), SECTION_START, SECTION_END)
        print(f"wrote {args.out}, {SVG_TIMED} and {SVG_REAL}")


def _section(where: str, out: dict[str, Any], args: Any) -> str:
    verdict1 = (
        "Every measured bubble is within 5 points of its formula."
        if not out["misses"]
        else "Off the 5-point target: " + "; ".join(out["misses"]) + "."
    )
    verdict3 = (
        "On ranks 0 and 3 (the first and the last stage in both) host CPU per action is within "
        "10% of the 2-stage pipelines'."
        if not out["count_misses"]
        else "Off the 10% target: " + "; ".join(out["count_misses"]) + "."
    )
    verdict4 = (
        "On every rank I + W is within 10% of B."
        if not out["split_misses"]
        else "Off the 10% target: " + "; ".join(out["split_misses"]) + "."
    )
    return f"""{SECTION_START}
## Pipeline schedules: measured bubble and throughput

`python bench/pipeline/run.py --out docs/benchmarks.md` (part 1: {args.reps} timed steps after
one warmup per row; parts 2 and 3: {args.real_reps} steps per variant after two warmups,
interleaved; parts 2 and 3: {args.runs} fresh runs each). Machine: {where}. Every number below was
measured in that invocation.

**1. The schedules.** 4 gloo ranks; one stage per rank for gpipe, 1f1b and zero_bubble, two per
rank (8 stages: dealt round-robin, or as a V for zbv and dualpipev) for the others. Each stage
is a 16-wide linear and a timed wait of T/v in forward and 2T/v in backward (T/v for each half
of a split backward), T = {_timed.T * 1e3:.0f} ms, v the stages per rank: every rank does the
same work under every schedule. The waits sleep, so four ranks on this {os.cpu_count()}-core
machine measure the schedule, not the CPU. The measured bubble comes from the runtime's record
of each timed step (`graph.last_step()`, combined over the ranks with `StepRecord.combine`): 1 -
computing time / (ranks x makespan), where a rank waiting for a message is idle; the row shows
the step with the median bubble (its peak live too). "Formula" is
the schedule's closed form (docs/pipeline-schedules.md) with F = I = W; "simulated" is
`Schedule.simulate()` with the same times. Peak live is the most micro-batches whose
activations one stage held at once (forward done, B or W not yet), measured, with the
schedule's own count (`Schedule.peak_live_microbatches`) in brackets. "One rank" runs the same
4 stages on one rank with the same accumulation (m x 4 x 3T).

{out["timed"]}

{verdict1} The waits are exact, so a miss is time the ranks spent outside the waits: the
runtime's own work per action (the linear, stand-ins for the stages a rank does not hold,
posting messages and, with two stages per rank, switching between micro-batch threads) and,
on this shared host, other processes taking the cores.

The 1F1B step with 8 micro-batches, drawn from the runtime's record (forward blue, backward
orange; time in ms):

![1F1B, 4 ranks, 8 micro-batches, measured]({SVG_TIMED})

**2. Real compute against torch.distributed.pipelining.** 2 stages, each
`{_real.LAYERS} x (Linear({_real.WIDTH}, {_real.WIDTH}), ReLU)`, batch {_real.BATCH} in
{_real.M} micro-batches, MSE loss, SGD, 2 gloo ranks with one thread each. torch: its
`PipelineStage` with `ScheduleGPipe` / `Schedule1F1B` (`loss_fn=mse_loss`); sbpflow:
`sbpflow.nn.Graph` with `set_stage` and the schedule of the same name; one rank: the same 2
stages on rank 0 with the same accumulation. The variants run interleaved (each repetition
runs each once, the order rotating); a step starts after a barrier and its time is the slowest
rank's; medians over the repetitions. Host CPU per action: the main thread's CPU time in each
forward and backward action (sbpflow: the runtime's compute actions, which include receiving
the stage's input, the loss and posting the sends; torch: `forward_one_chunk` /
`backward_one_chunk`, its schedule receiving, sending and computing the loss outside them),
median over the actions, per rank. Host CPU per step: the main thread's CPU time over the
whole step (every transfer, the loss and the optimizer step included on both sides), median
over the repetitions, per rank: the same work for both, and far less moved by other load on
the host than the step times.

{out["real"]}

{out["verdict"]}. Load average at the end: {out["end_load"]}.

An sbpflow 1F1B step of part 2, drawn from the runtime's record of both ranks:

![sbpflow 1F1B, 2 ranks, real compute, measured]({SVG_REAL})

**3. Host work per action, 2 stages against 4.** The same stages as two
2-stage pipelines running at once (ranks 0-1 and ranks 2-3) and as one 4-stage pipeline (ranks
0-3), interleaved in one run on 4 gloo ranks; host CPU per action as in part 2. A rank runs its
own stage and stand-ins for the others (docs/pipeline.md, "Stages run where they live"), so
its work per action should be its stage's, whatever the number of stages. Four ranks compute
and send at once in both, so each is measured under the same contention for this
{os.cpu_count()}-core machine. Ranks 0 and 3 hold the first and the last stage in both: the
same work, and the target (within 10%) is theirs. Ranks 1 and 2 hold an end stage of a 2-stage
pipeline and a middle stage of the 4-stage one, the only role that both receives and sends in
every action; they are listed without a target. "Transfers": the part of an action's CPU time
spent in the stage-to-stage transfers (posting and copying the sends, receiving). Each cell is
a rank's median over its actions, then the median over the {args.runs} runs.

{out["counts"]}

{verdict3}

**4. The split backward's weight pass.** The stages of part 2 under `1f1b` and `zero_bubble`,
interleaved on 2 gloo ranks: host CPU of the main thread per B of 1f1b against per I and per W
of zero_bubble (a rank's median over its actions), and the step times. The weight pass starts
from the gradients the input pass kept where each weight's gradient branches off
(docs/pipeline.md), so I + W should cost what B does (target: within 10%).

{out["split"]}

{verdict4}

**5. Where the bubble matters: zero bubble against 1F1B by micro-batch count.** With one stage
per rank, 1F1B and ZB-H1 (`zero_bubble`) run the same steady state: the last stage computes
F + B per micro-batch without a pause in both, and sets the pace. ZB-H1 gains only in the fill
and the drain, where its deferred weight passes fill 1F1B's idle time: on 2 ranks, one
backward of the first stage (2 units of F = I = W in (m + 1) x 3 of 1F1B's step), a share
that shrinks as m grows, while splitting the backward costs a little on every micro-batch of
the last stage (part 4). The same 2 stages as part 2, micro-batches of
{_real.BATCH // _real.M} rows, for m = {", ".join(map(str, _real.BUBBLE_MICROBATCHES))}; and
the same 8 layers cut into 4 stages of {_real.LAYERS // 2} on the 2 ranks (round-robin, or as
a V for zbv), m = {", ".join(map(str, _real.V_MICROBATCHES))}, under sbpflow and under torch's
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble` and `ScheduleZBVZeroBubble`
(`PipelineStage`, `loss_fn=mse_loss`). Every variant runs interleaved in one run
({args.real_reps} steps each after two warmups, a step timed as the slowest rank's), {args.runs}
fresh runs. Filling a bubble needs the core the waiting rank leaves idle: on a host whose
cores other processes keep busy, the fill saves nothing and the split's extra host work shows,
so these rows mean something only on an idle machine (load average below).

{out["bubble"]}
{SECTION_END}"""


if __name__ == "__main__":
    main()
