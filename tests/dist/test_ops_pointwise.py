"""Pointwise ops on global tensors: values, autograd and layouts, against single-process torch.

Every case computes the op on global tensors in each input layout (split on
either dim, broadcast, partial-sum with non-trivial parts) and compares the
logical result with the same op on plain tensors in the same process. No case
may fall back (``sbpflow.boxing.trace().fallbacks`` stays empty), and partial
inputs must stay partial exactly where the op is linear.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow import _dispatch
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, check_cases, grid, make, placement, sbp_name, world

Case = tuple[str, Callable[[], Any], Callable[[], Any]]
aten = torch.ops.aten


def _values(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 5, generator=gen)
    return {
        "a": grid(a),
        # away from zero: dividing by it must not amplify the rounding of partial sums
        "b": grid(
            (torch.rand(6, 5, generator=gen) + 0.5) * torch.randn(6, 5, generator=gen).sign()
        ),
        "row": grid(torch.randn(5, generator=gen)),
        "pos": grid(torch.rand(6, 5, generator=gen) + 0.5),
        "mask": torch.rand(6, 5, generator=gen) > 0.5,
    }


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda x, y: x + y,
    "add_alpha": lambda x, y: torch.add(x, y, alpha=-2.5),
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "maximum": torch.maximum,
    "atan2": torch.atan2,
    "lt": lambda x, y: x < y,
    "lerp": lambda x, y: torch.lerp(x, y, 0.3),
    "addcmul": lambda x, y: torch.addcmul(x, y, y, value=0.5),
}

_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": lambda x: -x,
    "clone": lambda x: x.clone(),
    "exp": torch.exp,
    "abs": torch.abs,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "clamp": lambda x: torch.clamp(x, -0.5, 0.5),
    "eq0": lambda x: x == 0,
    "to_bf16": lambda x: x.to(torch.bfloat16),
    "to_f64": lambda x: x.double(),
    "to_int": lambda x: (x * 4).to(torch.int64),
    "plus_2": lambda x: x + 2,
    "minus_2": lambda x: x - 2,
    "rsub_2": lambda x: 2 - x,
    "times_3": lambda x: x * 3,
    "over_2": lambda x: x / 2,
    "squared": lambda x: x**2,
    "plus_0dim": lambda x: x + torch.tensor(2.0),
    "times_0dim": lambda x: x * torch.tensor(3.0),
    "where_scalar": lambda x: torch.where(x > 0, x, 0.5),
    "masked_fill_0": lambda x: x.masked_fill(x > 0.3, 0.0),
    "masked_fill_1": lambda x: x.masked_fill(x > 0.3, 1.5),
    "inplace": lambda x: x.clone().mul_(2).add_(1).sub_(0.5).div_(3),
}

_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "square": lambda x: x * x,
}


def _cases(layouts: list[Any], pl: sbpflow.Placement) -> list[Case]:
    v = _values(0)
    cases: list[Case] = []
    for (la, lb), (name, op) in itertools.product(
        itertools.product(layouts, layouts), _BINARY.items()
    ):
        tag = f"{name} {sbp_name(la)},{sbp_name(lb)}"
        cases.append((tag, lambda op=op, la=la, lb=lb: op(make(v["a"], pl, la, 1), make(v["b"], pl, lb, 2)),
                      lambda op=op: op(v["a"], v["b"])))  # fmt: skip
    for la, (name, op) in itertools.product(layouts, _UNARY.items()):
        cases.append((f"{name} {sbp_name(la)}", lambda op=op, la=la: op(make(v["a"], pl, la, 3)),
                      lambda op=op: op(v["a"])))  # fmt: skip
    for la in layouts:
        tag = sbp_name(la)
        cases += [
            (f"broadcast row {tag}", lambda la=la: make(v["a"], pl, la, 4) * v["row"] + v["row"],
             lambda: v["a"] * v["row"] + v["row"]),
            (f"inplace broadcast add {tag}", lambda la=la: make(v["a"], pl, la, 5).add_(v["row"]),
             lambda: v["a"] + v["row"]),
            (f"1/x {tag}", lambda la=la: 1.0 / make(v["pos"], pl, la, 6), lambda: 1.0 / v["pos"]),
            (f"sqrt {tag}", lambda la=la: torch.sqrt(make(v["pos"], pl, la, 7)), lambda: v["pos"].sqrt()),
            (f"where {tag}", lambda la=la: torch.where(v["mask"], make(v["a"], pl, la, 8), make(v["b"], pl, la, 9)),
             lambda: torch.where(v["mask"], v["a"], v["b"])),
            (f"masked_fill mask {tag}", lambda la=la: make(v["a"], pl, la, 10).masked_fill(v["mask"], -1.0),
             lambda: v["a"].masked_fill(v["mask"], -1.0)),
            (f"addcdiv {tag}", lambda la=la: torch.addcdiv(make(v["a"], pl, la, 11), make(v["b"], pl, la, 12), v["pos"]),
             lambda: torch.addcdiv(v["a"], v["b"], v["pos"])),
        ]  # fmt: skip
        for name, act in _ACTIVATIONS.items():
            cases.append((f"grad {name} {tag}", lambda act=act, la=la: _grad(act, make(v["a"], pl, la, 13), v["b"]),
                          lambda act=act: _grad(act, v["a"].clone(), v["b"])))  # fmt: skip
    return cases


def _grad(act: Callable[[Any], Any], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (act(x) * w).sum().backward()
    assert x.grad is not None
    return x.grad


def run_pointwise(ranks: Any, layouts: list[Any]) -> tuple[list[str], list[str]]:
    """Worker: every case; (failures, fallbacks)."""
    return check_cases(_cases(layouts, placement(ranks)))


def partial_kept(ranks: list[int]) -> dict[str, str]:
    """Worker: the output SBP of ops on partial inputs (linear ones keep P, others reduce)."""
    pl = placement(ranks)
    x, y = make(torch.ones(4, 3), pl, P, 1), make(torch.ones(4, 3), pl, P, 2)
    outputs = {
        "x + y": x + y,
        "x * 2": x * 2,
        "-x": -x,
        "x / 2": x / 2,
        "x + 2": x + 2,
        "2 - x": 2 - x,
        "exp(x)": torch.exp(x),
        "relu(x)": torch.relu(x),
    }
    return {name: sbp_name(t.sbp) for name, t in outputs.items()}


def fallback_once() -> tuple[list[str], int, list[str], str]:
    """Worker: an op without a rule is gathered, computed and (for in-place) written back."""
    pl = world()
    value = torch.linspace(-2, 2, 12).reshape(4, 3)
    name = str(aten.i0.default)
    _dispatch._warned.discard(name)
    failures = []
    with warnings.catch_warnings(record=True) as caught, sbpflow.boxing.trace() as t:
        warnings.simplefilter("always")
        for sbp in (S0, S1, P, B):
            got = torch.i0(make(value, pl, sbp, 3))
            if not torch.allclose(got.to_global(sbp=B).to_local(), torch.i0(value)):
                failures.append(f"i0 {sbp}")
        x = make(value, pl, S0, 4)
        x.i0_()
        if x.sbp != (S0,) or not torch.allclose(x.to_global(sbp=B).to_local(), torch.i0(value)):
            failures.append(f"i0_ gave {x.sbp}")
    warned = [str(w.message) for w in caught if "no SBP rule" in str(w.message)]
    return (
        failures,
        len([m for m in warned if name in m]),
        sorted(set(t.fallbacks)),
        sbp_name(got.sbp),
    )


_LAYOUTS_1D = [S0, S1, B, P]
_LAYOUTS_2D = [(S0, S1), (B, P), (P, S0), (S1, B)]


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_pointwise_matches_single_process(dist_pool: DistributedPool) -> None:
    """Each op in each layout equals torch on the logical tensors (single-process reference)."""
    ranks = list(range(dist_pool.world_size))
    meshes = [(ranks, _LAYOUTS_1D)]
    if dist_pool.world_size == 4:
        meshes.append(([[0, 1], [2, 3]], _LAYOUTS_2D))
    for mesh, layouts in meshes:
        for rank, (failures, fallbacks) in enumerate(dist_pool.run(run_pointwise, mesh, layouts)):
            assert failures == [], f"rank {rank}, mesh {mesh}: {failures[:10]}"
            assert fallbacks == [], f"rank {rank}, mesh {mesh}: {fallbacks[:10]}"


def test_partial_inputs_stay_partial_only_where_linear(dist_pool: DistributedPool) -> None:
    """Linear ops keep P (P + 2: only the first rank adds 2); exp(P), relu(P) reduce first."""
    got = dist_pool.run(partial_kept, list(range(dist_pool.world_size)))[0]
    kept = {name for name, sbp in got.items() if sbp == "P"}
    assert kept == {"x + y", "x * 2", "-x", "x / 2", "x + 2", "2 - x"}, got


def test_fallback_is_correct_and_warns_once(dist_pool: DistributedPool) -> None:
    """An op with no rule (i0) gives torch's values, in place too, with one warning."""
    for failures, num_warnings, fallbacks, out_sbp in dist_pool.run(fallback_once):
        assert failures == []
        assert num_warnings == 1
        assert fallbacks == ["aten.i0.default", "aten.i0_.default"]
        assert out_sbp == "B"
