"""What a plan predicts: the activations autograd keeps, the optimizer's update, the eager
cost per op, and prices that change only when passed. One process, meta-free small models;
the expected numbers are counted by hand from the model's shapes, not by the planner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.auto_parallel import ComputeModel, reprice
from sbpflow.auto_parallel._costs import Prices
from sbpflow.boxing.calibrate import Sample, _fit
from sbpflow.boxing.cost import _STEP_OVERHEAD, CostModel, LinkCost
from sbpflow.nn.parallel._reducer import DEFAULT_BUCKET_CAP_MB
from sbpflow.sbp import broadcast, partial_sum, split
from tests.unit.test_auto_parallel import MlpBlock

B, P = broadcast, partial_sum


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
    assert ComputeModel.default("cpu") == ComputeModel(
        100e9, 20e9, 50e-6, 15e-6, collective_seconds=0.6e-3
    )
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


def _slope_and_intercept(prices: Prices, src: tuple, dst: tuple) -> tuple[float, float]:
    """Seconds per byte of the local block and seconds at zero bytes of boxing ``src -> dst``
    (two sizes; the alpha-beta price is affine in the bytes)."""
    small, large = (256, 256), (2048, 2048)
    t_small = prices.boxing(small, torch.float32, src, dst)[0]
    t_large = prices.boxing(large, torch.float32, src, dst)[0]
    slope = (t_large - t_small) / (4 * (2048 * 2048 - 256 * 256))
    return slope, t_small - slope * 4 * 256 * 256


def _calibrated_on_four_ranks() -> CostModel:
    """The model ``sbpflow.boxing.calibrate`` fits from all_reduces timed on the whole
    2x2 placement only (4 members), where each took ``20 us * rounds + bytes / 0.8 GB/s``
    over the ring's bytes: one fit for the placement."""
    truth = CostModel(LinkCost(20e-6, 0.8e9))
    samples = [
        Sample("all_reduce", 4, size, truth.all_reduce(4, size))
        for size in (4 << 10, 64 << 10, 1 << 20, 4 << 20)
    ]
    link = _fit(samples, CostModel.default("gloo").link)
    return CostModel(link, (("all_reduce", link),))


@pytest.mark.parametrize("which", ["default", "calibrated"])
def test_a_collective_over_the_whole_2x2_mesh_costs_more_than_over_one_axis(which: str) -> None:
    """A gradient all_reduce over both axes of a 2x2 mesh (4 members) against one over axis 0
    (2 members): ring bandwidth ``2 (n - 1) / n`` bytes per byte of block (3/2 against 1, or
    more if the planner chains two all_reduces) and tree latency growing with ``log2 n``
    (twice the rounds), with the default constants and with one fit of the whole placement."""
    model = CostModel.default("gloo") if which == "default" else _calibrated_on_four_ranks()
    no_eager = ComputeModel(100e9, 20e9, 0.0, 0.0, boxing_op_seconds=0.0)
    prices = Prices(sbpflow.placement("cpu", [[0, 1], [2, 3]]), model, no_eager)
    one_axis = _slope_and_intercept(prices, (P, B), (B, B))
    whole = _slope_and_intercept(prices, (P, P), (B, B))
    assert whole[0] >= 1.5 * one_axis[0] * (1 - 1e-9)
    latency = one_axis[1] - _STEP_OVERHEAD  # net of the fixed bookkeeping of a step
    assert latency > 0
    assert whole[1] - _STEP_OVERHEAD >= 2 * latency * (1 - 1e-9)


def test_a_parameter_gradient_all_reduce_is_searched_as_in_a_bucket() -> None:
    """Into a broadcast parameter, a partial gradient's all_reduce is priced with its bytes
    and only its share (bytes / bucket cap) of one all_reduce's fixed cost (latency, step
    overhead, the eager work and wait of a step): the bucket pays that once. Into a split
    parameter (a reduce_scatter) nothing is bucketed."""
    placement = sbpflow.placement("cpu", [0, 1])
    prices = Prices(placement, None, None)
    shape = (256, 1024)  # 1 MiB of float32
    alone = prices.boxing(shape, torch.float32, (P,), (B,))[0]
    searched, axes = prices.gradient_boxing(shape, torch.float32, (P,), (B,))
    compute = ComputeModel.default("cpu")
    fixed = CostModel.default("gloo").all_reduce(2, 0.0) + compute.op_seconds
    fixed += compute.collective_seconds  # one latency round on 2 ranks
    sent = 2 * (2 - 1) / 2 * 2**20  # the ring's bytes per rank
    assert axes == ((0,),)
    assert searched == pytest.approx(alone - fixed * (1 - sent / (DEFAULT_BUCKET_CAP_MB * 2**20)))
    sharded = prices.gradient_boxing(shape, torch.float32, (P,), (split(0),))
    assert sharded == (prices.boxing(shape, torch.float32, (P,), (split(0),))[0], ())


