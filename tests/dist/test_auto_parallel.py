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


class FusedBlocks(nn.Module):
    """``Block``s written as one module: no module boundary between the plan's ops."""

    def __init__(self, dim: int, inner: int, blocks: int) -> None:
        super().__init__()
        layers = [Block(dim, inner) for _ in range(blocks)]  # the same initialization
        self.norm = nn.ParameterList([p for b in layers for p in b.norm.parameters()])
        self.up = nn.ParameterList([p for b in layers for p in b.up.parameters()])
        self.down = nn.ParameterList([p for b in layers for p in b.down.parameters()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(0, len(self.up), 2):
            h = F.layer_norm(x, x.shape[-1:], self.norm[i], self.norm[i + 1])
            h = F.gelu(F.linear(h, self.up[i], self.up[i + 1]))
            x = x + F.linear(h, self.down[i], self.down[i + 1])
        return x


def _ran(forward: Any, backward: Any) -> dict[tuple[str, str], int]:
    ran = Counter({("forward", op): n for op, n in forward.collectives().items()})
    return dict(ran + Counter({("backward", op): n for op, n in backward.collectives().items()}))


def plan_and_train_job(case: str) -> dict[str, Any]:
    """``megatron``: bench/tp's blocks, the batch pinned broadcast, priced with no eager cost
    per boxing step (so the plan is sequence parallel); ``megatron_default``: the same with
    the default prices; ``fused``: as ``megatron``, the blocks written as one module;
    ``data``: small blocks and a wide batch, nothing pinned."""
    placement = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    tensor_parallel = case.startswith("megatron") or case == "fused"
    dim, inner, rows = (256, 1024, 512) if tensor_parallel else (64, 256, 4096)
    if case == "fused":
        reference: nn.Module = FusedBlocks(dim, inner, 2)
    else:
        reference = nn.Sequential(Block(dim, inner), Block(dim, inner))
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    fixed = {0: broadcast} if tensor_parallel else None
    compute = ComputeModel(100e9, 20e9) if case in ("megatron", "fused") else None
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
    # another batch size than the plan's: no call is the captured one, propagation lays out
    # the step as without a plan, and the values still equal one process
    short = x[: rows // 4]
    gshort = short.to_global(placement, broadcast).to_global(sbp=plan.input_sbp[0])
    got_short = model(gshort).to_global(sbp=broadcast).to_local().detach()
    error = (got_short - reference(short).detach()).abs().max().item()
    if error > _TOL:
        errors["another batch size"] = error
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


def test_a_plan_is_followed_op_by_op_inside_a_module() -> None:
    """The sequence-parallel plan of test_megatron_plan_trains_like_one_process, for the
    blocks written as one module: no module boundary inside, so only the ops themselves can
    take the planned strategies (reduce-scatter each block's output, gather it where the
    next block reads it) where propagation alone all-reduces. Each step runs exactly the
    plan's collectives in the forward, recorded from outside (``sbpflow.boxing.trace``), and
    3 steps equal one process. The backward is not matched op by op: autograd saved the
    inputs a planned op gathered before they were gathered, so it may gather them again
    (at most once per all_gather of the forward), and otherwise runs the plan's."""
    got = _check(get_pool(2).run(plan_and_train_job, "fused"))
    assert got["propagated"] != got["predicted"], got  # the two disagree here
    predicted = got["predicted"]
    assert predicted.get(("forward", "reduce_scatter"), 0) > 0, predicted
    gathers, reduces = ("backward", "all_gather"), ("backward", "all_reduce")
    for step, ran in enumerate(got["ran"]):
        forward = {k: n for k, n in ran.items() if k[0] == "forward"}
        assert forward == {k: n for k, n in predicted.items() if k[0] == "forward"}, (step, ran)
        others = {
            k: n for k, n in ran.items() if k[0] == "backward" and k not in (gathers, reduces)
        }
        assert others == {
            k: n for k, n in predicted.items() if k[0] == "backward" and k not in (gathers, reduces)
        }, (step, ran, predicted)
        again = ran.get(gathers, 0) - predicted.get(gathers, 0)
        assert 0 <= again <= predicted.get(("forward", "all_gather"), 0), (step, ran, predicted)
        assert ran.get(reduces, 0) <= predicted.get(reduces, 0), (step, ran, predicted)


def written_between_planned_ops_job() -> dict[str, float]:
    """``h @ m`` planned with ``h`` gathered, then ``h`` written in place (autograd allows it:
    ``add`` saves nothing), then ``h @ m`` planned again: the second product and the
    gradients against one process."""
    from sbpflow._decisions import FOLLOWING
    from sbpflow._layout import Layout
    from sbpflow._propagation import Planned
    from sbpflow.sbp import Split

    placement = sbpflow.placement("cpu", [0, 1])
    full = Layout(placement, (broadcast,)).normalized()
    planned = Planned((full, full), (full,))
    torch.manual_seed(0)
    a_plain, m_plain = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    a = a_plain.detach().to_global(placement, broadcast).to_global(sbp=Split(0))
    a.requires_grad_()
    m = m_plain.to_global(placement, broadcast)
    token = FOLLOWING.set(
        lambda func, args, kwargs: planned if func is torch.ops.aten.mm.default else None
    )
    try:
        h = a * 1
        first = h @ m
        h += 1
        second = h @ m
    finally:
        FOLLOWING.reset(token)
    (first.sum() + (second * second).sum()).backward()
    h_plain = a_plain * 1
    first_plain = h_plain @ m_plain
    h_plain = h_plain + 1
    second_plain = h_plain @ m_plain
    (first_plain.sum() + (second_plain * second_plain).sum()).backward()
    return {
        "second": (second.to_global(sbp=broadcast).to_local() - second_plain).abs().max().item(),
        "grad": (a.grad.to_global(sbp=broadcast).to_local() - a_plain.grad).abs().max().item(),
    }


def test_a_tensor_written_between_planned_ops_is_boxed_afresh() -> None:
    """A planned op boxes its input anew each time: an in-place write between two planned
    reads of the same tensor shows in the second one and in the gradients."""
    for errors in get_pool(2).run(written_between_planned_ops_job):
        assert max(errors.values()) < 1e-5, errors


def calibrate_job() -> dict[str, float]:
    from sbpflow.auto_parallel import calibrate_compute
    from sbpflow.boxing.cost import CostModel, LinkCost

    placement = sbpflow.placement("cpu", [0, 1])
    measured = calibrate_compute(placement, repeats=3)
    # a cost model pricing every collective at a second or more: no bare all_reduce of 16
    # floats takes longer, so none waited beyond its price
    slow = calibrate_compute(placement, repeats=3, cost_model=CostModel(LinkCost(1.0, 1e9)))
    return {
        "collective_seconds": measured.collective_seconds,
        "boxing_op_seconds": measured.boxing_op_seconds,
        "op_seconds": measured.op_seconds,
        "slow_collective_seconds": slow.collective_seconds,
    }


def test_calibrate_compute_times_the_wait_of_a_collective() -> None:
    """In a 2-rank job ``calibrate_compute`` measures ``collective_seconds`` (what a bare
    all_reduce over the placement took beyond its price in the cost model passed, NOTE
    [calibrated compute]): finite, not negative, zero where the cost model prices the
    collective above what it took, and the same on both ranks (rank 0's numbers)."""
    results = get_pool(2).run(calibrate_job)
    assert results[0] == results[1], results
    assert 0 <= results[0]["collective_seconds"] < 1.0, results
    assert results[0]["slow_collective_seconds"] == 0.0, results
    assert results[0]["boxing_op_seconds"] is not None, results
