"""SBP rules as pure functions: the strategies each family proposes (no process group).

Each test builds the ``OpInfo`` the dispatcher would (global inputs as
``TensorMeta``, outputs from running the op on meta tensors) and checks the
proposed strategies against the algebra: P only where the op is linear, the
matmul table of DESIGN §4, partial outputs for reductions over split dims.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import sbpflow
from sbpflow._layout import Layout
from sbpflow.ops import _registry, matmul, pointwise, reductions  # noqa: F401
from sbpflow.ops._registry import FloatArg, LocalContext, OpInfo, Strategy, TensorMeta, bind
from sbpflow.sbp import Broadcast, Partial, Split

aten = torch.ops.aten
S0, S1, B, P, PMAX = Split(0), Split(1), Broadcast(), Partial("sum"), Partial("max")


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def info(func: Any, *args: Any, current: list[Any] | None = None, **kwargs: Any) -> OpInfo:
    """The OpInfo the dispatcher builds for ``func(*args, **kwargs)`` (TensorMeta = global)."""
    flat, spec = tree_flatten((args, kwargs))
    inputs = [a for a in flat if isinstance(a, TensorMeta)]
    on_meta = [
        torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, TensorMeta) else a
        for a in flat
    ]
    meta_args, meta_kwargs = tree_unflatten(on_meta, spec)
    out = tree_flatten(func(*meta_args, **meta_kwargs))[0]
    outputs = [TensorMeta(tuple(o.shape), o.dtype) for o in out if isinstance(o, torch.Tensor)]
    return OpInfo(func, args, kwargs, inputs, outputs, 2, current or [B] * len(inputs))


def strategies(func: Any, *args: Any, **kwargs: Any) -> list[Strategy]:
    found = _registry.lookup(func)
    assert found is not None, f"no rule for {func}"
    return list(found.rule(info(func, *args, **kwargs)))


def partial_inputs(found: list[Strategy]) -> set[tuple[Any, ...]]:
    """The input signatures of the strategies with a partial-sum output."""
    return {s.inputs for s in found if s.outputs and s.outputs[0] == P}


# -- lookup ----------------------------------------------------------------------------


def test_packet_registration_covers_overloads_but_not_out_variants() -> None:
    assert _registry.lookup(aten.add.Tensor) is not None
    assert _registry.lookup(aten.add.Scalar) is not None
    assert _registry.lookup(aten.add.out) is None  # its written `out` is an extra input
    assert _registry.lookup(aten.gelu_backward.grad_input) is None


def test_exact_overloads_win_over_packets() -> None:
    assert _registry.lookup(aten.max.other).family == "pointwise"
    assert _registry.lookup(aten.max.default).family == "reductions"


def test_registered_ops_lists_every_family() -> None:
    families = _registry.registered_ops()
    for family in ("pointwise", "matmul", "reductions", "factories", "decompositions"):
        assert families.get(family), family
    assert "aten._foreach_add_" in families["decompositions"]


def test_bind_fills_defaults_and_keyword_only_arguments() -> None:
    assert bind(aten.var.dim, ("x", [0], True, False), {}) == {
        "self": "x", "dim": [0], "unbiased": True, "keepdim": False,
    }  # fmt: skip
    assert bind(aten.var.correction, ("x",), {"keepdim": True})["keepdim"] is True
    assert bind(aten.sum.default, ("x",), {}) == {"self": "x", "dtype": None}


# -- pointwise -------------------------------------------------------------------------


def test_add_keeps_partial_for_all_global_operands_together() -> None:
    x, y = meta(4, 3), meta(4, 3)
    assert partial_inputs(strategies(aten.add.Tensor, x, y)) == {(P, P)}


def test_add_with_a_constant_keeps_partial_through_its_local_function() -> None:
    """P + 2 stays P: the local function lets only each group's first rank add the 2."""
    assert partial_inputs(strategies(aten.add.Tensor, meta(4, 3), 2)) == {(P,)}
    assert _registry.lookup(aten.add.Tensor).local is not None
    layout = Layout(sbpflow.placement("cpu", [0, 1]), (P,))
    ctx = LocalContext(1, [layout], [layout], [meta(4, 3)], [meta(4, 3)], frozenset({0}))
    local = _registry.lookup(aten.add.Tensor).local
    assert torch.equal(local(aten.add.Tensor, (torch.ones(2), 2), {}, ctx), torch.ones(2))
    first = LocalContext(0, [layout], [layout], [meta(4, 3)], [meta(4, 3)], frozenset({0}))
    assert torch.equal(local(aten.add.Tensor, (torch.ones(2), 2), {}, first), torch.full((2,), 3.0))


def test_products_keep_partial_in_one_factor_only() -> None:
    x, y = meta(4, 3), meta(4, 3)
    assert partial_inputs(strategies(aten.mul.Tensor, x, y)) == {(P, B), (B, P)}
    assert partial_inputs(strategies(aten.div.Tensor, x, y)) == {(P, B)}  # numerator only
    assert partial_inputs(strategies(aten.div.Tensor_mode, x, y, rounding_mode="floor")) == set()


@pytest.mark.parametrize(
    "func, args",
    [
        (aten.exp.default, (meta(4, 3),)),
        (aten.relu.default, (meta(4, 3),)),
        (aten.pow.Tensor_Scalar, (meta(4, 3), 2)),
        (aten.gelu.default, (meta(4, 3),)),
        (aten.clamp.default, (meta(4, 3), -1.0, 1.0)),
        (aten.eq.Tensor, (meta(4, 3), meta(4, 3))),
        (aten.maximum.default, (meta(4, 3), meta(4, 3))),
    ],
)
def test_nonlinear_ops_never_take_partial_inputs(func: Any, args: tuple[Any, ...]) -> None:
    assert partial_inputs(strategies(func, *args)) == set()
    assert all(not isinstance(s, Partial) for st in strategies(func, *args) for s in st.inputs)


