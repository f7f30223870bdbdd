"""sbpflow.auto_parallel in one process: plans made on meta tensors, no process group.

The optima are checked against layouts written by hand, independently of the planner:
Megatron's (column-parallel first linear, row-parallel second) where the batch is
broadcast on the tensor axis, data parallelism (parameters broadcast, batch split) on a
data mesh with no budget, sharded parameters under a budget below the replicated footprint.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.auto_parallel import ComputeModel, Plan, calibrate_compute, reprice
from sbpflow.sbp import broadcast, split

# the module, not the function ``sbpflow.auto_parallel`` shadows it with
_solve = importlib.import_module("sbpflow.auto_parallel._solve")

B = broadcast


class MlpBlock(nn.Module):
    """The residual MLP block of bench/tp."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, inner)
        self.down = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Mlp(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, inner)
        self.down = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class TransformerBlock(nn.Module):
    """Pre-norm: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int, inner: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _megatron_mlp(name: str, t: torch.Tensor) -> Any:
    """bench/tp's hand layout: ``up`` column-parallel, ``down`` row-parallel."""
    if name.endswith(("up.weight", "up.bias")):
        return split(0)
    return split(1) if name.endswith("down.weight") else B


def _megatron_block_2d(name: str, t: torch.Tensor) -> Any:
    """Megatron on mesh axis 1 (q, k, v and up column-parallel; o and down row-parallel),
    replicated on the data axis 0."""
    if name.endswith(("q.weight", "k.weight", "v.weight", "up.weight", "up.bias")):
        return (B, split(0))
    if name.endswith(("o.weight", "down.weight")):
        return (B, split(1))
    return (B, B)


def _hand(layout: Any, model: nn.Module, ndim: int) -> dict[str, tuple[Any, ...]]:
    found = {}
    for name, p in model.named_parameters():
        value = layout(name, p)
        found[name] = tuple(value) if isinstance(value, tuple) else (value,) * ndim
    return found


def _mlp_model(blocks: int = 4, dim: int = 256, inner: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[MlpBlock(dim, inner) for _ in range(blocks)])


