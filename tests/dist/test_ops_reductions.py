"""Reductions on global tensors, against single-process torch.

Each reduction over each dim set, in each input layout (uneven and empty
shards included: 2 rows over 4 ranks leaves two ranks with none), equals
torch on the logical tensor computed in the same process, gradients included;
reducing a split dim gives P (sum, mean), P(max) (max, amax) or B (argmax).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import PMAX, S0, S1, B, P, check_cases, grid, make, placement, sbp_name

Case = tuple[str, Callable[[], Any], Callable[[], Any]]

_REDUCTIONS: dict[str, Callable[[Any], Any]] = {
    "sum": torch.sum,
    "sum0": lambda x: x.sum(0),
    "sum1k": lambda x: x.sum(1, keepdim=True),
    "sum01": lambda x: x.sum((0, 1)),
    "mean": torch.mean,
    "mean0": lambda x: x.mean(0),
    "mean1k": lambda x: x.mean(1, keepdim=True),
    "amax0": lambda x: x.amax(0),
    "amax1": lambda x: x.amax(1),
    "max": torch.max,
    "max_dim0": lambda x: tuple(torch.max(x, 0)),
    "max_dim1k": lambda x: tuple(torch.max(x, 1, keepdim=True)),
    "min": torch.min,
    "min_dim1": lambda x: tuple(torch.min(x, 1)),
    "amin0": lambda x: x.amin(0),
    "argmax": torch.argmax,
    "argmax0": lambda x: x.argmax(0),
    "argmin1": lambda x: x.argmin(1),
    "var0": lambda x: x.var(0),
    "std1": lambda x: x.std(1),
    "var": torch.var,
    "norm": torch.linalg.vector_norm,
    "norm1": lambda x: torch.linalg.vector_norm(x, 1),
    "norm_inf": lambda x: torch.linalg.vector_norm(x, float("inf")),
    "norm3_dim0": lambda x: torch.linalg.vector_norm(x, 3, dim=0),
    "norm_dim1k": lambda x: torch.linalg.vector_norm(x, dim=1, keepdim=True),
    "torch.norm": torch.norm,
    "prod1": lambda x: x.prod(1),
    "logsumexp1": lambda x: x.logsumexp(1),
    "any0": lambda x: (x > 0.5).any(0),
    "all": lambda x: (x > -3).all(),
}

_GRADS: dict[str, Callable[[Any], Any]] = {
    "sum0": lambda x: x.sum(0),
    "mean": torch.mean,
    "mean1": lambda x: x.mean(1),
    "amax0": lambda x: x.amax(0),
    "max": torch.max,
    "norm": torch.linalg.vector_norm,
    "var1": lambda x: x.var(1),
}


def _grad(fn: Callable[[Any], Any], x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    out = fn(x)
    (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    assert x.grad is not None
    return x.grad


def _cases(pl: sbpflow.Placement, layouts: list[Any]) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    values = {
        "6x5": grid(torch.randn(6, 5, generator=gen)),
        "2x3": grid(torch.randn(2, 3, generator=gen)),
    }
    cases: list[Case] = []
    for shape, v in values.items():
        for la in layouts:
            for name, op in _REDUCTIONS.items():
                cases.append((f"{name} {shape} {sbp_name(la)}", lambda op=op, v=v, la=la: op(make(v, pl, la, 1)),
                              lambda op=op, v=v: op(v)))  # fmt: skip
            other = v + (v == v.max()).float()  # differs in one element
            cases.append((f"equal {shape} {sbp_name(la)}",
                          lambda v=v, la=la, other=other: [torch.equal(make(v, pl, la, 4), make(v, pl, B)),
                                                           torch.equal(make(v, pl, la, 4), make(other, pl, S0))],
                          lambda: [True, False]))  # fmt: skip
            for name, op in _GRADS.items():
                cases.append((f"grad {name} {shape} {sbp_name(la)}", lambda op=op, v=v, la=la: _grad(op, make(v, pl, la, 2)),
                              lambda op=op, v=v: _grad(op, v)))  # fmt: skip
        for name in ("amax0", "max", "norm_inf", "sum"):  # a P(max) input: max passes it through
            op = _REDUCTIONS[name]
            cases.append((f"{name} {shape} P(max)", lambda op=op, v=v: op(make(v, pl, PMAX, 3)),
                          lambda op=op, v=v: op(v)))  # fmt: skip
    scalar = grid(torch.randn((), generator=gen))  # a 0-dim tensor: dim=0 / -1 reduce nothing
    zero_dim: dict[str, Callable[[Any], Any]] = {
        "mean0k": lambda x: x.mean(0, keepdim=True),
        "mean-1": lambda x: x.mean(-1),
        "sum0k": lambda x: x.sum(0, keepdim=True),
        "amax0": lambda x: x.amax(0),
        "var0": lambda x: x.var(0, correction=0),
        "norm0": lambda x: torch.linalg.vector_norm(x, dim=0),
    }
    for name, op in zero_dim.items():
        for la in (B, P):
            cases.append((f"{name} 0-dim {sbp_name(la)}", lambda op=op, la=la: op(make(scalar, pl, la, 5)),
                          lambda op=op: op(scalar)))  # fmt: skip
    return cases


def run_reductions(ranks: Any, layouts: list[Any]) -> tuple[list[str], list[str]]:
    """Worker: (failures, fallbacks) over every case."""
    return check_cases(_cases(placement(ranks), layouts), atol=1e-5, rtol=1e-4)


def output_layouts(ranks: list[int]) -> dict[str, str]:
    """Worker: the output SBP of reductions over a split dim (and over a kept one)."""
    pl = placement(ranks)
    x = make(torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), pl, S0)
    outputs = {
        "sum0": x.sum(0),
        "sum1": x.sum(1),
        "mean0": x.mean(0),
        "amax0": x.amax(0),
        "max": x.max(),
        "argmax": x.sum(1).argmax(),  # over the only dim, which is split
        "norm_inf": torch.linalg.vector_norm(x, float("inf")),
        "norm": torch.linalg.vector_norm(x),
    }
    return {name: sbp_name(t.sbp) for name, t in outputs.items()}


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_reductions_match_single_process(dist_pool: DistributedPool) -> None:
    """Every reduction in every layout equals torch on the logical tensor, with no fallback."""
    ranks = list(range(dist_pool.world_size))
    meshes = [(ranks, [S0, S1, B, P])]
    if dist_pool.world_size == 4:
        meshes = [(ranks, [S0, S1, P]), ([[0, 1], [2, 3]], [(S0, S1), (P, S0)])]
    for mesh, layouts in meshes:
        for rank, (failures, fallbacks) in enumerate(dist_pool.run(run_reductions, mesh, layouts)):
            assert failures == [], f"rank {rank}, mesh {mesh}: {failures[:10]}"
            assert fallbacks == [], f"rank {rank}, mesh {mesh}: {fallbacks[:10]}"


def test_reducing_a_split_dim_gives_partial_or_broadcast(dist_pool: DistributedPool) -> None:
    got = dist_pool.run(output_layouts, list(range(dist_pool.world_size)))[0]
    assert got == {
        "sum0": "P", "sum1": "S(0)", "mean0": "P", "amax0": "P(max)", "max": "P(max)",
        "argmax": "B", "norm_inf": "P(max)", "norm": "B",
    }  # fmt: skip
