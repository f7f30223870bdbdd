"""Layout propagation as a pure function (no process group): which strategy an op takes, and
which inputs' gradients come back in their own layout.

The strategies come from the registered rules, as the dispatcher asks them; the costs from
the boxing planner with the default constants. Expected choices follow Megatron's plan (one
all_reduce where a row-parallel output meets the residual stream) and stay what they were
where data parallelism is concerned.
"""

from __future__ import annotations

from typing import Any

import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow._propagation import GradientPlan, choose, consumer_cost
from sbpflow.ops import _registry
from sbpflow.ops._registry import OpInfo, TensorMeta
from sbpflow.sbp import Broadcast, Partial, Split

aten = torch.ops.aten
S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
LINE = sbpflow.placement("cpu", [0, 1])
MESH = sbpflow.placement("cpu", [[0, 1], [2, 3]])


def _decide(
    func: Any,
    shapes: list[tuple[int, ...]],
    layouts: list[Any],
    placement: Any,
    planned: Any = None,
) -> Any:
    """What the dispatcher decides for ``func`` on inputs of ``shapes`` laid out as ``layouts``
    (``planned``: the (inputs, outputs) sbps a plan wants)."""
    metas = [TensorMeta(shape, torch.float32) for shape in shapes]
    current = [Layout(placement, sbp) for sbp in layouts]
    out = func(*(torch.empty(s, device="meta") for s in shapes))
    outputs = [TensorMeta(tuple(out.shape), out.dtype)]
    rule = _registry.lookup(func)
    assert rule is not None
    per_axis = []
    for axis, size in enumerate(placement.shape):
        now = [layout.normalized().sbp[axis] for layout in current]
        per_axis.append(rule.rule(OpInfo(func, tuple(metas), {}, metas, outputs, size, now)))
    if planned is not None:
        planned = tuple(
            tuple(Layout(placement, sbp).normalized() for sbp in sbps) for sbps in planned
        )
    choice = choose(per_axis, placement, current, metas, outputs, planned=planned)
    assert choice is not None
    return choice


def _sbps(layouts: tuple[Layout, ...]) -> list[Any]:
    return [layout.sbp if len(layout.sbp) > 1 else layout.sbp[0] for layout in layouts]


def test_residual_add_of_a_partial_sum_reduces_it_once() -> None:
    """``x (B) + y (P)``: all_reduce y and stay broadcast, rather than reduce-scatter y into a
    split the next column-parallel matmul would gather again."""
    choice = _decide(aten.add.Tensor, [(8, 4), (8, 4)], [B, P], LINE)
    assert _sbps(choice.input_layouts) == [B, B]
    assert _sbps(choice.output_layouts) == [B]


def test_sequence_parallel_residual_add_reduce_scatters() -> None:
    """``x (S(0)) + y (P)``: the split is the input's own (sequence parallelism): reduce-scatter."""
    choice = _decide(aten.add.Tensor, [(8, 4), (8, 4)], [S0, P], LINE)
    assert _sbps(choice.input_layouts) == [S0, S0]
    assert _sbps(choice.output_layouts) == [S0]


def test_a_new_split_is_charged_its_gather_an_existing_one_nothing() -> None:
    meta = TensorMeta((8, 4), torch.float32)
    split_out = Layout(LINE, (S0,))
    assert consumer_cost(meta, split_out, [Layout(LINE, (B,)), Layout(LINE, (P,))]) > 0
    assert consumer_cost(meta, split_out, [Layout(LINE, (S1,))]) == 0
    assert consumer_cost(meta, Layout(LINE, (B,)), [Layout(LINE, (P,))]) == 0
    # Per mesh axis: on a 2x2 mesh the data axis is split already, the tensor axis is not.
    data_split = Layout(MESH, (S0, B))
    assert consumer_cost(meta, Layout(MESH, (S0, S0)), [data_split]) > 0
    assert consumer_cost(meta, data_split, [data_split]) == 0