def test_megatron_mlp_blocks_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/tp's 4 MLP blocks (256 -> 1024 -> 256, 512 rows) on 2 ranks, batch broadcast,
    default prices: the plan is Megatron's hand layout, and so are its activations: one
    all_reduce per block forward and one backward, except where the first block's input
    needs no gradient; the norms' parameter gradients, partial, are all-reduced in one
    data-parallel bucket (NOTE [bucketed gradients in the search]). So it runs no more
    collectives than the hand layout (8 all_reduces). The sequence-parallel variant (a
    reduce_scatter and an all_gather per all_reduce, 15 collectives) is predicted 0.1%
    faster by the alpha-beta prices alone; each collective's wait for the slowest rank
    (``ComputeModel.collective_seconds``, NOTE [default prices]) makes it slower; without
    the wait, it is a near tie that the fewer collectives decide (NOTE [fewer collectives
    among near ties]). No weight is gathered."""
    model = _mlp_model()
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.auto_parallel(model, placement, torch.randn(512, 256), fixed={0: B})
    assert plan.param_sbp == _hand(_megatron_mlp, model, 1)
    assert plan.diff(_megatron_mlp) == []
    assert plan.input_sbp == ((B,),)
    steps = [c for c in plan.collectives() if c.is_collective]
    bucketed = sorted(c.tensor for c in steps if c.parameter_gradient)
    assert bucketed == sorted(
        f"{b}.norm.{w} gradient" for b in range(4) for w in ("weight", "bias")
    )
    assert {(c.op, c.axes) for c in steps if c.parameter_gradient} == {("all_reduce", (0,))}
    ran = Counter((c.phase, c.op) for c in steps if not c.parameter_gradient)
    assert ran == {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 3}
    hand_collectives = 2 * 4  # an all_reduce per block, forward and backward
    assert sum(ran.values()) + 1 <= hand_collectives  # + the one bucket
    assert plan.num_tied > 0  # blocks 1-3 share block 0's decisions
    # the wait per collective is what picks it: without it, the fastest predicted plan is
    # the sequence-parallel one, with more collectives, the same weights' layouts, and the
    # near-tie rule picks Megatron's
    no_wait = ComputeModel(100e9, 20e9, 50e-6, 15e-6)
    assert ComputeModel.default("cpu") == dataclasses.replace(
        no_wait, collective_seconds=ComputeModel.default("cpu").collective_seconds
    )
    monkeypatch.setattr(_solve, "NEAR_TIE", 0.02)  # the rule, off by default
    near = sbpflow.auto_parallel(
        model, placement, torch.randn(512, 256), fixed={0: B}, compute_model=no_wait
    )
    assert [
        (c.phase, c.op, c.tensor)
        for c in near.collectives()
        if c.is_collective and not c.parameter_gradient
    ] == [(c.phase, c.op, c.tensor) for c in steps if not c.parameter_gradient]
    monkeypatch.setattr(_solve, "NEAR_TIE", 0.0)
    fastest = sbpflow.auto_parallel(
        model, placement, torch.randn(512, 256), fixed={0: B}, compute_model=no_wait
    )
    assert fastest.param_sbp == plan.param_sbp
    more = [c for c in fastest.collectives() if c.is_collective and not c.parameter_gradient]
    assert len(more) > sum(ran.values()), Counter((c.phase, c.op) for c in more)
    assert {c.op for c in more} == {"reduce_scatter", "all_gather"}
    # and the plan is a near-equal of it under those prices: the wait decides between them
    again = reprice(plan, model, torch.randn(512, 256), compute_model=no_wait)
    assert fastest.step_seconds <= again.step_seconds <= fastest.step_seconds * 1.01


def test_mlp_blocks_on_a_2x2_mesh_are_data_parallel_by_megatron() -> None:
    """The same blocks on a 2x2 mesh with the batch split on axis 0 and broadcast on axis 1
    (bench/auto_parallel's 2x2 row): data parallel on axis 0 and Megatron on axis 1, the
    hand layout, not Megatron over all 4 ranks with the batch all-gathered. It needs the
    search to price the data-parallel gradients as their buckets run (one all_reduce's
    latency and launch for all of them, not one per parameter)."""
    model = _mlp_model()
    placement = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    x = torch.randn(512, 256)
    plan = sbpflow.auto_parallel(model, placement, x, fixed={0: (split(0), B)})

    def hand(name: str, t: torch.Tensor) -> Any:
        return (B, _megatron_mlp(name, t))

    assert plan.param_sbp == _hand(hand, model, 2)
    assert plan.input_sbp == ((split(0), B),)
    steps = [c for c in plan.collectives() if c.is_collective]
    assert not [c for c in steps if c.op == "all_gather"]  # the batch stays split on axis 0
    # the weights' gradients all-reduced on the data axis only (the norms' also on axis 1:
    # their partial gradient, as in test_an_eager_cost_per_boxing_step_prefers_fewer_steps)
    assert {c.axes for c in steps if c.parameter_gradient and ".norm." not in c.tensor} == {(0,)}


def test_transformer_block_on_a_2x2_mesh_is_megatron_on_the_tensor_axis() -> None:
    """One transformer block (hidden 1024, 16 heads, MLP 4096, batch 8 x 512) on a 2x2
    mesh, the batch split on axis 0 and broadcast on axis 1: data parallel on axis 0 and
    Megatron's column/row layout on axis 1, attention split by heads. (With fewer tokens,
    6 x 512, the plan is tensor parallel over both axes, the batch gathered on axis 0:
    Megatron's column/row layout of the MLP and of attention, split by heads over all 4
    ranks, predicted 0.46% faster than this layout: each rank updates a quarter of the
    weights, not half of them, and all-reduces no weight gradient; NOTE [the update in the
    search].)

    The attention's output projection may come out column-parallel instead of row-parallel:
    under the alpha-beta model all_gathering its input and leaving its output split by
    features costs exactly what reduce-scattering a row-parallel output does. So the test
    asserts every other layout, and that the hand plan (every parameter pinned to Megatron's
    layout) is predicted exactly as fast as the plan: Megatron's layout is an optimum."""
    with torch.device("meta"):
        model = TransformerBlock(1024, 16, 4096)
        x = torch.empty(8, 512, 1024)
    placement = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    plan = sbpflow.auto_parallel(model, placement, x, fixed={0: (split(0), B)})
    hand = _hand(_megatron_block_2d, model, 2)
    got = plan.param_sbp
    assert {n: s for n, s in got.items() if n != "attn.o.weight"} == {
        n: s for n, s in hand.items() if n != "attn.o.weight"
    }
    assert got["attn.o.weight"] in ((B, split(1)), (B, split(0)))
    sdpa = [op for op in plan.ops if op.op == "sdpa"]
    assert [op.inputs for op in sdpa] == [((split(0), split(1)),) * 3]  # (batch, heads)
    pinned = sbpflow.auto_parallel(model, placement, x, fixed={0: (split(0), B), **hand})
    assert pinned.param_sbp == hand
    assert abs(pinned.step_seconds - plan.step_seconds) <= 1e-9 * plan.step_seconds


