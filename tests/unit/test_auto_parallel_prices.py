"""What a plan predicts: the activations autograd keeps, the optimizer's update, the eager
cost per op, and prices that change only when passed. One process, meta-free small models;
the expected numbers are counted by hand from the model's shapes, not by the planner."""

from __future__ import annotations

import torch
from torch import nn

import sbpflow
from sbpflow.auto_parallel import ComputeModel, reprice
from sbpflow.boxing.cost import CostModel
from sbpflow.sbp import broadcast
from tests.unit.test_auto_parallel import MlpBlock


def _model(blocks: int, dim: int = 16, inner: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[MlpBlock(dim, inner) for _ in range(blocks)])


def test_activations_are_the_tensors_the_backward_keeps() -> None:
    """One rank, so every layout holds whole tensors. Per block, autograd keeps the norm's
    input (the block's input), its mean and rstd, the norm's output (read by ``up``),
    ``up``'s output (read by GELU) and GELU's output (read by ``down``); not ``down``'s
    output (``add`` keeps neither operand). The last block's output is read by the loss."""
    rows, dim, inner, blocks = 8, 16, 64, 3
    plan = sbpflow.auto_parallel(
        _model(blocks, dim, inner), sbpflow.placement("cpu", [0]), torch.randn(rows, dim)
    )
    per_block = rows * dim + 2 * rows + 2 * rows * inner  # norm out, mean, rstd, up, gelu
    block_outputs = blocks * rows * dim  # each read by the next norm, the last by the loss
    want = 4 * (rows * dim + blocks * per_block + block_outputs)  # + the step's input
    assert plan.memory.activations == want


class _Quotient(nn.Module):
    """``x / (lin(x) + 2)`` when ``over`` (the denominator needs a gradient), else
    ``lin(x) / (|x| + 2)`` (only the numerator does)."""

    def __init__(self, dim: int, over: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.over = over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.over:
            return x / (self.lin(x) + 2.0)
        return self.lin(x) / (x.abs() + 2.0)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of ``model(x)``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


def test_a_division_keeps_its_denominator_and_its_numerator_when_the_denominator_trains() -> None:
    """Autograd's ``div(a, b)`` saves ``b`` for both gradients, and ``a`` for ``b``'s. With
    ``b = lin(x) + 2`` training, it keeps ``x``, ``b`` and the output (read by the loss);
    ``lin(x)`` is read by ``add`` only. With ``a = lin(x)`` training and ``b = |x| + 2``
    not, it keeps ``x`` (``lin``'s weight gradient), ``b`` and the output, not ``a``. The
    sets are checked against what autograd saves on real tensors too."""
    rows, dim = 8, 16
    for over in (True, False):
        model = _Quotient(dim, over)
        x = torch.randn(rows, dim)
        plan = sbpflow.auto_parallel(model, sbpflow.placement("cpu", [0]), x)
        assert plan.memory.activations == 4 * 3 * rows * dim, over
        # autograd's saved tensors (no weight: ``x`` needs no gradient), plus the output
        assert plan.memory.activations == _saved_bytes(model, x) + 4 * rows * dim, over


def test_the_predicted_step_counts_the_optimizer_update() -> None:
    """Every trained parameter costs its optimizer's elementwise ops (AdamW 9, SGD 1, none
    0) at ``update_op_seconds``, plus their bytes; the update is part of the step."""
    model = _model(2)
    placement = sbpflow.placement("cpu", [0, 1])
    x = torch.randn(32, 16)
    num_params = len(list(model.parameters()))
    dispatch_only = ComputeModel(1e30, 1e30, 1e-3, 2e-4)
    for optimizer, ops in (("adamw", 9), ("sgd", 1), (None, 0)):
        plan = sbpflow.auto_parallel(
            model, placement, x, optimizer=optimizer, compute_model=dispatch_only
        )
        assert abs(plan.optimizer_seconds - ops * num_params * 2e-4) <= 1e-12
        total = plan.compute_seconds + plan.boxing_seconds + plan.optimizer_seconds
        assert plan.step_seconds == total
    bytes_only = ComputeModel(1e30, 1e9, 0.0, 0.0)
    plan = sbpflow.auto_parallel(model, placement, x, optimizer="sgd", compute_model=bytes_only)
    local = sum(p.numel() * 4 for p in model.parameters())
    local -= sum(p.bytes_per_rank for p in plan.params if any(s != broadcast for s in p.sbp))
    local += sum(p.bytes_per_rank for p in plan.params if any(s != broadcast for s in p.sbp)) / 2
    assert abs(plan.optimizer_seconds - 3 * local / 1e9) <= 1e-12 * max(local, 1.0)


def test_default_prices_are_machine_independent_and_reprice_adds_the_eager_cost() -> None:
    """An uncalibrated plan is the plan of the documented default constants, whatever the
    machine; ``reprice`` keeps every op's planned strategy and prices it with the constants
    passed: with a free roofline, each op of the step costs ``op_seconds`` forward and
    again backward (every op of these blocks reads a parameter's result), each boxing step
    its collective plus ``op_seconds`` (or ``boxing_op_seconds`` where given)."""
    model = _model(2, 256, 1024)
    placement = sbpflow.placement("cpu", [0, 1])
    x = torch.randn(512, 256)
    plan = sbpflow.auto_parallel(model, placement, x, fixed={0: broadcast})
    assert plan.collectives()  # Megatron's all_reduces
    explicit = sbpflow.auto_parallel(
        model,
        placement,
        x,
        fixed={0: broadcast},
        cost_model=CostModel.default("gloo"),
        compute_model=ComputeModel.default("cpu"),
    )
    assert explicit == plan
    assert ComputeModel.default("cpu") == ComputeModel(100e9, 20e9, 50e-6, 15e-6)
    same = reprice(plan, model, x)
    assert same.param_sbp == plan.param_sbp
    assert abs(same.step_seconds - plan.step_seconds) <= 1e-12
    for op_seconds in (1e-4, 1e-3):
        measured = ComputeModel(1e30, 1e30, op_seconds, 0.0)
        priced = reprice(plan, model, x, compute_model=measured)
        assert [(o.inputs, o.outputs) for o in priced.ops] == [
            (o.inputs, o.outputs) for o in plan.ops
        ]
        assert abs(priced.compute_seconds - 2 * len(plan.ops) * op_seconds) <= 1e-12
        steps = priced.collectives()
        assert len(steps) == len(plan.collectives())
        assert all(c.seconds >= op_seconds for c in steps)
        assert abs(priced.boxing_seconds - sum(c.seconds for c in steps)) <= 1e-12
        # a boxing step's own eager cost, where measured apart (calibrate_compute in a job)
        boxing = ComputeModel(1e30, 1e30, op_seconds, 0.0, boxing_op_seconds=7 * op_seconds)
        apart = reprice(plan, model, x, compute_model=boxing).collectives()
        assert [round(b.seconds - a.seconds, 12) for a, b in zip(steps, apart, strict=True)] == [
            round(6 * op_seconds, 12)
        ] * len(steps)
