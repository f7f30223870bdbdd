"""Transfers between placements run on a group of the ranks involved (NOTE [transfer groups]).

In a world of four, boxing between disjoint, overlapping and nested
placements (every pair of {S(0), S(1), B, P}, uneven shapes) must give the
pieces plain single-process PyTorch computes from the logical tensor the test
builds itself. The point-to-point ops must name the group of the union of the
two placements' ranks (never the default group, not even for the whole world:
NOTE [teardown]), the group's first transfer must
start with one all_reduce entered by every member, and a rank outside both
placements must enter no collective at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

import sbpflow
from sbpflow.comm import _p2p
from sbpflow.testing import DistributedPool

from ._reference import SBPS, case_name, logical, placement, source_local
from .test_boxing_1d import Case, check_values

PAIRS = [
    ((0,), (1,)),  # disjoint, ranks 2 and 3 outside both
    ((0, 1), (2, 3)),  # disjoint, the whole world involved
    ((0, 1), (1, 2)),  # overlapping, rank 3 outside
    ((0, 1, 2), (2, 1)),  # nested (the destination inside the source), rank 3 outside
    ((3,), (3, 1, 2)),  # nested (the source inside the destination), rank 0 outside
]


def transfer_cases() -> list[Case]:
    cases = []
    for pair_index, (src_ranks, dst_ranks) in enumerate(PAIRS):
        for sbp_index, (src, dst) in enumerate(itertools.product(SBPS, SBPS)):
            seed = 20_000 + 100 * pair_index + sbp_index
            cases.append((src_ranks, dst_ranks, (13, 5), src, dst, seed))
    return cases


class _Spy:
    """Records the collectives this rank enters: (name, ranks of the group, numel)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], int]] = []
        self._originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> _Spy:
        for name in ("batch_isend_irecv", "all_reduce", "all_to_all_single", "all_gather_single",
                     "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"):  # fmt: skip
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                for op in args[0]:
                    self.calls.append(("p2p", _ranks_of(op.group), op.tensor.numel()))
            else:
                numel = args[0].numel() if args and hasattr(args[0], "numel") else -1
                self.calls.append((name, _ranks_of(kwargs.get("group")), numel))
            return original(*args, **kwargs)

        return call


_WORLD = (-1,)  # what _ranks_of says for the default group


def _ranks_of(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return _WORLD
    return tuple(dist.get_process_group_ranks(group))


def _run_transfers(cases: list[Case]) -> list[tuple[Any, ...]]:
    """Worker: box each case; return (local, collectives, shape, sbp, calls, first use)."""
    rank = sbpflow.env.get_rank()
    out = []
    for case in cases:
        src_ranks, dst_ranks, shape, src, dst, seed = case
        value = logical(shape, seed)
        x = source_local(value, src_ranks, src, rank, seed).to_global(placement(src_ranks), src)
        union = tuple(sorted(set(src_ranks) | set(dst_ranks)))
        first = ("cpu", union, None) not in _p2p._ready  # no lane: a move between placements
        with sbpflow.boxing.trace() as t, _Spy() as spy:
            y = x.to_global(placement(dst_ranks), dst, check_meta=False)
        out.append(
            (y.to_local(), dict(t.collectives()), tuple(y.shape), str(y.sbp[0]), spy.calls, first)
        )
    return out


def _check_groups(cases: list[Case], per_rank: list[list[Any]]) -> list[str]:
    problems = []
    for i, (src_ranks, dst_ranks, *_) in enumerate(cases):
        union = tuple(sorted(set(src_ranks) | set(dst_ranks)))
        expected_group = union  # an sbpflow group, never the default one (_WORLD)
        for rank, results in enumerate(per_rank):
            calls, first = results[i][4], results[i][5]
            where = f"{case_name(cases[i])}, rank {rank}"
            if rank not in union:
                if calls:
                    problems.append(f"{where}: outside both placements but entered {calls}")
                continue
            p2p_groups = {group for name, group, _ in calls if name == "p2p"}
            if p2p_groups - {expected_group}:
                problems.append(f"{where}: point-to-point on {p2p_groups}, not {expected_group}")
            # the warm-up: a one-element all_reduce on the union's group (the plan's own
            # all_reduce of P data, on the source placement's group, moves the whole tensor)
            warmups = [g for name, g, n in calls if name == "all_reduce" and n == 1]
            if warmups != ([expected_group] if first and len(union) > 1 else []):
                problems.append(
                    f"{where}: all_reduce on {warmups}; first use of the group: {first}"
                )
    return problems


def test_transfers_between_placements(pool: Callable[[int], DistributedPool]) -> None:
    cases = transfer_cases()
    per_rank = pool(4).run(_run_transfers, cases)
    values = [[result[:4] for result in results] for results in per_rank]
    problems = check_values(cases, values) + _check_groups(cases, per_rank)
    sent = [r[i][1].get("send_recv", 0) for r in per_rank for i in range(len(cases))]
    assert sum(sent) > 0, "no case moved data point to point"
    assert not problems, f"{len(problems)} problems in {len(cases)} cases:\n" + "\n".join(
        problems[:40]
    )


@pytest.mark.parametrize("dist_pool", [1], indirect=True)
def test_a_transfer_within_one_rank_needs_no_group(dist_pool: DistributedPool) -> None:
    cases = [((0,), (0,), (13, 5), src, dst, 30_000) for src, dst in itertools.product(SBPS, SBPS)]
    per_rank = dist_pool.run(_run_transfers, cases)
    assert not check_values(cases, [[result[:4] for result in per_rank[0]]])
    assert all(not calls for *_, calls, _ in per_rank[0]), per_rank[0]