def _wide_batch_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(MlpBlock(64, 256), MlpBlock(64, 256))
    return model, torch.randn(8192, 64)


def test_no_budget_on_a_data_mesh_is_data_parallel() -> None:
    """Nothing fixed, no budget, a batch far larger than the weights: every parameter
    broadcast and the batch split on dim 0 (DDP)."""
    model, x = _wide_batch_mlp()
    plan = sbpflow.auto_parallel(model, sbpflow.placement("cpu", [0, 1]), x)
    assert plan.param_sbp == {name: (B,) for name, _ in model.named_parameters()}
    assert plan.input_sbp == ((split(0),),)
    grads = [c for c in plan.collectives() if c.phase == "backward" and c.is_collective]
    assert grads and {c.op for c in grads} == {"all_reduce"}


def test_a_data_parallel_step_is_predicted_with_its_gradients_bucketed() -> None:
    """The 12 gradient all_reduces of the DDP plan (norm, up and down of two blocks) run as
    one bucket (under 1 MiB together): the predicted step counts one collective's latency
    and launch, not twelve; the search's
    boxing_seconds lists them one by one."""
    from sbpflow.boxing.cost import CostModel

    model, x = _wide_batch_mlp()
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.auto_parallel(model, placement, x)
    grads = [c for c in plan.collectives() if c.parameter_gradient and c.op == "all_reduce"]
    assert len(grads) == 12 and sum(c.bytes_per_rank for c in grads) < 1024 * 1024
    compute = ComputeModel.default("cpu")
    # a collective's latency round, step overhead, eager work and wait
    fixed = CostModel.default("gloo").all_reduce(2, 0.0) + compute.op_seconds
    fixed += compute.collective_seconds
    assert plan.bucket_savings_seconds == pytest.approx(11 * fixed)
    assert plan.step_seconds == pytest.approx(
        plan.compute_seconds + plan.boxing_seconds - 11 * fixed + plan.optimizer_seconds
    )
    assert "with gradients bucketed" in plan.explain()


def test_a_budget_below_the_replicated_footprint_shards_the_parameters() -> None:
    """A budget under the DDP plan's footprint: the large weights are stored split
    (gathered for use, their gradients reduce-scattered) and the plan fits the budget."""
    model, x = _wide_batch_mlp()
    placement = sbpflow.placement("cpu", [0, 1])
    replicated = sbpflow.auto_parallel(model, placement, x)
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = replicated.memory.peak - 1.5 * weights  # adamw: 4 copies; half of them gone
    plan = sbpflow.auto_parallel(model, placement, x, memory_budget=budget)
    assert plan.memory.peak <= budget
    sharded = [n for n, s in plan.param_sbp.items() if s != (B,)]
    assert {n for n in sharded if n.endswith(("up.weight", "down.weight"))} == {
        "0.up.weight",
        "0.down.weight",
        "1.up.weight",
        "1.down.weight",
    }
    ops = {c.op for c in plan.collectives() if c.is_collective}
    assert {"all_gather", "reduce_scatter"} <= ops


