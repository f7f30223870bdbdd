"""Boxing benchmark: sbpflow ``to_global`` vs raw ``torch.distributed`` vs DTensor ``redistribute``.

One run spawns ``N`` gloo ranks per world size on this machine and times, for
each layout change and logical size, implementations that produce the same
local tensors:

- sbpflow: ``g.to_global(sbp=dst)`` on a global tensor (default path, so the
  metadata check collective is included; the data moves over gloo);
- raw: the minimal hand-written ``torch.distributed`` code for the same result,
  returning a new tensor and leaving the input as it was (1-D cases only);
- DTensor: ``DTensor.redistribute`` on a ``DeviceMesh("cpu", ...)``;
- sbpflow, no meta check: ``check_meta=False`` (a reference: what the check costs);
- collective only: the bare collective on buffers made once (1-D; a floor).

# NOTE [timing]
# The implementations are interleaved: every repetition runs each of them once,
# in an order that rotates from one repetition to the next, so drift in the
# machine's speed hits all of them alike. Each timed op starts right after a
# barrier; its time is the maximum over ranks of (end - start) on that rank.
# Warmup repetitions (planning caches, group creation, allocator) are dropped.
# We report the minimum and median over repetitions; ratios use both.

Usage (from the repository root)::

    python bench/boxing/run.py                      # 2 and 4 ranks, 4 and 64 MiB
    python bench/boxing/run.py --quick              # a fast smoke run
    python bench/boxing/run.py --only "P -> B" --sizes 64 --ranks 2
    python bench/boxing/run.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import join_world, slowest_rank_times  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from sbpflow._layout import Layout  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A layout change written as SBP strings per mesh axis ("S0", "S1", "B", "P")."""

    src: tuple[str, ...]
    dst: tuple[str, ...]

    @property
    def mesh_ndim(self) -> int:
        return len(self.src)

    @property
    def name(self) -> str:
        def show(sig: tuple[str, ...]) -> str:
            parts = [s if s in ("B", "P") else f"S({s[1:]})" for s in sig]
            return parts[0] if len(parts) == 1 else "[" + ",".join(parts) + "]"

        return f"{show(self.src)} -> {show(self.dst)}"


CASES_1D = [
    Case(("S0",), ("B",)),
    Case(("P",), ("B",)),
    Case(("P",), ("S0",)),
    Case(("S0",), ("S1",)),
]
CASES_2D = [
    Case(("S0", "S1"), ("S1", "S0")),
    Case(("S0", "S0"), ("B", "B")),
    Case(("P", "P"), ("S0", "S1")),
    Case(("S0", "S0"), ("S1", "S1")),
]


def reps_for(mib: float, reps: int) -> int:
    """Timed repetitions at ``mib``: ``reps`` from 16 MiB up, more for smaller (noisier) ops."""
    return reps * max(1, min(5, round(16 / mib)))


def logical_shape(mib: float) -> tuple[int, int]:
    numel = int(mib * 2**20) // 4
    side = math.isqrt(numel)
    if side * side == numel and side % 4 == 0:
        return side, side
    return numel // 1024, 1024


# -- translating the SBP strings ------------------------------------------------------


def _sbpflow_sig(sig: tuple[str, ...]) -> tuple[Any, ...]:
    sbp = sbpflow.sbp
    named = {"B": sbp.broadcast, "P": sbp.partial_sum}
    return tuple(named[s] if s in named else sbp.split(int(s[1:])) for s in sig)


