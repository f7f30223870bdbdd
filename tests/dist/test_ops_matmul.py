"""Matrix products on global tensors, against single-process torch.

Values: every input layout pair of mm/addmm/bmm/mv/dot and a 3-D matmul and
linear equal torch on the logical tensors (reference computed in the same
process), gradients included. Layouts: inputs already in a rule's layouts
(DESIGN §4's table) give the rule's output SBP with no collective at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow.sbp import Split
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, check_cases, grid, make, placement, sbp_name

Case = tuple[str, Callable[[], Any], Callable[[], Any]]
S2 = Split(2)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return grid(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def _grads(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * _randn(*out.shape, seed=99)).sum().backward()
    return [t.grad for t in leaves]  # type: ignore[misc]


def fit(layout: Any, ndim: int) -> Any:
    """``layout`` with split dims past ``ndim`` moved to the last dim (for lower-rank operands)."""
    if isinstance(layout, tuple):
        return tuple(fit(s, ndim) for s in layout)
    return Split(ndim - 1) if isinstance(layout, Split) and layout.dim >= ndim else layout


def _cases(pl: sbpflow.Placement, layouts: list[Any], batch_layouts: list[Any]) -> list[Case]:
    a, b, bias = _randn(6, 5, seed=1), _randn(5, 7, seed=2), _randn(7, seed=3)
    x3, w = _randn(4, 3, 5, seed=4), _randn(6, 5, seed=5)
    ba, bb, vec = _randn(3, 4, 5, seed=6), _randn(3, 5, 2, seed=7), _randn(5, seed=8)
    cases: list[Case] = []
    for la, lb in itertools.product(layouts, layouts):
        tag = f"{sbp_name(la)},{sbp_name(lb)}"
        cases += [
            (f"mm {tag}", lambda la=la, lb=lb: make(a, pl, la, 1) @ make(b, pl, lb, 2), lambda: a @ b),
            (f"addmm {tag}", lambda la=la, lb=lb: torch.addmm(make(bias, pl, B), make(a, pl, la, 3), make(b, pl, lb, 4),
                                                              beta=0.5, alpha=2.0),
             lambda: torch.addmm(bias, a, b, beta=0.5, alpha=2.0)),
            (f"addmm bias like a {tag}", lambda la=la, lb=lb: torch.addmm(make(bias, pl, fit(la, 1), 5), make(a, pl, la, 6), make(b, pl, lb, 7)),
             lambda: torch.addmm(bias, a, b)),
            (f"mm grads {tag}", lambda la=la, lb=lb: _grads(torch.mm, make(a, pl, la, 8), make(b, pl, lb, 9)),
             lambda: _grads(torch.mm, a, b)),
            (f"linear grads {tag}", lambda la=la, lb=lb: _grads(F.linear, make(x3, pl, la, 10), make(w, pl, lb, 11)),
             lambda: _grads(F.linear, x3, w)),
            (f"mv {tag}", lambda la=la, lb=lb: torch.mv(make(a, pl, la, 12), make(vec, pl, fit(lb, 1), 13)),
             lambda: torch.mv(a, vec)),
            (f"dot {tag}", lambda la=la, lb=lb: torch.dot(make(vec, pl, fit(la, 1), 14), make(vec, pl, fit(lb, 1), 15)),
             lambda: torch.dot(vec, vec)),
        ]  # fmt: skip
    for la, lb in itertools.product(batch_layouts, batch_layouts):
        tag = f"{sbp_name(la)},{sbp_name(lb)}"
        cases += [
            (f"bmm {tag}", lambda la=la, lb=lb: torch.bmm(make(ba, pl, la, 16), make(bb, pl, lb, 17)), lambda: ba @ bb),
            (f"baddbmm {tag}", lambda la=la, lb=lb: torch.baddbmm(make(bb[:, :1], pl, fit(la, 3)), make(ba, pl, la, 18), make(bb, pl, lb, 19)),
             lambda: torch.baddbmm(bb[:, :1], ba, bb)),
            (f"matmul 3d {tag}", lambda la=la, lb=lb: make(x3, pl, la, 20) @ make(w.t().contiguous(), pl, fit(lb, 2), 21),
             lambda: x3 @ w.t()),
            (f"bmm grads {tag}", lambda la=la, lb=lb: _grads(torch.bmm, make(ba, pl, la, 22), make(bb, pl, lb, 23)),
             lambda: _grads(torch.bmm, ba, bb)),
        ]  # fmt: skip
    return cases


def run_matmul(
    ranks: Any, layouts: list[Any], batch_layouts: list[Any]
) -> tuple[list[str], list[str]]:
    """Worker: (failures, fallbacks) over every case."""
    return check_cases(_cases(placement(ranks), layouts, batch_layouts), atol=1e-4, rtol=1e-4)


_TABLE = [  # DESIGN §4
    ((S0, B), "S(0)"),
    ((B, S1), "S(1)"),
    ((S1, S0), "P"),
    ((P, B), "P"),
    ((B, P), "P"),
    ((B, B), "B"),
]


def rule_layouts(ranks: list[int]) -> list[tuple[str, dict[str, int]]]:
    """Worker: mm's output SBP and the collectives it ran, for inputs in the rule's layouts."""
    pl = placement(ranks)
    a, b = _randn(6, 5, seed=1), _randn(5, 7, seed=2)
    out = []
    for (la, lb), _ in _TABLE:
        x, y = make(a, pl, la, 1), make(b, pl, lb, 2)
        with sbpflow.boxing.trace() as t:
            z = x @ y
        out.append((sbp_name(z.sbp), dict(t.collectives())))
    x, y = make(_randn(3, 4, 5, seed=3), pl, S0), make(_randn(3, 5, 2, seed=4), pl, S0)
    with sbpflow.boxing.trace() as t:
        z = torch.bmm(x, y)
    out.append((sbp_name(z.sbp), dict(t.collectives())))
    return out


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_products_match_single_process(dist_pool: DistributedPool) -> None:
    """Every layout pair equals torch on the logical tensors, with no fallback."""
    ranks = list(range(dist_pool.world_size))
    meshes = [(ranks, [S0, S1, B, P], [S0, S1, S2, B, P])]
    if dist_pool.world_size == 4:
        meshes = [
            (ranks, [S0, S1, P], [S0, S2, P]),
            ([[0, 1], [2, 3]], [(S0, S1), (B, P), (S1, S0)], [(S0, S1), (S2, P)]),
        ]
    for mesh, layouts, batch_layouts in meshes:
        for rank, (failures, fallbacks) in enumerate(
            dist_pool.run(run_matmul, mesh, layouts, batch_layouts)
        ):
            assert failures == [], f"rank {rank}, mesh {mesh}: {failures[:10]}"
            assert fallbacks == [], f"rank {rank}, mesh {mesh}: {fallbacks[:10]}"


def test_rule_layouts_need_no_communication(dist_pool: DistributedPool) -> None:
    """(S(0),B)->S(0), (B,S(1))->S(1), (S(1),S(0))->P, (P,B)->P, (B,P)->P, (B,B)->B; bmm batch split."""
    for got in dist_pool.run(rule_layouts, list(range(dist_pool.world_size))):
        assert got == [(sbp, {}) for _, sbp in _TABLE] + [("S(0)", {})]
