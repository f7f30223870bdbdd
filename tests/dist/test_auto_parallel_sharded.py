"""An auto_parallel plan under a memory budget on 2 ranks: the parameters it stores split on
the data axis and reads whole run with ``fully_shard``'s runtime (NOTE [fully sharded
modules of a plan] in sbpflow/auto_parallel/_api.py), and training equals one process.

The model is 4 blocks 64 -> 256 -> 64 over 4096 rows, a budget 20% of the parameter,
gradient and AdamW state bytes below the replicated plan's predicted peak. Each step's collectives, recorded by ``sbpflow.boxing.trace()``, are
``fully_shard``'s: one all_gather per fully sharded module in the forward and one in the
backward, one reduce_scatter per module, all issued by its runtime (not by the boxing of an
op, which records a boxing plan); the rest is the data-parallel buckets' all_reduce.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import sbpflow
from sbpflow.nn.parallel import FSDPModule
from sbpflow.sbp import Split, broadcast, sbp_str
from sbpflow.testing import get_pool

from ..unit.test_auto_parallel import MlpBlock as Block

_STEPS = 3
_TOL = 1e-5


def _state_bytes(plan: sbpflow.auto_parallel.Plan) -> float:
    """Parameter, gradient and optimizer-state bytes per rank the plan predicts."""
    m = plan.memory
    return m.parameters + m.gradients + m.optimizer_state


def _gathers(plan: Any) -> bool:
    return any(step.op == "all_gather" for step in plan.steps)


def sharded_plan_job() -> dict[str, Any]:
    placement = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block(64, 256) for _ in range(4)])
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
    replicated = sbpflow.auto_parallel(reference, placement, x)
    state = _state_bytes(replicated)
    budget = replicated.memory.peak - 0.2 * state
    plan = sbpflow.auto_parallel(reference, placement, x, memory_budget=budget)
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made before apply
    assert plan.apply(model) is model
    gx = x.to_global(placement, broadcast).to_global(sbp=plan.input_sbp[0])
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
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
        ran.append(
            tuple(
                (dict(t.collectives()), sum(len(p.steps) for p in t.plans if _gathers(p)))
                for t in (forward, backward)
            )
        )
    errors, layouts = {}, {}
    for (name, got), want_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        layouts[name] = sbp_str(got.sbp)
        whole = got.to_global(sbp=broadcast).to_local().detach()
        error = (whole - want_p.detach()).abs().max().item()
        if error > _TOL:
            errors[name] = error
    split = sorted(n for n, sbp in plan.param_sbp.items() if isinstance(sbp[0], Split))
    modules = sorted({n.rpartition(".")[0] for n in split})
    named = dict(model.named_modules())
    return {
        "explain": plan.explain(),
        "planned": {n: sbp_str(s) for n, s in plan.param_sbp.items()},
        "layouts": layouts,
        "losses": losses,
        "errors": errors,
        "ran": ran,
        "split": split,
        "modules": modules,
        "fully_sharded": [m for m in modules if isinstance(named[m], FSDPModule)],
    }


def test_budget_plan_runs_its_sharded_parameters_with_fully_shard() -> None:
    results = get_pool(2).run(sharded_plan_job)
    first = results[0]
    for rank, got in enumerate(results):
        assert got["explain"] == first["explain"], f"rank {rank} made another plan"
        for step, (loss, want) in enumerate(got["losses"]):
            assert abs(loss - want) <= _TOL * max(1.0, abs(want)), (rank, step, loss, want)
        assert not got["errors"], f"rank {rank}: parameters differ from one process: {got}"
        # the parameters run as the plan lays them out, and some are stored split
        assert got["layouts"] == got["planned"], got
    assert first["split"], first["explain"]  # the budget forces sharding
    modules = first["modules"]
    for step, ((forward, boxed_forward), (backward, boxed_backward)) in enumerate(first["ran"]):
        # no op boxes a split weight to gather it, forward or backward: one all_gather per
        # fully sharded module before its forward and its backward, by fully_shard's runtime
        assert boxed_forward == boxed_backward == 0, (step, first["ran"])
        assert forward == {"all_gather": len(modules)}, (step, forward)
        assert backward.get("all_gather") == len(modules), (step, backward)
        assert backward.get("reduce_scatter") == len(modules), (step, backward)
    assert first["fully_sharded"] == modules, first


def _train(model: nn.Module, reference: nn.Module, plan: Any, x: torch.Tensor) -> dict[str, Any]:
    """Train ``model`` (``plan`` applied, its optimizer made before) and ``reference`` in one
    process for ``_STEPS`` AdamW steps: the losses, and how far each parameter is after."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gx = x.to_global(plan.placement, broadcast).to_global(sbp=plan.input_sbp[0])
    losses = []
    for _ in range(_STEPS):
        want = reference(x).pow(2).mean()
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = model(gx).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), want.item()))
    errors = {}
    for (name, got), want_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        error = (got.to_global(sbp=broadcast).to_local().detach() - want_p.detach()).abs().max()
        errors[name] = error.item()
    return {"losses": losses, "errors": errors}


