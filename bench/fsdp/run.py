"""Fully sharded data parallelism: torch ``fully_shard`` (FSDP2) vs sbpflow ``fully_shard``.

One run spawns 2 gloo ranks on this machine; each trains the same model, 6 residual MLP
blocks (``x + fc2(relu(fc1(x)))``, 512 -> 2048 -> 512, 12.6M parameters, fp32), with
AdamW, 256 rows per rank, one step at a time (zero_grad, forward, MSE loss, backward,
optimizer.step), ``fully_shard`` on each block and then on the root, in both libraries:

- torch fully_shard: ``torch.distributed.fsdp.fully_shard`` (FSDP2) on a 1-D device mesh
  of the same ranks, its defaults; each rank's batch a local tensor (FSDP2 averages the
  gradients over the ranks, so the step is the same as a mean loss over the whole batch);
- sbpflow fully_shard: ``sbpflow.nn.parallel.fully_shard``, its defaults; each rank's batch
  made global ``split(0)`` in the hot-loop form (``shape=`` the logical shape,
  ``check_meta=False``).

Both use the same gloo process group (the world). Time: the variants are interleaved
(NOTE [timing] in bench/boxing/run.py): every repetition runs each once, in an order
rotating from one repetition to the next; a step starts after a barrier and its time is
the maximum over ranks; warmup steps are dropped; min and median over repetitions are
printed with their ratios to torch's, and the median CPU time of a step
(``time.process_time``: every thread of the rank's process, gloo's included).

Memory: after the timed steps each variant is built again and trains 6 steps under
``torch.profiler`` with ``profile_memory=True``, with torch's CPU allocator counting the
bytes it holds in every thread of the rank's process (NOTE [every thread's bytes]). A
step's peak is the most bytes allocated inside the window and alive at once during the
step (model, gradients, optimizer state, gathered parameters, activations and collective
buffers, gloo's worker threads' included: "tracked bytes"), read at each allocation the
profiler records; a variant's peak is the median over steps 2 to 6, the larger rank's.
Memory gloo takes outside torch's allocator is not seen, in either library.

# NOTE [every thread's bytes]
# The profiler reports, with each allocation, the bytes torch's CPU allocator holds; but
# by default the allocator counts only the frees made on a thread the profiler follows.
# A buffer freed on gloo's worker thread (a collective's input, its flat copy, dropped
# when the worker releases the work) then stays counted for the rest of the window, and
# how many are depends on which thread drops them last: measured so, the bytes held at
# the end of a step (the model state, 96 MiB here) crept up by 8 or 16 MiB on some
# steps (to 208 MiB after 8 steps), in both libraries, and the peaks with them. c10's
# flag ``caffe2_report_cpu_memory_usage`` makes the allocator count every thread's
# allocations and frees; it has no Python setter, so ``_count_every_thread`` sets it
# through ctypes for the measurement. With it, the bytes held at the end of every step
# are the same from step to step (the model state), as a training loop's must be.
# A model under either library's fully_shard is a reference cycle (module and state),
# so the variant measured before is freed by the garbage collector, whenever it runs:
# inside the next variant's window, its frees (48 MiB of parameters and gradients)
# would lower that variant's peak; a collection before each window frees it first.

Usage (from the repository root)::

    python bench/fsdp/run.py                                # 3 runs of 10 repetitions
    python bench/fsdp/run.py --runs 1 --reps 3              # a quick run
    python bench/fsdp/run.py --out docs/benchmarks.md       # write the docs section
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, verdict, write_section  # noqa: E402
from sbpflow.nn.parallel import fully_shard  # noqa: E402
from sbpflow.sbp import split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

DIM, HIDDEN, NUM_BLOCKS = 512, 2048, 6
ROWS_PER_RANK = 256
WARMUP = 2
WORLD = 2
BASELINE = "torch fully_shard"
TARGETS: dict[str, tuple[float, float] | None] = {  # (step time, peak memory) / torch's
    BASELINE: None,
    "sbpflow fully_shard": (1.05, 1.10),
}
START, END = "<!-- bench:fsdp:start -->", "<!-- bench:fsdp:end -->"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


def make_model() -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(NUM_BLOCKS)])


def _builders(world: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Per variant: a function that builds the model and returns one training step."""
    torch.manual_seed(0)
    base = make_model()
    placement = sbpflow.placement("cpu", list(range(world)))
    x, y = torch.randn(ROWS_PER_RANK, DIM), torch.randn(ROWS_PER_RANK, DIM)

    def step_fn(model: nn.Module, inputs: Callable[[], tuple[Any, Any]]) -> Callable[[], None]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad()
            xb, yb = inputs()
            F.mse_loss(model(xb), yb).backward()
            opt.step()

        return step

    def torch_fsdp() -> Callable[[], None]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = copy.deepcopy(base)
        for block in model:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
        return step_fn(model, lambda: (x, y))

    def sbpflow_fsdp() -> Callable[[], None]:
        model = copy.deepcopy(base)
        for block in model:
            fully_shard(block, placement)
        fully_shard(model, placement)

        def global_batch() -> tuple[Any, Any]:
            shape = (world * ROWS_PER_RANK, DIM)
            return tuple(  # type: ignore[return-value]
                t.to_global(placement, split(0), shape=shape, check_meta=False) for t in (x, y)
            )

        return step_fn(model, global_batch)

    builders = {BASELINE: torch_fsdp, "sbpflow fully_shard": sbpflow_fsdp}
    assert list(builders) == list(TARGETS)
    return builders


