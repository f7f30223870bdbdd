"""``copy.copy`` and ``copy.deepcopy`` of a global parameter (NOTE [copies of global tensors]).

On 2 ranks a broadcast ``Linear``'s weight and bias are copied (fresh, or after the
originals trained a few steps, once their gradients are reduced in buckets), the copies are
trained with batches split over the ranks (data parallelism: each gradient arrives partial
and is reduced), then the originals are. Each SGD step is compared with the same step in plain
torch on one process, from the same values, on the whole batch; each gradient must be
broadcast like its parameter. A copy that shared the original's gradient hooks, or had
none, or took over the original's place in the data-parallel buckets, leaves a gradient
partial or reduces the wrong parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool

LR = 0.1
STEPS = 2


def _train(params: Sequence[torch.Tensor], gen: torch.Generator) -> list[tuple[bool, float]]:
    """``STEPS`` SGD steps on ``params`` (weight, bias): per step, whether every gradient had
    its parameter's layout, and the largest difference from plain torch's step."""
    placement = params[0].placement
    optimizer = torch.optim.SGD(params, lr=LR)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen)
        plain = [p.detach().to_local().clone().requires_grad_() for p in params]
        F.mse_loss(F.linear(x, *plain), y).backward()
        expected = [(p - LR * p.grad).detach() for p in plain]
        xs = x.to_global(placement, broadcast).to_global(sbp=split(0))
        ys = y.to_global(placement, broadcast).to_global(sbp=split(0))
        F.mse_loss(F.linear(xs, *params), ys).backward()
        layouts = all(p.grad.sbp == p.sbp for p in params)
        optimizer.step()
        optimizer.zero_grad()
        got = [p.detach().to_local() for p in params]
        diff = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
        out.append((layouts, diff))
    return out


def train_copies(kind: str, trained_first: bool) -> dict[str, Any]:
    """Worker: copy a broadcast Linear's parameters with ``copy.<kind>`` (after training the
    originals if ``trained_first``), train the copies, then the originals."""
    make: Callable[[Any], Any] = getattr(copy, kind)
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to_global(placement, broadcast)
    originals = [model.weight, model.bias]
    gen = torch.Generator().manual_seed(1)
    before = _train(originals, gen) if trained_first else []
    copies = [make(p) for p in originals]
    return {
        "before": before,
        "global": all(isinstance(c, sbpflow.GlobalTensor) and c.is_leaf for c in copies),
        "parameters": all(isinstance(c, torch.nn.Parameter) for c in copies),
        "copies": _train(copies, gen),
        "originals": _train(originals, gen),
    }


@pytest.mark.parametrize("trained_first", [False, True], ids=["fresh", "trained first"])
@pytest.mark.parametrize("kind", ["copy", "deepcopy"])
@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_a_copied_parameter_trains_like_the_original(
    dist_pool: DistributedPool, kind: str, trained_first: bool
) -> None:
    for rank, got in enumerate(dist_pool.run(train_copies, kind, trained_first)):
        assert got["global"] and got["parameters"], (rank, got)
        for which in ("before", "copies", "originals"):
            for step, (layouts, diff) in enumerate(got[which]):
                where = f"rank {rank}, {kind}: the {which}' step {step}"
                assert layouts, f"{where}: a gradient arrived in another layout than its parameter"
                assert diff <= 1e-6, f"{where}: {diff} away from plain torch"