def _dtensor_sig(sig: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [Replicate() if s == "B" else Partial() if s == "P" else Shard(int(s[1:])) for s in sig]


# -- the implementations ----------------------------------------------------------

Ops = dict[str, tuple[Callable[[], Any], Callable[[], None]]]  # name -> (timed op, untimed refresh)


def _raw_ops(case: Case, local: torch.Tensor, world: int) -> Ops:
    """Hand-written ``torch.distributed`` code for a 1-D case: ``{name: (op, untimed refresh)}``.

    ``raw`` returns a fresh tensor and leaves the input as it was, as sbpflow and
    DTensor do; ``collective`` is the bare collective on buffers made once
    (in place for all_reduce), a floor no library call can reach.
    """
    src, dst = case.src[0], case.dst[0]
    rows, cols = local.shape
    if (src, dst) == ("S0", "B"):
        fixed = local.new_empty((rows * world, cols))

        def raw() -> torch.Tensor:
            out = local.new_empty((rows * world, cols))
            dist.all_gather_into_tensor(out, local)
            return out

        def bare() -> torch.Tensor:
            dist.all_gather_into_tensor(fixed, local)
            return fixed

        return {"raw": (raw, _nothing), "collective": (bare, _nothing)}
    if (src, dst) == ("P", "B"):
        buf = local.clone()

        def raw() -> torch.Tensor:
            out = local.clone()
            dist.all_reduce(out)
            return out

        def bare() -> torch.Tensor:
            dist.all_reduce(buf)
            return buf

        def refresh() -> None:
            buf.copy_(local)

        return {"raw": (raw, _nothing), "collective": (bare, refresh)}
    if (src, dst) == ("P", "S0"):
        fixed = local.new_empty((rows // world, cols))

        def raw() -> torch.Tensor:
            out = local.new_empty((rows // world, cols))
            dist.reduce_scatter_tensor(out, local)
            return out

        def bare() -> torch.Tensor:
            dist.reduce_scatter_tensor(fixed, local)
            return fixed

        return {"raw": (raw, _nothing), "collective": (bare, _nothing)}
    if (src, dst) == ("S0", "S1"):
        packed = local.view(rows, world, cols // world).transpose(0, 1).contiguous()
        fixed = local.new_empty((world * rows, cols // world))

        def raw() -> torch.Tensor:
            # all_to_all_single sends contiguous chunks: pack the dim-1 pieces first.
            send = local.view(rows, world, cols // world).transpose(0, 1).contiguous()
            out = local.new_empty((world * rows, cols // world))
            dist.all_to_all_single(out, send)
            return out

        def bare() -> torch.Tensor:
            dist.all_to_all_single(fixed, packed)
            return fixed

        return {"raw": (raw, _nothing), "collective": (bare, _nothing)}
    raise ValueError(f"no raw implementation for {case.name}")


def _nothing() -> None:
    return None


def _dtensor_result(out: Any) -> torch.Tensor:
    local = out.to_local()
    wait = getattr(local, "wait", None)
    return wait() if callable(wait) else local


def _build(case: Case, shape: tuple[int, int], rank: int, world: int, mesh: Any) -> Ops:
    """The timed callables per implementation, each checked once against a plain reference."""
    from torch.distributed.tensor import DTensor

    mesh_ranks = list(range(world)) if case.mesh_ndim == 1 else [[0, 1], [2, 3]]
    placement = sbpflow.placement("cpu", mesh_ranks)
    torch.manual_seed(1234)
    logical = torch.randn(shape)
    src, dst = Layout(placement, _sbpflow_sig(case.src)), Layout(placement, _sbpflow_sig(case.dst))
    local = logical[_slices(src.box(shape, rank))].clone()
    value = logical
    if "P" in case.src:  # ranks hold different partial values; the logical value is their sum
        local *= rank + 1
        value = logical * sum(r + 1 for r in range(world))
    g = sbpflow.to_global(local.clone(), placement, src.sbp, check_meta=False, shape=shape)
    d = DTensor.from_local(
        local.clone(), mesh, _dtensor_sig(case.src), run_check=False,
        shape=torch.Size(shape), stride=(shape[1], 1),
    )  # fmt: skip
    dst_dt = _dtensor_sig(case.dst)
    ops: Ops = {
        "sbpflow": (lambda: g.to_global(sbp=dst.sbp), _nothing),
        "sbpflow_unchecked": (lambda: g.to_global(sbp=dst.sbp, check_meta=False), _nothing),
        "dtensor": (lambda: _dtensor_result(d.redistribute(mesh, dst_dt)), _nothing),
    }
    if case.mesh_ndim == 1:
        ops.update(_raw_ops(case, local.clone(), world))
    expected = value[_slices(dst.box(shape, rank))]
    for name, (op, refresh) in ops.items():
        refresh()
        got = op()
        got = got.to_local() if name.startswith("sbpflow") else got
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-5, atol=1e-4):
            raise AssertionError(f"{name} gives a wrong result for {case.name} on rank {rank}")
    return ops


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _time_case(ops: dict[str, Any], reps: int, warmup: int) -> dict[str, list[float]]:
    names = list(ops)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            op, refresh = ops[name]
            refresh()
            dist.barrier()
            start = time.perf_counter()
            out = op()
            elapsed = time.perf_counter() - start
            del out
            if rep >= warmup:
                times[name].append(elapsed)
    return slowest_rank_times(times)  # time of an op = the slowest rank's time


def _worker(rank: int, world: int, port: int, config: dict[str, Any], result_path: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # "alltoall falls back"
    join_world(rank, world, port)  # one thread per rank at most: 2 cores, 2-4 ranks
    from torch.distributed.device_mesh import DeviceMesh

    mesh_1d = DeviceMesh("cpu", list(range(world)))
    mesh_2d = DeviceMesh("cpu", [[0, 1], [2, 3]]) if world == 4 else None
    cases = list(CASES_1D) + (list(CASES_2D) if world == 4 else [])
    cases = [c for c in cases if config["only"] is None or config["only"] in c.name]
    results = []
    for mib in config["sizes"]:
        shape = logical_shape(mib)
        for case in cases:
            mesh = mesh_1d if case.mesh_ndim == 1 else mesh_2d
            ops = _build(case, shape, rank, world, mesh)
            times = _time_case(ops, reps_for(mib, config["reps"]), config["warmup"])
            mesh_str = "x".join(map(str, mesh.shape))
            results.append(
                {"case": case.name, "ranks": world, "mesh": mesh_str, "mib": mib, "times": times}
            )
            del ops
            if rank == 0:
                meds = ", ".join(f"{n} {statistics.median(t) * 1e3:.1f}" for n, t in times.items())
                print(f"  {world} ranks, {mib:g} MiB, {case.name}: median ms {meds}", flush=True)
    if config["meta_calls"]:
        from bench.meta_check.run import _check_calls, _time_calls

        check = _time_calls(_check_calls(world), config["meta_calls"], warmup=5)["agree"]
        results.append({"meta_check": True, "ranks": world, "times": check})
    if rank == 0:
        Path(result_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# -- report ----------------------------------------------------------------------------


def _fmt(ts: list[float] | None) -> str:
    if not ts:
        return "—"
    return f"{min(ts) * 1e3:.2f} / {statistics.median(ts) * 1e3:.2f}"


def _ratio(a: list[float], b: list[float] | None) -> str:
    if not b:
        return "—"
    return f"{statistics.median(a) / statistics.median(b):.2f} / {min(a) / min(b):.2f}"


# Cases where sbpflow and DTensor run the same collectives (the others: sbpflow's plan is better).
SAME_COLLECTIVES = {"S(0) -> B", "P -> B", "P -> S(0)", "[P,P] -> [S(0),S(1)]"}
TARGET = 1.05  # sbpflow's data path / DTensor's, medians, where both run the same collectives


def _boxing(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if not r.get("meta_check")]


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | ranks (mesh) | size | sbpflow ms | raw ms | DTensor ms "
        "| sbpflow, no meta check ms | collective only ms "
        "| sbpflow / raw | sbpflow / DTensor | no meta check / DTensor | same collectives |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(_boxing(results), key=lambda r: (r["mesh"].count("x"), r["ranks"], r["mib"])):
        t = r["times"]
        same = "yes" if r["case"] in SAME_COLLECTIVES else "no: sbpflow's plan"
        lines.append(
            f"| {r['case']} | {r['ranks']} ({r['mesh']}) | {r['mib']:g} MiB | {_fmt(t['sbpflow'])} "
            f"| {_fmt(t.get('raw'))} | {_fmt(t['dtensor'])} | {_fmt(t['sbpflow_unchecked'])} "
            f"| {_fmt(t.get('collective'))} "
            f"| {_ratio(t['sbpflow'], t.get('raw'))} | {_ratio(t['sbpflow'], t['dtensor'])} "
            f"| {_ratio(t['sbpflow_unchecked'], t['dtensor'])} | {same} |"
        )
    return "\n".join(lines)


def render_meta_check(results: list[dict[str, Any]]) -> str:
    lines = ["| ranks | metadata check per call, min us | median us |", "|---|---|---|"]
    for r in results:
        if r.get("meta_check"):
            ts = r["times"]
            lines.append(
                f"| {r['ranks']} | {min(ts) * 1e6:.0f} | {statistics.median(ts) * 1e6:.0f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def misses(results: list[dict[str, Any]]) -> list[str]:
    """Cases off target: where both run the same collectives, sbpflow's data path (the default
    path less the metadata check, which is reported on its own) <= 1.05x DTensor (medians)."""
    out = []
    for r in _boxing(results):
        if r["case"] not in SAME_COLLECTIVES:
            continue
        t, where = r["times"], f"{r['case']} on {r['ranks']} ranks, {r['mib']:g} MiB"
        ratio = statistics.median(t["sbpflow_unchecked"]) / statistics.median(t["dtensor"])
        if ratio > TARGET:
            out.append(f"{where}: sbpflow (no meta check) / DTensor {ratio:.2f} > {TARGET}")
    return out


SECTION_START = "<!-- bench:boxing:start -->"
SECTION_END = "<!-- bench:boxing:end -->"


def section(
    table: str, meta_table: str, config: dict[str, Any], off_target: list[str], load: str
) -> str:
    sizes = ",".join(f"{s:g}" for s in config["sizes"])
    ranks = ",".join(map(str, config["ranks"]))
    args = f"--sizes {sizes} --ranks {ranks} --reps {config['reps']} --warmup {config['warmup']}"
    verdict = (
        [
            f"Target met (medians): where sbpflow and DTensor run the same collectives, sbpflow's "
            f"data path is within {TARGET}x of DTensor's in every case."
        ]
        if not off_target
        else ["Off target (medians):", ""] + [f"- {line}" for line in off_target]
    )
    return "\n".join(
        [
            SECTION_START,
            "## Boxing: `to_global` vs raw `torch.distributed` vs DTensor `redistribute`",
            "",
            f"Machine: `{machine()}`; load average {load}. Float32; size = logical tensor size.",
            "",
            f"Reproduce: `python bench/boxing/run.py {args} --out docs/benchmarks.md`",
            "",
            "- **sbpflow**: `g.to_global(sbp=dst)`, default path (`check_meta=True`, so the small "
            "metadata exchange every call makes is included).",
            "- **raw**: the minimal hand-written `torch.distributed` code giving the same local tensor "
            "as a new tensor, input untouched, as the other two do: `all_gather_into_tensor`, "
            "clone + `all_reduce`, `reduce_scatter_tensor`, pack + `all_to_all_single`. 1-D only.",
            '- **DTensor**: `DTensor.redistribute` on `DeviceMesh("cpu", ...)` (on CPU it runs '
            "S(i) -> S(j) as all_gather + chunk).",
            "- **sbpflow, no meta check**: `g.to_global(sbp=dst, check_meta=False)`: the same plan "
            "and collectives without the metadata check, which is timed on its own below. The "
            f"target compares this data path with DTensor's (<= {TARGET}x, medians) where both run "
            "the same collectives (column *same collectives*); elsewhere sbpflow's plan is better "
            "and the ratio is what it gains.",
            "- **collective only**: the bare collective on buffers made once (in-place `all_reduce`); "
            "a floor, not a like-for-like baseline: no allocation, which on this machine costs "
            "tens of ms per 64 MiB in page faults.",
            "",
            f"{config['reps']} timed repetitions at 16 MiB and up, more below (4 MiB: "
            f"{reps_for(4, config['reps'])}), after {config['warmup']} warmup; the implementations "
            "are interleaved (order rotating per repetition); a barrier before each op; an op's time "
            "is the slowest rank's. Times are `min / median` ms; ratios are `median / min` ratios "
            "(below 1: sbpflow faster).",
            "",
            table,
            "",
            *verdict,
            "",
            "The metadata check every user-level `to_global` makes (on by default; one all_reduce "
            "of a hash of the call's metadata over the world, NOTE [meta check collectives]), timed "
            f"alone, {config['meta_calls']} calls per world size, the slowest rank's time per call:",
            "",
            meta_table,
            "",
            "The machine is shared and 64 MiB ops fault in fresh pages, so single runs are noisy: the "
            "first two sbpflow columns run the same data collectives, and their spread shows how "
            "much. `bench/meta_check/run.py` times the check and the collectives it could be built "
            "on. All three move the data over gloo, that is, through loopback TCP.",
            SECTION_END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,64", help="logical sizes in MiB (default 4,64)")
    parser.add_argument("--ranks", default="2,4", help="world sizes (default 2,4; 2-D needs 4)")
    parser.add_argument(
        "--reps", type=int, default=9, help="timed reps from 16 MiB up (default 9, x4 at 4 MiB)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions (default 2)")
    parser.add_argument("--only", help="run only the cases whose name contains this, e.g. 'P -> B'")
    parser.add_argument("--quick", action="store_true", help="1 MiB, 2 ranks, 3 reps: a smoke run")
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    parser.add_argument(
        "--meta-calls", type=int, default=500, help="metadata checks timed per world size"
    )
    args = parser.parse_args(argv)
    config = {
        "sizes": [float(s) for s in args.sizes.split(",")],
        "ranks": [int(r) for r in args.ranks.split(",")],
        "reps": args.reps,
        "warmup": args.warmup,
        "only": args.only,
        "meta_calls": args.meta_calls,
    }
    if args.quick:
        config.update(sizes=[1.0], ranks=[2], reps=3, warmup=1, meta_calls=50)
    print(f"# boxing benchmark on {machine()}", flush=True)
    load_start = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    for world in config["ranks"]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "results.json")
            mp.spawn(_worker, args=(world, free_port(), config, path), nprocs=world, join=True)
            results += json.loads(Path(path).read_text())
    load = f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (1 min)"
    table = render(results)
    meta_table = render_meta_check(results)
    off_target = misses(results)
    print(table)
    print(meta_table)
    print("\n".join(["off target:", *off_target]) if off_target else "all targets met")
    if args.out is not None:
        write_section(
            args.out,
            section(table, meta_table, config, off_target, load),
            SECTION_START,
            SECTION_END,
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