def _assert_trains_as_one_process(results: list[dict[str, Any]], tol: float = _TOL) -> None:
    for rank, got in enumerate(results):
        for step, (loss, want) in enumerate(got["losses"]):
            assert abs(loss - want) <= tol * max(1.0, abs(want)), (rank, step, loss, want)
        far = {name: e for name, e in got["errors"].items() if e > tol}
        assert not far, f"rank {rank}: parameters differ from one process: {far}"


def apply_twice_job() -> dict[str, Any]:
    placement = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block(64, 256) for _ in range(4)])
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
    replicated = sbpflow.auto_parallel(reference, placement, x)
    state = _state_bytes(replicated)
    plan = sbpflow.auto_parallel(
        reference, placement, x, memory_budget=replicated.memory.peak - 0.2 * state
    )
    model = copy.deepcopy(reference)
    plan.apply(model, follow=False)
    stored = {n: sbp_str(p.sbp) for n, p in model.named_parameters()}
    assert plan.apply(model) is model  # the same plan again, now following it
    layouts = {n: sbp_str(p.sbp) for n, p in model.named_parameters()}
    result = _train(model, reference, plan, x)
    result.update(
        fully_sharded=[m.module for m in plan.fully_sharded],
        planned={n: sbp_str(s) for n, s in plan.param_sbp.items()},
        stored=stored,
        layouts=layouts,
    )
    return result


def test_applying_a_plan_twice_keeps_its_fully_sharded_modules() -> None:
    results = get_pool(2).run(apply_twice_job)
    _assert_trains_as_one_process(results)
    first = results[0]
    assert first["fully_sharded"], first  # the budget forces fully sharded modules
    assert first["stored"] == first["layouts"] == first["planned"], first


class Pos(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim))

    def forward(self) -> torch.Tensor:
        return self.weight.unsqueeze(0)  # a view of the parameter leaves the module


class PosModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Pos(256, 256)
        self.blocks = nn.Sequential(*[Block(256, 256) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x * 2.0 + self.pos())


def returned_view_job() -> dict[str, Any]:
    placement = sbpflow.placement("cpu", [0, 1])
    torch.manual_seed(0)
    reference = PosModel()
    x = torch.randn(8, 256, 256, generator=torch.Generator().manual_seed(1))
    replicated = sbpflow.auto_parallel(reference, placement, x)
    state = _state_bytes(replicated)
    plan = sbpflow.auto_parallel(
        reference, placement, x, memory_budget=replicated.memory.peak - 0.2 * state
    )
    model = copy.deepcopy(reference)
    plan.apply(model)
    result = _train(model, reference, plan, x)
    result["split"] = sorted(n for n, s in plan.param_sbp.items() if isinstance(s[0], Split))
    return result


def test_a_view_of_a_sharded_parameter_returned_from_its_module_trains() -> None:
    """``pos`` returns a view of its weight, read outside it: the weight is gathered op by
    op, not freed after ``pos``'s forward (freed, the view would be read after)."""
    results = get_pool(2).run(returned_view_job)
    assert "pos.weight" in results[0]["split"], results[0]  # the budget shards it
    # AdamW's first steps move a weight by about lr whatever its gradient's size: the
    # order of the ranks' sums shows in the 5th digit of a few
    _assert_trains_as_one_process(results, tol=1e-4)