def test_column_parallel_matmul_returns_its_inputs_gradient() -> None:
    """``x (B) @ w (S(1))``: x's gradient comes back partial; the plan names x as fanned out
    over w (a parameter at run time: Megatron's "f")."""
    choice = _decide(aten.mm.default, [(8, 4), (4, 6)], [B, S1], LINE)
    assert _sbps(choice.output_layouts) == [S1]
    assert choice.gradients == GradientPlan(reverse=(), fan_out=((0, (1,)),))


def test_data_parallel_matmul_names_the_weight_fanned_out_over_the_batch() -> None:
    """``x (S(0)) @ w (B)``: w is the fanned-out input, over x (an activation at run time, so
    no hook: data-parallel gradients are reduced at the parameters, in buckets)."""
    choice = _decide(aten.mm.default, [(8, 4), (4, 6)], [S0, B], LINE)
    assert _sbps(choice.output_layouts) == [S0]
    assert choice.gradients == GradientPlan(reverse=(), fan_out=((1, (0,)),))


def test_boxed_inputs_take_their_gradient_back() -> None:
    """Sequence parallelism: y reduce-scattered for the add gets its gradient gathered back
    (the reverse), x (already split) nothing."""
    choice = _decide(aten.add.Tensor, [(8, 4), (8, 4)], [S0, P], LINE)
    assert choice.gradients == GradientPlan(reverse=(1,), fan_out=())
    assert not _decide(aten.add.Tensor, [(8, 4), (8, 4)], [S0, S0], LINE).gradients


def test_written_inputs_keep_their_layout() -> None:
    metas = [TensorMeta((8, 4), torch.float32)] * 2
    current = [Layout(LINE, (P,)), Layout(LINE, (B,))]
    rule = _registry.lookup(aten.add_.Tensor)
    assert rule is not None
    info = OpInfo(aten.add_.Tensor, tuple(metas), {}, metas, metas[:1], 2, [P, B])
    choice = choose([rule.rule(info)], LINE, current, metas, metas[:1], kept=[0])
    assert choice is not None and _sbps(choice.input_layouts)[0] == P


def test_a_planned_strategy_is_taken_where_the_rule_offers_it() -> None:
    """``x (B) + y (P)`` alone all-reduces y (test_residual_add_of_a_partial_sum_reduces_it_once);
    a plan that reduce-scatters both into a split (sequence parallelism, for a later op) gets
    it, with y's gradient gathered back, and so does a plan keeping the sum partial. On a
    2x2 mesh the planned layout holds per axis."""
    choice = _decide(aten.add.Tensor, [(8, 4), (8, 4)], [B, P], LINE, ([S0, S0], [S0]))
    assert _sbps(choice.input_layouts) == [S0, S0] and _sbps(choice.output_layouts) == [S0]
    assert choice.gradients.reverse == (1,)  # y's gradient gathered back (x was whole)
    choice = _decide(aten.add.Tensor, [(8, 4), (8, 4)], [B, P], LINE, ([P, P], [P]))
    assert _sbps(choice.output_layouts) == [P]
    planned = ([(S0, S1), (S0, S1)], [(S0, S1)])
    choice = _decide(aten.add.Tensor, [(8, 4), (8, 4)], [(S0, B), (S0, P)], MESH, planned)
    assert _sbps(choice.input_layouts) == [(S0, S1), (S0, S1)]


def test_a_planned_strategy_the_rule_lacks_is_never_forced() -> None:
    """A plan asking ``mm`` for a layout no matmul strategy has (both inputs split on their
    contracted dim's other side, an S(0) output from S(1) inputs) is not taken: the op takes
    the cheapest of its rule's strategies, as without a plan."""
    alone = _decide(aten.mm.default, [(8, 4), (4, 6)], [S0, B], LINE)
    wrong = ([S1, S1], [S0])
    choice = _decide(aten.mm.default, [(8, 4), (4, 6)], [S0, B], LINE, wrong)
    assert choice == alone
