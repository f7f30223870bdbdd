"""torch.optim on global parameters, against the same optimizer on a single-process model.

SGD (momentum), Adam and AdamW take 5 steps on a global ``Linear`` (data
parallel: broadcast parameters and a split batch; tensor parallel: split
weights) and must end within 1e-5 of the plain model trained on the whole
batch in the same process. Gradients arrive in their parameter's layout, so
``optimizer.step()`` runs no collective; nothing falls back. (``GradScaler`` and
autocast: test_amp.py.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import sbp_str
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, logical, make, world

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, **kw: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, weight_decay=0.01, **kw
    ),
    "adam": lambda params, **kw: torch.optim.Adam(params, lr=0.05, **kw),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, **kw),
}

_PARAM_LAYOUTS: dict[str, Callable[[str, torch.Tensor], Any]] = {
    "data parallel": lambda name, t: B,
    "column parallel": lambda name, t: S0,  # output features split (weight rows, bias)
    "row parallel": lambda name, t: S1 if name == "weight" else B,  # input features split
}


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def train(optimizer: str, layouts: str, foreach: bool) -> dict[str, Any]:
    """Worker: 5 steps on a global Linear and on a plain copy; compare."""
    pl = world()
    torch.manual_seed(0)
    reference = torch.nn.Linear(5, 3)
    # Local parameters passed with split(d) are shards: convert as B, then box to the layouts.
    model = copy.deepcopy(reference).to_global(pl, B).to_global(pl, _PARAM_LAYOUTS[layouts])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    gx, gy = make(x, pl, S0), make(y, pl, S0)
    kwargs = {"foreach": True} if foreach else {}
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    opt = _OPTIMIZERS[optimizer](model.parameters(), **kwargs)
    step_collectives: dict[str, int] = {}
    with sbpflow.boxing.trace() as t:
        for _ in range(5):
            for o, m, inputs in ((opt_ref, reference, (x, y)), (opt, model, (gx, gy))):
                o.zero_grad()
                _loss(m, *inputs).backward()
                if o is opt:
                    grad_layouts = {
                        n: (sbp_str(p.grad.sbp), sbp_str(p.sbp)) for n, p in m.named_parameters()
                    }
                    with sbpflow.boxing.trace() as t_step:
                        o.step()
                    step_collectives.update(t_step.collectives())
                else:
                    o.step()
    errors = {
        name: (logical(p) - ref).abs().max().item()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True)
    }
    return {
        "errors": errors,
        "fallbacks": sorted(set(t.fallbacks)),
        "step_collectives": step_collectives,
        "grad_layouts": grad_layouts,
    }


def train_all() -> list[tuple[str, dict[str, Any]]]:
    """Worker: every optimizer x parameter layouts x foreach."""
    return [
        (f"{optimizer} foreach={foreach} {layouts}", train(optimizer, layouts, foreach))
        for optimizer in _OPTIMIZERS
        for layouts in _PARAM_LAYOUTS
        for foreach in (False, True)
    ]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_optimizers_match_single_process(dist_pool: DistributedPool) -> None:
    """Each optimizer's 5 steps equal the single-process model within 1e-5; step() is local."""
    for results in dist_pool.run(train_all):
        for label, got in results:
            assert max(got["errors"].values()) < 1e-5, f"{label}: {got['errors']}"
            assert got["fallbacks"] == [], label
            assert got["step_collectives"] == {}, label
            for name, (grad_sbp, param_sbp) in got["grad_layouts"].items():
                assert grad_sbp == param_sbp, f"{label}: {name}'s grad is {grad_sbp}"
