"""Planner speed: a cold plan (empty caches) and a cached look-up, per layout change.

    python bench/planner/run.py                # default cases, 15 cold runs each
    python bench/planner/run.py --repeats 30 --calls 20000

Pure: no process group, nothing spawned. A cold run clears every planning
cache first (``planner.clear_cache``) and times one ``boxing.plan`` call; a
cached run times ``--calls`` back-to-back calls with the same arguments, as
``to_global`` makes them (``Layout`` objects), and divides. Each is repeated;
the table shows the minimum and the median over repetitions (and the median
CPU time of a cold plan, which other load on the machine does not inflate),
and the targets (cold < 50 ms on a 3-D mesh, cached < 20 us). On a busy
machine the wall-clock medians wander; the minimum is the machine's best.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from sbpflow._layout import Layout  # noqa: E402
from sbpflow.boxing import planner  # noqa: E402
from sbpflow.sbp import Broadcast, Partial, Split  # noqa: E402

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")
COLD_TARGET_S = 50e-3
CACHED_TARGET_S = 20e-6


def _pl(ranks: object) -> sbpflow.placement:
    return sbpflow.placement("cpu", ranks)


MESH_2X2 = _pl([[0, 1], [2, 3]])
MESH_2X4 = _pl([[0, 1, 2, 3], [4, 5, 6, 7]])
MESH_2X2X2 = _pl([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
MESH_2X2X2_OTHER = _pl([[[8, 9], [10, 11]], [[12, 13], [14, 15]]])

# (label, shape, src layout, dst layout)
CASES = [
    ("2x2 (S0,S1)->(S1,S0)", (1024, 1024), Layout(MESH_2X2, (S0, S1)), Layout(MESH_2X2, (S1, S0))),
    ("2x4 (P,S0)->(S1,B)", (1024, 1024), Layout(MESH_2X4, (P, S0)), Layout(MESH_2X4, (S1, B))),
    (
        "2x2x2 (S0,S0,S0)->(S1,S1,S1)",
        (64, 64, 64),
        Layout(MESH_2X2X2, (S0, S0, S0)),
        Layout(MESH_2X2X2, (S1, S1, S1)),
    ),
    (
        "2x2x2 (P,S0,B)->(S1,P,S2)",
        (64, 64, 64),
        Layout(MESH_2X2X2, (P, S0, B)),
        Layout(MESH_2X2X2, (S1, P, S2)),
    ),
    (
        "2x2x2 (S0,S1,S2)->(B,B,B)",
        (63, 65, 67),
        Layout(MESH_2X2X2, (S0, S1, S2)),
        Layout(MESH_2X2X2, (B, B, B)),
    ),
    (
        "2x2x2 (P,P,S2)->(S2,S1,S0)",
        (64, 64, 64),
        Layout(MESH_2X2X2, (P, P, S2)),
        Layout(MESH_2X2X2, (S2, S1, S0)),
    ),
    (
        "2x2 -> [0,1,2,3] (S0,S1)->S1",
        (1024, 1024),
        Layout(MESH_2X2, (S0, S1)),
        Layout(_pl([0, 1, 2, 3]), (S1,)),
    ),
    (
        "[0..7] -> 2x2x2 S0->(S1,B,P)",
        (64, 64, 64),
        Layout(_pl(list(range(8))), (S0,)),
        Layout(MESH_2X2X2, (S1, B, P)),
    ),
    (
        "2x2x2 -> 2x2x2 (other ranks)",
        (64, 64, 64),
        Layout(MESH_2X2X2, (S0, P, B)),
        Layout(MESH_2X2X2_OTHER, (B, S1, S0)),
    ),
]


def _cold(
    shape: tuple[int, ...], src: Layout, dst: Layout, repeats: int
) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds of ``repeats`` cold plans."""
    wall, cpu = [], []
    for _ in range(repeats):
        planner.clear_cache()
        start, start_cpu = time.perf_counter(), time.process_time()
        planner.plan(shape, torch.float32, src, dst)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def _cached(
    shape: tuple[int, ...], src: Layout, dst: Layout, repeats: int, calls: int
) -> list[float]:
    plan = planner.plan
    plan(shape, torch.float32, src, dst)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            plan(shape, torch.float32, src, dst)
        times.append((time.perf_counter() - start) / calls)
    return times


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:8.2f} us"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="cold runs and cached loops per case"
    )
    parser.add_argument("--calls", type=int, default=10000, help="calls per cached loop")
    args = parser.parse_args()

    header = (
        f"{'case':<34}{'steps':>6}{'cold min':>12}{'cold median':>13}{'(cpu median)':>14}"
        f"{'cached min':>12}{'cached median':>15}"
    )
    print(header)
    print("-" * len(header))
    worst_cold_3d, worst_cached = 0.0, 0.0
    for label, shape, src, dst in CASES:
        cold, cold_cpu = _cold(shape, src, dst, args.repeats)
        cached = _cached(shape, src, dst, max(3, args.repeats // 2), args.calls)
        steps = len(planner.plan(shape, torch.float32, src, dst).steps)
        if src.placement.ndim == 3 or dst.placement.ndim == 3:
            worst_cold_3d = max(worst_cold_3d, statistics.median(cold))
        worst_cached = max(worst_cached, statistics.median(cached))
        print(
            f"{label:<34}{steps:>6}{_fmt(min(cold)):>12}{_fmt(statistics.median(cold)):>13}"
            f"{_fmt(statistics.median(cold_cpu)):>14}{_fmt(min(cached)):>12}{_fmt(statistics.median(cached)):>15}"
        )
    print()
    print(
        f"worst cold median on a 3-D mesh {_fmt(worst_cold_3d).strip()} "
        f"(target < {COLD_TARGET_S * 1e3:.0f} ms: {'ok' if worst_cold_3d < COLD_TARGET_S else 'MISSED'}); "
        f"worst cached median {_fmt(worst_cached).strip()} "
        f"(target < {CACHED_TARGET_S * 1e6:.0f} us: {'ok' if worst_cached < CACHED_TARGET_S else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
