"""Which modules an auto_parallel plan runs fully sharded (NOTE [fully sharded modules of a
plan] in sbpflow/auto_parallel/_api.py), in one process: plans made on meta tensors.

The expected sets are read from the plan's own layouts, independently of the detection: a
parameter stored split on the data axis whose every reader reads it broadcast there is
fully sharded; one a reader computes with split (Megatron's layout) is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Split, broadcast

from .test_auto_parallel import MlpBlock as Block


def _state_bytes(plan: sbpflow.auto_parallel.Plan) -> float:
    """Parameter, gradient and optimizer-state bytes per rank the plan predicts."""
    m = plan.memory
    return m.parameters + m.gradients + m.optimizer_state


def _blocks(dim: int, inner: int, rows: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim, inner) for _ in range(4)])
    return model, torch.randn(rows, dim)


def _split_on_data_axis(plan: sbpflow.auto_parallel.Plan) -> dict[str, int]:
    return {n: sbp[0].dim for n, sbp in plan.param_sbp.items() if isinstance(sbp[0], Split)}


def test_a_budget_plan_runs_its_split_weights_fully_sharded() -> None:
    placement = sbpflow.placement("cpu", [0, 1])
    model, x = _blocks(64, 256, 4096)
    replicated = sbpflow.auto_parallel(model, placement, x)
    assert replicated.fully_sharded == ()  # nothing split: data parallel
    state = _state_bytes(replicated)
    plan = sbpflow.auto_parallel(
        model, placement, x, memory_budget=replicated.memory.peak - 0.2 * state
    )
    split = _split_on_data_axis(plan)
    assert split, plan.explain()  # the budget forces sharding
    # every split weight feeds its Linear through a transpose that keeps it split, and the
    # addmm reads the transpose broadcast: gathered whole right before use
    for op in plan.ops:
        if op.op == "aten.addmm.default" and op.module in {n.rpartition(".")[0] for n in split}:
            assert isinstance(op.inputs[2][0], Broadcast), op
    got = {
        name: dim
        for sharded in plan.fully_sharded
        for name, dim in zip(sharded.params, sharded.dims, strict=True)
    }
    assert got == split
    assert [m.module for m in plan.fully_sharded] == sorted({n.rpartition(".")[0] for n in split})
    # each weight is gathered at its transpose's input, or kept split through the transpose
    # (then that transpose is left to propagation): the same bytes either way
    transposes = [op.index for op in plan.ops if op.op == "aten.t.default"]
    for sharded in plan.fully_sharded:
        assert len(sharded.ops) <= len(sharded.params) and set(sharded.ops) <= set(transposes)
    assert "fully sharded modules" in plan.explain()
    # the same plan on every call
    again = sbpflow.auto_parallel(
        model, placement, x, memory_budget=replicated.memory.peak - 0.2 * state
    )
    assert again.fully_sharded == plan.fully_sharded


def test_weights_computed_with_split_are_not_fully_sharded() -> None:
    """Megatron's layout (the batch broadcast): the split weights are read split."""
    placement = sbpflow.placement("cpu", [0, 1])
    model, x = _blocks(256, 1024, 512)
    plan = sbpflow.auto_parallel(model, placement, x, fixed={0: broadcast})
    assert _split_on_data_axis(plan), plan.explain()
    assert plan.fully_sharded == ()
    assert "fully sharded modules" not in plan.explain()


def _budget_plan(model: nn.Module, x: torch.Tensor) -> sbpflow.auto_parallel.Plan:
    placement = sbpflow.placement("cpu", [0, 1])
    replicated = sbpflow.auto_parallel(model, placement, x)
    state = _state_bytes(replicated)
    return sbpflow.auto_parallel(
        model, placement, x, memory_budget=replicated.memory.peak - 0.2 * state
    )


def _fully_sharded_params(plan: sbpflow.auto_parallel.Plan) -> set[str]:
    return {name for sharded in plan.fully_sharded for name in sharded.params}


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


def test_a_parameter_whose_view_leaves_its_module_is_not_fully_sharded() -> None:
    """Freed after the module's forward, the view would be read after it is freed."""
    torch.manual_seed(0)
    model = PosModel()
    plan = _budget_plan(model, torch.randn(8, 256, 256))
    split = _split_on_data_axis(plan)
    assert "pos.weight" in split, plan.explain()  # the budget shards it
    got = _fully_sharded_params(plan)
    assert "pos.weight" not in got, plan.explain()
    # the blocks' Linear weights, read by addmm inside their module, still are
    assert got and got <= set(split), plan.explain()


class Down(nn.Module):
    def __init__(self, inner: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, inner) / inner**0.5)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wt = self.weight.t()  # read by addmm inside, and returned
        return torch.addmm(self.bias, x, wt), wt


class ReturningBlock(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, inner)
        self.down = Down(inner, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, wt = self.down(F.gelu(self.up(self.norm(x))))
        return x + y, wt


class Returning(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ReturningBlock(64, 256) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x, wt = block(x)
        return x, wt


def test_a_parameter_whose_transpose_is_returned_is_not_fully_sharded() -> None:
    torch.manual_seed(0)
    model = Returning()
    plan = _budget_plan(model, torch.randn(4096, 64))
    split = _split_on_data_axis(plan)
    returned = {n for n in split if n.endswith("down.weight")}
    assert returned, plan.explain()  # the budget shards them
    assert not _fully_sharded_params(plan) & returned, plan.explain()