def test_same_inputs_give_the_same_plan() -> None:
    model = _mlp_model(blocks=2, dim=64, inner=256)
    placement = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    x = torch.randn(64, 64)
    first = sbpflow.auto_parallel(model, placement, x)
    second = sbpflow.auto_parallel(model, placement, x.clone())
    assert first == second
    assert first.explain() == second.explain()


def test_an_unreachable_budget_names_the_smallest_footprint() -> None:
    model, x = _wide_batch_mlp()
    placement = sbpflow.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match=r"smallest footprint found is (\d+) bytes") as info:
        sbpflow.auto_parallel(model, placement, x, memory_budget=1000)
    smallest = float(info.value.args[0].split("smallest footprint found is ")[1].split()[0])
    # the whole model's parameters, gradients and adamw state split over 2 ranks is a floor
    floor = sum(p.numel() * 4 for p in model.parameters()) * 4 / 2
    assert floor <= smallest
    plan = sbpflow.auto_parallel(model, placement, x, memory_budget=smallest + 1)
    assert plan.memory.peak <= smallest + 1


@pytest.mark.xfail(
    strict=True,
    reason="the error names the predicted peak of the fastest plan under the search's "
    "smallest bound, where the plan counts boxed copies the search does not see; a plan "
    "with a smaller predicted peak can exist",
)
def test_an_unreachable_budget_names_no_more_than_a_plan_found() -> None:
    """Four 64 -> 256 -> 64 blocks over 4096 rows on 2 ranks: a budget a little under the
    predicted peak of a plan made under a looser budget either gives a plan or raises
    naming a footprint no larger than that plan's peak."""
    model = _mlp_model(blocks=4, dim=64, inner=256)
    x = torch.randn(4096, 64)
    placement = sbpflow.placement("cpu", [0, 1])
    replicated = sbpflow.auto_parallel(model, placement, x).memory
    state = replicated.parameters + replicated.gradients + replicated.optimizer_state
    found = sbpflow.auto_parallel(
        model, placement, x, memory_budget=replicated.peak - 0.3 * state
    ).memory.peak
    try:
        plan = sbpflow.auto_parallel(model, placement, x, memory_budget=0.999 * found)
    except ValueError as error:
        named = float(str(error).split("smallest footprint found is ")[1].split()[0])
        assert named <= found, (named / 2**20, found / 2**20)
    else:
        assert plan.memory.peak <= 0.999 * found


def test_fixed_pins_a_parameter_and_the_plan_prices_it() -> None:
    model = _mlp_model(blocks=2, dim=64, inner=256)
    placement = sbpflow.placement("cpu", [0, 1])
    x = torch.randn(64, 64)
    plan = sbpflow.auto_parallel(model, placement, x, fixed={"1.up.weight": split(1), 0: B})
    assert plan.param_sbp["1.up.weight"] == (split(1),)
    assert plan.input_sbp == ((B,),)


