"""Metadata check benchmark: what one checked ``to_global`` pays for the check (NOTE [meta check]).

One run starts a pool of ``N`` gloo ranks per world size on this machine
(``sbpflow.testing.DistributedPool``) and times, call by call:

- ``agree``: the check of a global -> global conversion (every rank must hold
  the same metadata), as ``g.to_global(sbp=...)`` runs it;
- ``exchange``: the check of a local -> global conversion (the ranks' local
  shapes are gathered, the logical shape is computed from them);
- ``user_site`` and ``publish``: finding the user's line and telling the store
  about the call, which every check does before its collective;
- with ``--candidates``, the bare collectives the check could be built on, on
  the world's gloo group: an all_gather of the 24-value metadata vector, an
  all_to_all of that vector repeated once per rank, an all_reduce (MAX) of
  ``[h, -h]`` for a hash ``h``, an all_gather and an all_to_all of one int64.

Every call is timed on its own, back to back (no barrier: the check itself
synchronises the ranks), the forms taking turns in blocks; a call's time is
the slowest rank's. The minimum and median over the calls are reported, in
microseconds.

Usage (from the repository root)::

    python bench/meta_check/run.py                  # 2 and 4 ranks
    python bench/meta_check/run.py --candidates --calls 2000 --ranks 2,4
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import slowest_rank_times  # noqa: E402
from bench._report import machine  # noqa: E402
from sbpflow import _meta_check  # noqa: E402
from sbpflow.comm import _errors  # noqa: E402
from sbpflow.testing import DistributedPool  # noqa: E402

_BLOCK = 50


def _check_calls(world: int) -> dict[str, Callable[[], Any]]:
    """The two forms of the check, on the metadata of a 2-D float tensor."""
    placement = repr(sbpflow.placement("cpu", list(range(world))))
    boxing = _meta_check.RankMeta(None, torch.float32, (64, 32), placement, "S(0) -> B", False)
    local = _meta_check.RankMeta(None, torch.float32, (16, 32), placement, "S(0)", True)
    return {
        "agree": lambda: _meta_check.agree(boxing, "to_global (boxing)"),
        "exchange": lambda: _meta_check.exchange(local, "to_global", compare_shapes=False),
        # What each check adds before its collective (NOTE [call agreement]).
        "user_site": _errors.user_site,
        "publish (store.set)": lambda: _errors.publish("to_global", "run.py:1"),
    }


def _candidate_calls(world: int) -> dict[str, Callable[[], Any]]:
    """The bare collectives a check can be made of, on buffers made once."""
    vector = torch.arange(24, dtype=torch.int64)
    gathered = vector.new_empty(world * 24)
    repeated = vector.repeat(world)
    rows = vector.new_zeros((world, 24))
    rows[dist.get_rank()] = vector
    pair = torch.tensor([12345, -12345], dtype=torch.int64)
    one = torch.tensor([12345], dtype=torch.int64)
    ones = one.new_empty(world)
    ones_sent = one.repeat(world)
    return {
        "all_gather(24 x int64)": lambda: dist.all_gather_into_tensor(gathered, vector),
        "all_to_all(24 x int64, repeated)": lambda: dist.all_to_all_single(gathered, repeated),
        "all_reduce MAX([h, -h])": lambda: dist.all_reduce(pair.clone(), op=dist.ReduceOp.MAX),
        "all_reduce SUM(ranks x 24, own row set)": lambda: dist.all_reduce(rows.clone()),
        "all_gather(1 x int64)": lambda: dist.all_gather_into_tensor(ones, one),
        "all_to_all(1 x int64, repeated)": lambda: dist.all_to_all_single(ones, ones_sent),
    }


def _time_calls(calls: dict[str, Callable[[], Any]], num: int, warmup: int) -> dict[str, list]:
    """Per-call seconds (the slowest rank's), ``num`` calls of each form.

    The forms take turns in blocks of ``_BLOCK`` calls (the order rotating
    from one round to the next), so drift in the machine's load hits them
    alike; the first ``warmup`` calls of a block are not timed, since they
    wait for ranks still finishing the previous form.
    """
    names = list(calls)
    mine: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(-(-num // _BLOCK)):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            for i in range(warmup + _BLOCK):
                start = time.perf_counter()
                call()
                if i >= warmup:
                    mine[name].append(time.perf_counter() - start)
    return slowest_rank_times({name: ts[:num] for name, ts in mine.items()})


def measure(config: dict[str, Any]) -> dict[str, list[float]]:
    """A rank's job: the per-call times of every form (the same on every rank)."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    calls = _check_calls(world)
    if config["candidates"]:
        calls.update(_candidate_calls(world))
    return _time_calls(calls, config["calls"], config["warmup"])


def render(results: dict[int, dict[str, list[float]]]) -> str:
    lines = ["| ranks | call | min us | median us |", "|---|---|---|---|"]
    for world, times in results.items():
        for name, ts in times.items():
            lines.append(
                f"| {world} | {name} | {min(ts) * 1e6:.0f} | {statistics.median(ts) * 1e6:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per form")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per block")
    parser.add_argument("--candidates", action="store_true", help="also time bare collectives")
    args = parser.parse_args(argv)
    config = {"calls": args.calls, "warmup": args.warmup, "candidates": args.candidates}
    print(f"# metadata check benchmark on {machine()}", flush=True)
    results: dict[int, dict[str, list[float]]] = {}
    # The ranks unpickle the job by module name, which "__main__" is not in them.
    job = importlib.import_module("bench.meta_check.run").measure
    for world in [int(r) for r in args.ranks.split(",")]:
        with DistributedPool(world, timeout=1800.0) as pool:
            results[world] = pool.run(job, config)[0]
    print(render(results))


if __name__ == "__main__":
    main()
