"""Autograd through boxing: local leaf -> to_global(src) -> to_global(dst) -> to_local().

Compared with a single-process gradient. Each rank computes
``loss_r = sum(local_r * W[box_r])`` with ``W`` a fixed logical weight and
``box_r`` the region its destination piece covers, so the ranks' losses add up
to ``L = c * sum(X * W)`` with ``c`` the number of destination ranks for a
broadcast output (each holds all of X) and 1 otherwise (split pieces tile X;
partial pieces sum to X). The logical gradient is ``G = c * W``, and each
rank's ``x.grad`` is read with the dual layout of the source (DESIGN §2):
split -> its slice of G, broadcast -> the ranks' grads sum to G, partial ->
every rank gets G; a rank outside the source placement gets zeros.

Every case of the 1-D and the cross-placement boxing tests runs, in one job.
"""

from __future__ import annotations

from typing import Any

import torch

import sbpflow
from sbpflow.sbp import Broadcast, Partial, Split

from ._reference import case_name, logical, piece, placement, source_local
from .test_boxing_1d import Case, one_d_cases
from .test_boxing_placements import placement_cases


def _weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return logical(shape, seed + 5)


def run_backward(cases: list[Case]) -> list[torch.Tensor | None]:
    """Worker: forward and backward for each case; return this rank's ``x.grad``."""
    rank = sbpflow.env.get_rank()
    grads = []
    for src_ranks, dst_ranks, shape, src, dst, seed in cases:
        value = logical(shape, seed)
        x = source_local(value, src_ranks, src, rank, seed).requires_grad_()
        y = x.to_global(placement(src_ranks), src).to_global(placement(dst_ranks), dst)
        local = y.to_local()
        if rank in dst_ranks:
            weight = piece(_weight(shape, seed), dst_ranks, dst, rank)
        else:
            weight = torch.zeros_like(local)
        (local * weight).sum().backward()
        grads.append(x.grad)
    return grads


def _check_grads(cases: list[Case], per_rank: list[list[Any]]) -> list[str]:
    problems = []
    for i, (src_ranks, dst_ranks, shape, src, dst, seed) in enumerate(cases):
        name = case_name(cases[i])
        copies = len(dst_ranks) if isinstance(dst, Broadcast) and len(dst_ranks) > 1 else 1
        logical_grad = copies * _weight(shape, seed)
        shard_input = isinstance(src, Split) and len(src_ranks) > 1
        grad_sum = torch.zeros_like(logical_grad)
        for rank, grads in enumerate(per_rank):
            grad = grads[i]
            if rank not in src_ranks:
                expected: torch.Tensor | None = torch.zeros(shape)
            elif isinstance(src, Broadcast) and len(src_ranks) > 1:
                if grad is None or grad.shape != logical_grad.shape:
                    problems.append(f"{name}: rank {rank} B-input grad is {grad!r}")
                else:
                    grad_sum += grad
                continue
            elif isinstance(src, Partial) or not shard_input:
                expected = logical_grad
            else:
                expected = piece(logical_grad, src_ranks, src, rank)
            if grad is None or grad.shape != expected.shape or not torch.equal(grad, expected):
                shown = None if grad is None else grad.tolist()
                problems.append(f"{name}: rank {rank} x.grad {shown}, expected {expected.tolist()}")
        if (
            isinstance(src, Broadcast)
            and len(src_ranks) > 1
            and not torch.equal(grad_sum, logical_grad)
        ):
            problems.append(
                f"{name}: B-input grads sum to {grad_sum.tolist()}, expected {logical_grad.tolist()}"
            )
    return problems


def test_gradients_through_1d_and_cross_placement_boxing(pool: Any) -> None:
    placements = [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 0, 3, 1)]
    cases = one_d_cases(placements) + placement_cases()
    per_rank = pool(4).run(run_backward, cases)
    problems = _check_grads(cases, per_rank)
    assert not problems, f"{len(problems)} of {len(cases)} cases wrong:\n" + "\n".join(
        problems[:40]
    )