def test_bad_arguments_raise_with_the_fix() -> None:
    model = _mlp_model(blocks=1, dim=8, inner=16)
    placement = sbpflow.placement("cpu", [0, 1])
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="neither a parameter"):
        sbpflow.auto_parallel(model, placement, x, fixed={"nope.weight": B})
    with pytest.raises(ValueError, match="unknown optimizer"):
        sbpflow.auto_parallel(model, placement, x, optimizer="lion")
    with pytest.raises(TypeError, match="placement must be"):
        sbpflow.auto_parallel(model, [0, 1], x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_budget must be"):
        sbpflow.auto_parallel(model, placement, x, memory_budget=-1)


def test_explain_and_diff_read_the_plan() -> None:
    model = _mlp_model(blocks=2)
    plan = sbpflow.auto_parallel(
        model, sbpflow.placement("cpu", [0, 1]), torch.randn(512, 256), fixed={0: B}
    )
    assert isinstance(plan, Plan)
    text = plan.explain()
    for needle in ("0.up.weight", "S(0)", "all_reduce", "predicted step", "optimizer state"):
        assert needle in text
    replicated = plan.diff({})
    assert sorted(name for name, _, _ in replicated) == [
        "0.down.weight",
        "0.up.bias",
        "0.up.weight",
        "1.down.weight",
        "1.up.bias",
        "1.up.weight",
    ]
    assert "<table>" in plan._repr_html_()


def _torchtitan_llama(name: str, t: torch.Tensor) -> Any:
    """torchtitan's Llama plan on the tensor axis: q, k, v, gate, up column-parallel; o and
    down row-parallel; norms, embedding and head broadcast (their loss-parallel variants
    aside)."""
    module = name.split(".")[-2]
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return split(0)
    return split(1) if module in ("o_proj", "down_proj") else B


def llama_config() -> Any:
    """bench/auto_parallel's Llama: hidden 256, MLP 1024, 4 layers, 8 heads over 4
    key/value heads, vocabulary 1024."""
    transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    return config


def test_hugging_face_llama_layers_share_one_decision_and_beat_the_hand_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HF Llama (hidden 256, MLP 1024, 4 layers, 8 heads over 4 key/value heads) on 2 ranks,
    batch broadcast: every op has a rule, the 4 decoder layers get one layout, and the
    plan's predicted step, the optimizer's update included, is within the near-tie share
    of the best plan that keeps torchtitan's hand layout of the parameters (the same
    search with them pinned) with no more collectives. The fastest plan (no near-tie rule)
    is no slower than that one and its MLP is Megatron's (here the plan, nearly as fast, is
    data parallel, its broadcast batch sliced on each rank)."""
    transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    ids = torch.zeros(8, 128, dtype=torch.long)
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.auto_parallel(model, placement, ids, fixed={0: B})
    assert plan.fallback_ops == ()
    assert "sdpa" in {op.op for op in plan.ops}
    layouts = plan.param_sbp
    for layer in range(1, 4):
        for name, sbp in layouts.items():
            if name.startswith("model.layers.0."):
                assert layouts[name.replace(".0.", f".{layer}.", 1)] == sbp
    hand = {name: _torchtitan_llama(name, torch.empty(0)) for name in layouts}
    pinned = sbpflow.auto_parallel(model, placement, ids, fixed={0: B, **hand})
    assert pinned.diff(_torchtitan_llama) == []
    assert plan.step_seconds <= pinned.step_seconds * (1 + _solve.NEAR_TIE)
    from tests.unit.test_auto_parallel_counts import per_step

    assert per_step(plan) <= per_step(pinned)
    monkeypatch.setattr(_solve, "NEAR_TIE", 0.0)
    fastest = sbpflow.auto_parallel(model, placement, ids, fixed={0: B})
    for name in layouts:
        if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            assert fastest.param_sbp[name] == (_torchtitan_llama(name, torch.empty(0)),)
    assert fastest.step_seconds <= pinned.step_seconds * (1 + 1e-9)


def test_a_forward_that_reads_values_is_a_clear_error() -> None:
    class ReadsData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * 2 if x.sum() > 0 else self.fc(x)

    with pytest.raises(ValueError, match="reads a tensor's value"):
        sbpflow.auto_parallel(ReadsData(), sbpflow.placement("cpu", [0, 1]), torch.randn(2, 4))


def test_boundaries_box_a_blocks_output_where_the_plan_reads_it() -> None:
    """bench/tp's 2 MLP blocks on 2 ranks, batch broadcast: each block's ``down`` output is a
    partial sum, and its boundary boxes it to the layout the block's residual add reads it
    in (never partial: the add would otherwise sum a partial with a whole tensor), with the
    gradient handed back whole to the row-parallel matmul. Installing the boundary hooks on
    a model and ``unfollow`` leave no hook behind; a plan is compared with itself only."""
    from sbpflow.auto_parallel import unfollow
    from sbpflow.auto_parallel._follow import follow

    model = _mlp_model(blocks=2)
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.auto_parallel(model, placement, torch.randn(512, 256), fixed={0: B})
    found = {(b.module, b.where): b for b in plan.boundaries if b.position == 0}
    for block in ("0", "1"):
        down = found[(f"{block}.down", "output")]
        add = [op for op in plan.ops if op.module == block and "add" in op.op]
        assert down.sbp == add[-1].inputs[1] and down.sbp != (sbpflow.sbp.partial_sum,)
        assert down.grad_sbp == (B,) and down.shape == (512, 256)
    follow(model, placement, plan.boundaries)
    hooked = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    # one hook per module input and output laid out, the root's pruning pre-hook, and the
    # root's pair that follows the plan op by op while its forward runs
    assert hooked == len({(b.module, b.where) for b in plan.boundaries}) + 3
    unfollow(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_an_eager_cost_per_boxing_step_prefers_fewer_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Megatron blocks, batch broadcast: a reduce_scatter then an all_gather move the same
    bytes as one all_reduce, and save the norms half their compute (sequence parallel).
    Priced by bytes alone (``op_seconds=0``) the plan takes them; with an eager cost per
    boxing step it all-reduces, as the hand layout does, with one boxing step per block and
    direction, each priced above that cost. Backward, the gradient is all-reduced after the
    residual add instead of before the norm (its backward runs on the partial gradient):
    the first block's input needs no gradient, so one activation all_reduce goes, for the
    norms' parameter gradients all-reduced in one data-parallel bucket (the blocks are tied:
    both norms). (Without the near-tie rule: by bytes alone the two are near ties, which
    the fewer collectives decide.)"""
    monkeypatch.setattr(_solve, "NEAR_TIE", 0.0)
    model = _mlp_model(blocks=2)
    placement = sbpflow.placement("cpu", [0, 1])
    x = torch.randn(512, 256)
    bytes_only = ComputeModel(100e9, 20e9, 0.0)
    eager = ComputeModel(100e9, 20e9, 200e-6)
    sequence = sbpflow.auto_parallel(model, placement, x, fixed={0: B}, compute_model=bytes_only)
    plan = sbpflow.auto_parallel(model, placement, x, fixed={0: B}, compute_model=eager)
    assert "reduce_scatter" in {c.op for c in sequence.collectives()}
    ran = [(c.phase, c.op) for c in plan.collectives() if c.is_collective]
    assert sorted(ran) == [("backward", "all_reduce")] * 5 + [("forward", "all_reduce")] * 2
    bucketed = sorted(c.tensor for c in plan.collectives() if c.parameter_gradient)
    assert bucketed == sorted(
        f"{b}.norm.{w} gradient" for b in range(2) for w in ("weight", "bias")
    )
    assert plan.param_sbp == _hand(_megatron_mlp, model, 1)
    steps = plan.collectives()
    assert abs(plan.boxing_seconds - sum(c.seconds for c in steps)) <= 1e-9
    assert all(c.seconds > 200e-6 for c in steps)  # the wire's price and the eager cost


