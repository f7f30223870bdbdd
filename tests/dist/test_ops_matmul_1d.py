"""``torch.matmul`` with a 1-D operand on global tensors, against single-process torch.

matmul gives a 1-D operand a temporary size-1 dim and removes it again (for a
vector on the left, with an in-place ``squeeze_``), so the result's logical
shape depends on more than the products' rules: vector @ vector -> (),
vector @ matrix -> (n,), matrix @ vector -> (m,), batched @ vector and
vector @ batched drop the vector's dim. Every input is laid out as broadcast,
partial-sum and split on each of its dims, in every pairing; values and
shapes (and, for some pairings, gradients) must equal plain torch on the
logical tensors, computed in the same process, with no op falling back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sbpflow.sbp import Split
from sbpflow.testing import DistributedPool

from ._ops_support import B, P, check_cases, grid, make, placement, sbp_name

Case = tuple[str, Callable[[], Any], Callable[[], Any]]


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return grid(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


def _layouts(ndim: int) -> list[Any]:
    return [B, P, *(Split(d) for d in range(ndim))]


# (name, left operand, right operand): shapes chosen so every dim has its own length.
_SHAPES: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = [
    ("vector@vector", (6,), (6,)),
    ("vector@matrix", (6,), (6, 5)),
    ("matrix@vector", (5, 6), (6,)),
    ("batched@vector", (3, 5, 6), (6,)),
    ("vector@batched", (6,), (3, 6, 5)),
    ("batched4d@vector", (2, 3, 5, 6), (6,)),
    ("vector@batched4d", (6,), (2, 3, 6, 5)),
]


def _grads(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = torch.matmul(a, b)
    (out * _randn(tuple(out.shape), seed=99)).sum().backward()
    return [a.grad, b.grad]  # type: ignore[list-item]


def _cases(ranks: Any) -> list[Case]:
    pl = placement(ranks)
    cases: list[Case] = []
    for k, (name, sa, sb) in enumerate(_SHAPES):
        a, b = _randn(sa, seed=2 * k), _randn(sb, seed=2 * k + 1)
        for la, lb in itertools.product(_layouts(len(sa)), _layouts(len(sb))):
            tag = f"{name} {sbp_name(la)},{sbp_name(lb)}"
            cases.append(
                (
                    tag,
                    lambda a=a, b=b, la=la, lb=lb: torch.matmul(make(a, pl, la, 1), make(b, pl, lb, 2)),
                    lambda a=a, b=b: torch.matmul(a, b),
                )
            )  # fmt: skip
            if P not in (la, lb):  # gradients: the backward of every split pairing
                cases.append(
                    (
                        f"{tag} grads",
                        lambda a=a, b=b, la=la, lb=lb: _grads(make(a, pl, la, 3), make(b, pl, lb, 4)),
                        lambda a=a, b=b: _grads(a, b),
                    )
                )  # fmt: skip
    return cases


def run_cases(ranks: Any) -> tuple[list[str], list[str]]:
    """Worker: (failures, fallbacks) over every case."""
    return check_cases(_cases(ranks), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_matmul_with_vectors_matches_single_process(dist_pool: DistributedPool) -> None:
    """Each 1-D matmul shape, each input B, P or split on each dim: value, logical shape and
    gradients equal torch on the logical tensors (4 ranks: uneven splits)."""
    ranks = list(range(dist_pool.world_size))
    for rank, (failures, fallbacks) in enumerate(dist_pool.run(run_cases, ranks)):
        assert failures == [], f"rank {rank}: {len(failures)} failures: {failures[:12]}"
        assert fallbacks == [], f"rank {rank}: fell back: {fallbacks[:12]}"