MEASURED_STEPS = 5


@contextlib.contextmanager
def _count_every_thread() -> Iterator[None]:
    """torch's CPU allocator counts every thread's allocations and frees meanwhile (NOTE
    [every thread's bytes])."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    try:
        flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    except ValueError as e:
        raise RuntimeError(
            f"torch {torch.__version__}'s libc10 has no flag caffe2_report_cpu_memory_usage; "
            "the peak memory measurement needs it (NOTE [every thread's bytes])."
        ) from e
    before, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = before


def _peak_step_bytes(build: Callable[[], Callable[[], None]]) -> float:
    """The median over steps 2 to 6 of a fresh model of the most tracked bytes alive at once
    during the step (what earlier steps left alive, e.g. gradients, included)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()  # the variant measured before: freed now, not inside this window
    with (
        _count_every_thread(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        step = build()
        step()
        for _ in range(MEASURED_STEPS):
            with record_function("measured step"):
                step()
    markers, allocations = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name == "measured step":
            markers.append((node.start_time_ns, node.end_time_ns))
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            allocations.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    allocations.sort()
    base = allocations[0][2] - allocations[0][1]  # tracked before the window
    peaks = [
        max(total for at, _, total in allocations if start <= at <= end) - base
        for start, end in markers
    ]
    return statistics.median(peaks)


def _worker(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    join_world(rank, world, port)
    builders = _builders(world)
    names = list(builders)
    steps = {name: build() for name, build in builders.items()}
    times, cpu_times = interleaved_step_times(steps, WARMUP, reps)
    del steps
    peaks = {}
    for name in names:
        peak = torch.tensor([_peak_step_bytes(builders[name])], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks[name] = peak.item() / 2**20
    if rank == 0:
        queue.put((times, cpu_times, peaks))
    dist.barrier()


def _one_run(reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(WORLD, free_port(), reps, queue), nprocs=WORLD, start_method="spawn"
    )
    return queue.get()


def _table(
    times: dict[str, list[float]], cpu_times: dict[str, list[float]], peaks: dict[str, float]
) -> tuple[list[str], dict[str, tuple[float, float]]]:
    """Markdown rows of one run, and each variant's (median time, peak) ratios to torch's."""
    base_med = statistics.median(times[BASELINE])
    base_cpu, base_peak = statistics.median(cpu_times[BASELINE]), peaks[BASELINE]
    rows = [
        "| variant | min ms | median ms | / torch (median) | CPU ms (median) | CPU / torch "
        "| peak MiB per rank | / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for name, ms in times.items():
        lo, med, cpu = min(ms), statistics.median(ms), statistics.median(cpu_times[name])
        ratios[name] = (med / base_med, peaks[name] / base_peak)
        rows.append(
            f"| {name} | {lo:.1f} | {med:.1f} | {med / base_med:.2f} | {cpu:.1f} "
            f"| {cpu / base_cpu:.2f} | {peaks[name]:.1f} | {peaks[name] / base_peak:.2f} |"
        )
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="timed steps per variant and run")
    parser.add_argument("--runs", type=int, default=3, help="whole runs, fresh processes each")
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    num_params = sum(p.numel() for p in make_model().parameters())
    header = [
        f"Machine: `{machine()}`; {WORLD} gloo ranks on this host, one thread each.",
        "",
        f"{NUM_BLOCKS} residual MLP blocks {DIM} -> {HIDDEN} -> {DIM} "
        f"({num_params / 1e6:.1f}M parameters, fp32), {ROWS_PER_RANK} rows per rank, AdamW, "
        f"fully_shard on each block and the root; {args.reps} timed steps per variant and run "
        f"after {WARMUP} warmup, variants interleaved; a step's time is the slower rank's. "
        "Peak: the most bytes torch's CPU allocator holds at once during a step, every thread "
        "of the rank's process counted (gloo's workers included), read at each allocation "
        "torch.profiler records; model state included; median of "
        f"{MEASURED_STEPS} steps, the larger rank's.",
    ]
    print("\n".join(header), flush=True)
    per_run: list[dict[str, tuple[float, float]]] = []
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
        "| run | "
        + " | ".join(f"{n}: step / torch (median) | peak / torch" for n in targeted)
        + " |",
        "|---|" + "---|---|" * len(targeted),
    ]
    for run, ratios in enumerate(per_run):
        cells = " | ".join(f"{ratios[n][0]:.2f} | {ratios[n][1]:.2f}" for n in targeted)
        summary.append(f"| {run + 1} | {cells} |")
    verdicts = []
    for name in targeted:
        target = TARGETS[name]
        assert target is not None
        for i, what in enumerate(("step time", "peak memory")):
            ratios = [r[name][i] for r in per_run]
            verdicts.append(verdict(f"{name}, {what}", target[i], ratios, of=" torch's"))
    print(f"\nload average {load}\n" + "\n".join([*summary, "", *verdicts]))
    if args.out:
        lines = [
            START,
            "## Fully sharded data parallelism: torch fully_shard vs sbpflow fully_shard",
            "",
            *header,
            "",
            f"Load average {load}.",
            "",
            f"Reproduce: `python bench/fsdp/run.py --runs {args.runs} --reps {args.reps} "
            f"--out {args.out}`",
            "",
            "Median step time and peak memory over torch's, each run:",
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
