"""A global leaf's gradient arrives in the leaf's own layout, however grad was turned on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool


def _leaf_grads(how: str) -> list[Any]:
    world = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    x_full = torch.randn(4 * world, 3, generator=torch.Generator().manual_seed(0))
    w_full = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    expected = x_full.t() @ torch.ones(4 * world, 2)  # d(sum(x @ w)) / dw
    out = []
    for layout in (broadcast, split(0)):
        x = x_full.to_global(placement, broadcast).to_global(sbp=split(0))
        w = w_full.to_global(placement, broadcast).to_global(sbp=layout)
        if how == "attribute":
            w.requires_grad = True
        else:
            w.requires_grad_()
        assert w.requires_grad and w.is_leaf
        (x @ w).sum().backward()
        out.append(
            (
                w.grad.sbp == w.sbp,
                torch.allclose(w.grad.to_global(sbp=broadcast).to_local(), expected, atol=1e-5),
            )
        )
        w.requires_grad = False
        out.append(w.requires_grad)
    return out


@pytest.mark.parametrize("how", ["attribute", "method"])
@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_leaf_gradient_keeps_the_leaf_layout(dist_pool: DistributedPool, how: str) -> None:
    for rank_result in dist_pool.run(_leaf_grads, how):
        assert rank_result == [(True, True), False, (True, True), False]