def test_compute_model_checks_its_rates() -> None:
    with pytest.raises(ValueError, match="flops_per_second"):
        ComputeModel(0.0, 20e9)
    with pytest.raises(ValueError, match="op_seconds"):
        ComputeModel(100e9, 20e9, -1e-6)
    with pytest.raises(ValueError, match="bytes_per_second"):
        ComputeModel(100e9, float("nan"))
    with pytest.raises(ValueError, match="boxing_op_seconds"):
        ComputeModel(100e9, 20e9, 50e-6, 15e-6, boxing_op_seconds=-1.0)
    for wrong in (-1e-3, float("inf"), float("nan"), True, "1e-3", None):
        with pytest.raises(ValueError, match="collective_seconds must be a non-negative"):
            ComputeModel(100e9, 20e9, collective_seconds=wrong)  # type: ignore[arg-type]
    assert ComputeModel(100e9, 20e9, collective_seconds=0).collective_seconds == 0


def test_calibrate_compute_measures_rates_a_plan_can_use() -> None:
    """One process: the measured rates are positive and finite, and plans priced with them
    are the same every time (the model is data, passed explicitly)."""
    placement = sbpflow.placement("cpu", [0])
    measured = calibrate_compute(placement, repeats=1)
    square = calibrate_compute(sbpflow.placement("cpu", [[0]]), repeats=1)  # a 2-D mesh
    for rates in (measured, square):
        for value in (rates.flops_per_second, rates.bytes_per_second, rates.op_seconds):
            assert 0 < value < float("inf")
        # no process group to time a collective on: the wait stays the device's default
        assert rates.collective_seconds == ComputeModel.default("cpu").collective_seconds
    model = _mlp_model(blocks=2, dim=64, inner=128)
    two = sbpflow.placement("cpu", [0, 1])
    x = torch.randn(64, 64)
    first = sbpflow.auto_parallel(model, two, x, compute_model=measured)
    again = sbpflow.auto_parallel(model, two, x, compute_model=measured)
    assert first == again
    with pytest.raises(TypeError, match="placement"):
        calibrate_compute("cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeats"):
        calibrate_compute(placement, repeats=0)


