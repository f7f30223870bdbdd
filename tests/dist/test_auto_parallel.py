"""sbpflow.auto_parallel on 2 ranks: every rank makes the same plan, ``plan.apply`` converts
the model, and training then equals one plain process.

Each rank plans alone (no process group is touched while planning), applies the plan to a
copy of the single-process reference, feeds the batch in ``plan.input_sbp`` and trains 3 SGD
steps; the reference trains the plain copy on the whole batch in the same process.

The plan fixes the parameters' and inputs' layouts; the ops in between are still laid out by
sbpflow's own propagation at run time, which may box differently from the plan's op
strategies (the plan's collectives are a prediction, not yet what runs).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast, sbp_str
from sbpflow.testing import get_pool

_STEPS = 3
_TOL = 1e-5


class Block(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, inner)
        self.down = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def plan_and_train_job(case: str) -> dict[str, Any]:
    """``megatron``: bench/tp's blocks, the batch pinned broadcast; ``data``: small blocks and
    a wide batch, nothing pinned."""
    placement = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    dim, inner, rows = (256, 1024, 512) if case == "megatron" else (32, 64, 4096)
    reference = nn.Sequential(Block(dim, inner), Block(dim, inner))
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    fixed = {0: broadcast} if case == "megatron" else None
    plan = sbpflow.auto_parallel(reference, placement, x, fixed=fixed, optimizer="sgd")
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before apply: the same parameters
    assert plan.apply(model) is model
    gx = x.to_global(placement, broadcast).to_global(sbp=plan.input_sbp[0])
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, ran = [], []
    for _ in range(_STEPS):
        want = reference(x).pow(2).mean()
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with sbpflow.boxing.trace() as forward:
            loss = model(gx).pow(2).mean()
        with sbpflow.boxing.trace() as backward:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), want.item()))
        ran.append((dict(forward.collectives()), dict(backward.collectives())))
    errors = {}
    for (name, got), want_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        whole = got.to_global(sbp=(broadcast,) * len(got.sbp)).to_local().detach()
        error = (whole - want_p.detach()).abs().max().item()
        if error > _TOL:
            errors[name] = error
    predicted = Counter((c.phase, c.op) for c in plan.collectives() if c.is_collective)
    return {
        "layouts": {n: sbp_str(s) for n, s in plan.param_sbp.items()},
        "input": sbp_str(plan.input_sbp[0]),
        "explain": plan.explain(),
        "losses": losses,
        "errors": errors,
        "ran": ran,
        "predicted": dict(predicted),
    }


def _check(results: list[dict[str, Any]]) -> dict[str, Any]:
    first = results[0]
    for rank, got in enumerate(results):
        assert got["explain"] == first["explain"], f"rank {rank} made another plan"
        for step, (loss, want) in enumerate(got["losses"]):
            assert abs(loss - want) <= _TOL * max(1.0, abs(want)), (rank, step, loss, want)
        assert not got["errors"], (
            f"rank {rank}: parameters differ from one process: {got['errors']}"
        )
    return first


def test_megatron_plan_trains_like_one_process() -> None:
    """The batch pinned broadcast: the plan is Megatron's layout (up split(0), down
    split(1), the rest broadcast) and 3 steps equal one process."""
    got = _check(get_pool(2).run(plan_and_train_job, "megatron"))
    megatron = {name: "B" for name in got["layouts"]}
    for name in megatron:
        if name.endswith(("up.weight", "up.bias")):
            megatron[name] = "S(0)"
        elif name.endswith("down.weight"):
            megatron[name] = "S(1)"
    assert got["layouts"] == megatron


def test_data_parallel_plan_trains_like_one_process() -> None:
    """Nothing fixed, a batch far larger than the weights: the plan is data parallel (every
    parameter broadcast, the batch split on dim 0) and 3 steps equal one process (the
    gradients' all_reduces ran)."""
    got = _check(get_pool(2).run(plan_and_train_job, "data"))
    assert set(got["layouts"].values()) == {"B"} and got["input"] == "S(0)", got
    assert all(backward.get("all_reduce", 0) > 0 for _, backward in got["ran"]), got["ran"]