def test_activation_backward_is_linear_in_the_incoming_gradient() -> None:
    grad, x = meta(4, 3), meta(4, 3)
    assert partial_inputs(strategies(aten.threshold_backward.default, grad, x, 0.0)) == {(P, B)}
    assert partial_inputs(strategies(aten.gelu_backward.default, grad, x)) == {(P, B)}


def test_casts_keep_partial_only_when_widening_between_floats() -> None:
    x = meta(4, 3)
    assert partial_inputs(strategies(aten._to_copy.default, x, dtype=torch.float64)) == {(P,)}
    assert partial_inputs(strategies(aten._to_copy.default, x, dtype=torch.bfloat16)) == set()
    assert partial_inputs(strategies(aten._to_copy.default, x, dtype=torch.int64)) == set()


def test_broadcast_operands_stay_broadcast_on_split_output_dims() -> None:
    found = strategies(aten.add.Tensor, meta(4, 3), meta(3))
    assert Strategy((S0, B), (S0,)) in found
    assert Strategy((S1, S0), (S1,)) in found


# -- matmul ----------------------------------------------------------------------------


def test_mm_strategies_are_the_design_table() -> None:
    found = strategies(aten.mm.default, meta(6, 5), meta(5, 7))
    assert [(s.inputs, s.outputs[0]) for s in found] == [
        ((S0, B), S0), ((B, S1), S1), ((S1, S0), P), ((P, B), P), ((B, P), P), ((B, B), B),
    ]  # fmt: skip


def test_addmm_lays_the_bias_out_like_the_output() -> None:
    found = strategies(aten.addmm.default, meta(7), meta(6, 5), meta(5, 7))
    assert Strategy((B, S0, B), (S0,)) in found  # bias [7] broadcast along the split rows
    assert Strategy((S0, B, S1), (S1,)) in found  # bias split with the output columns
    assert Strategy((P, S1, S0), (P,)) in found


def test_bmm_splits_the_batch() -> None:
    found = strategies(aten.bmm.default, meta(3, 4, 5), meta(3, 5, 2))
    assert Strategy((S0, S0), (S0,)) in found
    assert Strategy((Split(2), S1), (P,)) in found


# -- reductions ------------------------------------------------------------------------


def test_sum_over_a_split_dim_is_partial() -> None:
    found = strategies(aten.sum.dim_IntList, meta(6, 5), [0])
    assert Strategy((S0,), (P,)) in found
    assert Strategy((S1,), (S0,)) in found  # the kept dim is renumbered
    assert Strategy((P,), (P,)) in found


def test_max_over_a_split_dim_is_partial_max_and_argmax_gathers() -> None:
    assert Strategy((S0,), (PMAX,)) in strategies(aten.amax.default, meta(6, 5), [0])
    assert Strategy((PMAX,), (PMAX,)) in strategies(aten.max.default, meta(6, 5))
    argmax = strategies(aten.argmax.default, meta(6, 5), 0)
    assert all(s.inputs[0] != S0 for s in argmax) and Strategy((B,), (B,)) in argmax


def test_mean_local_rescales_to_the_logical_count() -> None:
    """A rank holding 3 of 6 rows: its local mean over rows is halved, so ranks sum to the mean."""
    pl = sbpflow.placement("cpu", [0, 1])
    ctx = LocalContext(0, [Layout(pl, (S0,))], [Layout(pl, (P,))], [meta(6, 5)], [meta(5)])
    local = torch.arange(15.0).reshape(3, 5)
    got = _registry.lookup(aten.mean.dim).local(aten.mean.dim, (local, [0]), {}, ctx)
    assert torch.allclose(got, local.mean(0) / 2)


# -- factories -------------------------------------------------------------------------


def test_like_ops_follow_the_input_without_boxing() -> None:
    found = _registry.lookup(aten.ones_like.default)
    assert found.rule(info(aten.ones_like.default, meta(4, 3), current=[S1])) == [
        Strategy((S1,), (S1,))
    ]
    # ones_like of a P tensor must not be P: the ranks' ones would sum to the rank count.
    assert found.rule(info(aten.ones_like.default, meta(4, 3), current=[P])) == [
        Strategy((P,), (B,))
    ]


# -- float arguments (NOTE [rules]) ------------------------------------------------------


def test_a_float_argument_records_whether_a_rule_read_it() -> None:
    """A rule sees FloatArg where the op got a float; compared with the plain float's behaviour."""
    untouched = FloatArg(0.5)
    assert isinstance(untouched, float) and untouched is untouched
    assert not untouched.read  # isinstance and identity tell no value apart
    reads = [
        lambda x: x > 0.25,
        lambda x: 0.25 < x,  # noqa: SIM300  (the float on the left: reflected comparison)
        lambda x: x == 0.5,
        lambda x: bool(x),
        lambda x: float(x),
        lambda x: math.isinf(x),
        lambda x: 2 * x,
        lambda x: x - 1,
        lambda x: f"{x:.3f}",
        lambda x: round(x),
        lambda x: hash(x),
    ]
    for read in reads:
        x = FloatArg(0.5)
        assert read(x) == read(0.5)
        assert x.read
    with pytest.raises(AttributeError):
        FloatArg(0.5).conjugate()  # not defined here: an error, never a silent non-read
