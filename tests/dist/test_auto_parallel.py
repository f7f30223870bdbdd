"""sbpflow.auto_parallel on 2 ranks: every rank makes the same plan, ``plan.apply`` converts
the model, and training then equals one plain process.

Each rank plans alone (no process group is touched while planning), applies the plan to a
copy of the single-process reference, feeds the batch in ``plan.input_sbp`` and trains 3 SGD
steps; the reference trains the plain copy on the whole batch in the same process.

``apply`` also hooks the module boundaries (NOTE [following the plan]), so the step boxes
where the plan says: the collectives that ran, recorded by ``sbpflow.boxing.trace()`` from
outside the plan, equal the plan's ``collectives()`` on every step, where sbpflow's own
propagation alone (``apply(follow=False)``) runs other ones.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.auto_parallel import ComputeModel
from sbpflow.auto_parallel._follow import followed_modules
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


def _ran(forward: Any, backward: Any) -> dict[tuple[str, str], int]:
    ran = Counter({("forward", op): n for op, n in forward.collectives().items()})
    return dict(ran + Counter({("backward", op): n for op, n in backward.collectives().items()}))


def plan_and_train_job(case: str) -> dict[str, Any]:
    """``megatron``: bench/tp's blocks, the batch pinned broadcast, priced with no eager cost
    per boxing step (so the plan is sequence parallel); ``megatron_default``: the same with
    the default prices; ``data``: small blocks and a wide batch, nothing pinned."""
    placement = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    tensor_parallel = case.startswith("megatron")
    dim, inner, rows = (256, 1024, 512) if tensor_parallel else (64, 256, 4096)
    reference = nn.Sequential(Block(dim, inner), Block(dim, inner))
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    fixed = {0: broadcast} if tensor_parallel else None
    compute = ComputeModel(100e9, 20e9) if case == "megatron" else None
    plan = sbpflow.auto_parallel(
        reference, placement, x, fixed=fixed, optimizer="sgd", compute_model=compute
    )
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before apply: the same parameters
    assert plan.apply(model) is model
    gx = x.to_global(placement, broadcast).to_global(sbp=plan.input_sbp[0])
    unfollowed = plan.apply(copy.deepcopy(reference), follow=False)  # propagation alone
    with sbpflow.boxing.trace() as forward:
        loss = unfollowed(gx).pow(2).mean()
    with sbpflow.boxing.trace() as backward:
        loss.backward()
    propagated = _ran(forward, backward)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, ran, followed = [], [], []
    for _ in range(_STEPS):
        want = reference(x).pow(2).mean()
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with sbpflow.boxing.trace() as forward:
            loss = model(gx).pow(2).mean()
        followed.append(followed_modules(model))
        with sbpflow.boxing.trace() as backward:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), want.item()))
        ran.append(_ran(forward, backward))
    errors = {}
    for (name, got), want_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        whole = got.to_global(sbp=(broadcast,) * len(got.sbp)).to_local().detach()
        error = (whole - want_p.detach()).abs().max().item()
        if error > _TOL:
            errors[name] = error
    predicted = Counter((c.phase, c.op) for c in plan.collectives() if c.is_collective)
    # a parameter's gradient reduced alone in the plan; buckets may fuse several (step 2 on)
    parameter_reductions = sum(
        1 for c in plan.collectives() if c.parameter_gradient and c.op == "all_reduce"
    )
    return {
        "layouts": {n: sbp_str(s) for n, s in plan.param_sbp.items()},
        "input": sbp_str(plan.input_sbp[0]),
        "explain": plan.explain(),
        "losses": losses,
        "errors": errors,
        "ran": ran,
        "propagated": propagated,
        "predicted": dict(predicted),
        "parameter_reductions": parameter_reductions,
        "followed": followed,
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


def _assert_follows(got: dict[str, Any]) -> None:
    """Every step runs exactly the plan's collectives, except that the gradient buckets may
    reduce several parameters' gradients in one all_reduce (the first backward included:
    data parallelism buckets it too)."""
    predicted = got["predicted"]
    key = ("backward", "all_reduce")
    alone = predicted.get(key, 0) - got["parameter_reductions"]
    for step, ran in enumerate(got["ran"]):
        others = {k: n for k, n in ran.items() if k != key}
        assert others == {k: n for k, n in predicted.items() if k != key}, (step, ran, predicted)
        low = alone + min(1, got["parameter_reductions"])
        assert low <= ran.get(key, 0) <= predicted.get(key, 0), (step, ran, predicted)


def test_megatron_plan_trains_like_one_process() -> None:
    """The batch pinned broadcast: the plan is Megatron's layout (up split(0), down
    split(1), the rest broadcast) and 3 steps equal one process. The plan reduce-scatters
    the blocks' outputs and all-gathers them where a block reads them (sequence parallel)
    where propagation alone all-reduces: each step runs exactly the plan's collectives."""
    got = _check(get_pool(2).run(plan_and_train_job, "megatron"))
    assert got["propagated"] != got["predicted"], got  # the two disagree here
    _assert_follows(got)
    megatron = {name: "B" for name in got["layouts"]}
    for name in megatron:
        if name.endswith(("up.weight", "up.bias")):
            megatron[name] = "S(0)"
        elif name.endswith("down.weight"):
            megatron[name] = "S(1)"
    assert got["layouts"] == megatron
    # the boundaries that box (around each block) stay followed on every step
    assert got["followed"][0] and got["followed"][1] == got["followed"][2], got["followed"]
    assert got["followed"][1], got["followed"]


def test_boundaries_that_never_box_stop_being_followed() -> None:
    """The data-parallel plan (parameters broadcast, the batch split) runs what propagation
    alone runs (its gradients all-reduced in the data-parallel buckets). The first step
    watches every boundary; none of them boxes, so from the second on none keeps its hooks,
    and steps 2 and 3 still run exactly the plan's collectives and equal one process.
    (Priced by bytes alone the Megatron blocks' plan is sequence parallel, where
    propagation all-reduces: test_megatron_plan_trains_like_one_process.)"""
    got = _check(get_pool(2).run(plan_and_train_job, "data"))
    _assert_follows({**got, "ran": [got["propagated"]]})  # propagation runs the plan's
    _assert_follows(got)
    first, later = got["followed"][0], got["followed"][1:]
    assert {"", "0", "0.up", "1", "1.up"} <= set(first), first  # the first step is watched
    assert later == [[]] * 2, got["followed"]


def test_data_parallel_plan_trains_like_one_process() -> None:
    """Nothing fixed, a batch far larger than the weights: the plan is data parallel (every
    parameter broadcast, the batch split on dim 0) and 3 steps equal one process (the
    gradients' all_reduces ran)."""
    got = _check(get_pool(2).run(plan_and_train_job, "data"))
    assert set(got["layouts"].values()) == {"B"} and got["input"] == "S(0)", got
    _assert_follows(got)
    assert got["predicted"].get(("backward", "all_reduce"), 0) > 0, got["predicted"]