def test_a_gradient_of_a_bucket_or_more_is_searched_as_alone() -> None:
    """A partial gradient of at least a bucket's bytes fills a data-parallel bucket of its
    own: its all_reduce costs what it costs alone (one fixed cost, its bytes) and is not
    marked as sharing the first bucket; a smaller one is."""
    placement = sbpflow.placement("cpu", [0, 1])
    prices = Prices(placement, None, None)
    cap = DEFAULT_BUCKET_CAP_MB * 2**20
    big = (int(cap // 4) // 512 * 2, 512)  # float32: two buckets' bytes, all of them sent
    alone = prices.boxing(big, torch.float32, (P,), (B,))[0]
    assert prices.gradient_boxing(big, torch.float32, (P,), (B,)) == (alone, ())
    small = (256, 1024)
    assert prices.gradient_boxing(small, torch.float32, (P,), (B,))[1] == ((0,),)


@pytest.mark.parametrize(("ranks", "axis"), [([0, 1], 0), ([0, 1, 2, 3], 0), ([[0, 1], [2, 3]], 1)])
def test_a_calibrated_wait_charges_a_bare_collective_what_it_took(ranks: list, axis: int) -> None:
    """``calibrate_compute``'s wait per round (NOTE [calibrated compute]): what a bare
    all_reduce of 16 floats on a mesh axis's group took beyond its cost model's price, over
    its rounds. A plan priced with that cost model and that wait charges a boxing step
    running that all_reduce (its eager work aside) exactly what the bare one took: the
    collective's time counted once. The bare time, 2.1 ms more than its price, is set by
    hand; the price is that of an alpha-beta fit of 4-rank all_reduces, as
    ``sbpflow.boxing.calibrate`` makes on a 2x2 mesh. Counting the whole bare time as the
    wait charged the fit's part of it twice."""
    from sbpflow.auto_parallel._calibrate import collective_wait

    placement = sbpflow.placement("cpu", ranks)
    model = _calibrated_on_four_ranks()
    num_ranks = placement.shape[axis]
    price = model.all_reduce(num_ranks, 16 * 4)
    bare = price + 2.1e-3
    wait = collective_wait(bare, price, num_ranks)
    compute = ComputeModel(100e9, 20e9, 0.0, 0.0, boxing_op_seconds=0.0, collective_seconds=wait)
    prices = Prices(placement, model, compute)
    src = tuple(P if a == axis else B for a in range(placement.ndim))
    seconds, steps = prices.boxing((16,), torch.float32, src, (B,) * placement.ndim)
    assert [(s.op, s.axes) for s in steps] == [("all_reduce", (axis,))]
    assert seconds == pytest.approx(bare, rel=1e-9)
    # a bare collective within its price waited for nothing beyond it
    assert collective_wait(0.5 * price, price, num_ranks) == 0.0


def test_the_boxing_path_is_chosen_with_each_steps_eager_work_and_wait() -> None:
    """Per-op fits as ``sbpflow.boxing.calibrate`` measured them on the 2-core host with 4
    ranks (all_reduce 1363 us per message, reduce_scatter 773 us, all_gather 1459 us): by
    those prices alone a reduce_scatter then an all_gather (2.2 ms) beat one all_reduce
    (2.7 ms over its two messages) for a partial of 16 floats on 2 ranks. Each boxing step
    also costs its eager work and each collective its wait (NOTE [default prices]), so
    the plan's price of that boxing is one all_reduce's, as the runtime runs it, not two
    steps' extras. Counted by hand from the constants."""
    fit = {"all_reduce": 1363e-6, "reduce_scatter": 773e-6, "all_gather": 1459e-6}
    model = CostModel(
        LinkCost(658e-6, 0.35e9), tuple((op, LinkCost(a, 0.4e9)) for op, a in fit.items())
    )
    compute = ComputeModel(100e9, 20e9, 0.0, 0.0, boxing_op_seconds=5e-3, collective_seconds=1e-3)
    prices = Prices(sbpflow.placement("cpu", [0, 1]), model, compute)
    seconds, steps = prices.boxing((16,), torch.float32, (P,), (B,))
    assert [s.op for s in steps] == ["all_reduce"]
    wire = _STEP_OVERHEAD + 2 * fit["all_reduce"] + 2 * (1 / 2) * 64 / 0.4e9
    assert seconds == pytest.approx(wire + 5e-3 + 1e-3, rel=1e-9)