def test_the_runtime_knows_a_call_by_its_place_name_and_shapes() -> None:
    """``apply`` follows the plan op by op: each call of the forward is the next captured op
    (within a few) with its name and tensor shapes, and takes that op's planned layouts. A
    call with another shape (another batch) is none of them and leaves the place as it is;
    so does an op the capture never saw. The captured ops, replayed, are known one by one."""
    from sbpflow._layout import Layout
    from sbpflow.auto_parallel._follow import _Cursor, _Ops

    model = _mlp_model(blocks=2)
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.auto_parallel(model, placement, torch.randn(512, 256), fixed={0: B})
    ops = _Cursor(_Ops(placement, plan.ops))
    aten = torch.ops.aten
    assert ops.match(aten.addmm.default, (torch.empty(3, 5, device="meta"),), {}) is None
    assert ops.match(aten.sin.default, (torch.empty(512, 256, device="meta"),), {}) is None
    assert ops.next == 0
    followed = [op for op in plan.ops if not op.fallback]
    for op in followed:
        _, name, overload = op.op.split(".")
        func = getattr(getattr(aten, name), overload)
        planned = ops.match(func, tuple(torch.empty(s, device="meta") for s in op.in_shapes), {})
        assert planned is not None, op
        assert planned.outputs == tuple(Layout(placement, s).normalized() for s in op.outputs)
        assert planned.inputs == tuple(Layout(placement, s).normalized() for s in op.inputs)
    assert ops.next == len(followed) >= 10


def test_a_forward_that_never_stopped_leaves_no_plan_behind() -> None:
    """A forward interrupted past its hooks (``KeyboardInterrupt``: module hooks catch
    ``Exception`` only) never ran its stop; the next forward of the model starts afresh and,
    once it stops, no plan is followed any more. Two threads running the model each follow
    with a cursor and tokens of their own."""
    import threading

    from sbpflow._decisions import FOLLOWING
    from sbpflow.auto_parallel._follow import _Ops

    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.auto_parallel(_mlp_model(blocks=1), placement, torch.randn(64, 256))
    ops = _Ops(placement, plan.ops)
    token = FOLLOWING.set(None)  # whatever happens below, later tests follow no plan
    try:
        ops.start()  # interrupted: no stop
        ops.start()
        ops.stop()
        assert FOLLOWING.get() is None
    finally:
        FOLLOWING.reset(token)

    both_started, errors = threading.Barrier(2), []

    def forward(first: bool) -> None:
        try:
            ops.start()
            both_started.wait()
            if first:  # the first stops while the second still runs
                ops.stop()
                assert FOLLOWING.get() is None
            both_started.wait()
            if not first:
                assert FOLLOWING.get() is not None
                ops.stop()
        except Exception as error:  # reported below
            errors.append(error)
            both_started.abort()

    threads = [threading.Thread(target=forward, args=(f,)) for f in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
