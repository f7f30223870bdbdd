"""``_foreach_*`` ops on global tensors: one dispatch and one kernel on the pieces where the
lists allow it, the single-tensor op per position where they do not; against single-process
torch.

- AdamW and SGD with ``foreach=True`` (and ``clip_grad_norm_`` with its default, which
  picks foreach for global gradients) train 3 steps on a global MLP, data parallel
  (parameters B, batch S(0)) and Megatron tensor parallel (column- then row-parallel,
  batch B), and must end within 1e-5 of the plain model trained in the same process.
  Each ``_foreach_*`` call torch makes on global tensors (recorded from outside by a
  ``TorchDispatchMode``, above the global tensors' dispatch) is dispatched exactly once:
  the dispatcher receives the step's calls and nothing else.
- Direct calls on lists with partial-sum, split and broadcast operands: linear ones run
  in one dispatch and keep P; those that are not linear (P * P, sqrt of P, P + 1, a write
  that would change the layout, split against broadcast, a norm of P) fall back and still
  equal torch on the logical tensors.
- ``_foreach_norm``/``_foreach_max`` on split lists: one dispatch and one all_reduce for
  all positions of a layout, even with an empty shard.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, grid, logical, make, mismatch, world

aten = torch.ops.aten


@contextlib.contextmanager
def dispatched() -> Iterator[list[str]]:
    """The ops global tensors' dispatcher receives inside the block, in order."""
    dispatcher = sbpflow.GlobalTensor._op_dispatcher
    seen: list[str] = []
    inner = dispatcher.dispatch

    def counting(func: Any, args: tuple, kwargs: dict) -> Any:
        seen.append(str(func))
        return inner(func, args, kwargs)

    dispatcher.dispatch = counting  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del dispatcher.dispatch


class _CallsOnGlobals(TorchDispatchMode):
    """Records the ATen calls the program makes on global tensors (not those the global
    tensors' dispatch makes in turn: a mode is off while its own handler runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(a, sbpflow.GlobalTensor) for a in tree_flatten((args, kwargs))[0]):
            self.calls.append(str(func))
        return func(*args, **kwargs)


# -- optimizers and clip_grad_norm_ ------------------------------------------------------

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, **kw: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, weight_decay=0.01, **kw
    ),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, **kw),
}

# Megatron: the first linear's outputs split (weight rows, bias), the second's inputs.
_LAYOUTS: dict[str, tuple[Callable[[str, torch.Tensor], Any], Any]] = {
    "data parallel": (lambda name, t: B, S0),
    "tensor parallel": (
        lambda name, t: S0 if name.startswith("0.") else (S1 if name == "2.weight" else B),
        B,
    ),
}


def _train(optimizer: str, layouts: str) -> dict[str, Any]:
    """Worker: 3 steps (clip_grad_norm_ default, optimizer foreach=True) on a global MLP and
    on a plain copy in this process; the errors and what the global step dispatched."""
    pl = world()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    param_sbp, batch_sbp = _LAYOUTS[layouts]
    model = copy.deepcopy(reference).to_global(pl, B).to_global(pl, param_sbp)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
    gx, gy = make(x, pl, batch_sbp), make(y, pl, batch_sbp)
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    opt = _OPTIMIZERS[optimizer](model.parameters(), foreach=True)
    out: dict[str, Any] = {"norm_errors": [], "step_calls": [], "step_dispatches": []}
    with sbpflow.boxing.trace() as t:
        for _ in range(3):
            for o, m, (xs, ys) in ((opt_ref, reference, (x, y)), (opt, model, (gx, gy))):
                o.zero_grad()
                ((m(xs) - ys) ** 2).mean().backward()
                if o is opt_ref:
                    norm_ref = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                    o.step()
                    continue
                with dispatched() as clip_dispatches:
                    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                out["norm_errors"].append(abs(logical(norm).item() - norm_ref.item()))
                out["clip_foreach"] = sorted({d for d in clip_dispatches if "_foreach" in d})
                mode = _CallsOnGlobals()
                with sbpflow.boxing.trace() as t_step, dispatched() as seen, mode:
                    o.step()
                out["step_calls"].append(mode.calls)
                out["step_dispatches"].append(seen)
                out["step_collectives"] = dict(t_step.collectives())
    out["errors"] = {
        name: (logical(p) - ref).abs().max().item()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True)
    }
    out["fallbacks"] = sorted(set(t.fallbacks))
    return out


def _train_all() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{optimizer} {layouts}", _train(optimizer, layouts))
        for optimizer in _OPTIMIZERS
        for layouts in _LAYOUTS
    ]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_foreach_optimizers_match_single_process(dist_pool: DistributedPool) -> None:
    """AdamW/SGD foreach=True with clip_grad_norm_ train 3 steps as one process does (1e-5);
    each _foreach_* call on global tensors is one dispatch and the step runs no collective."""
    for results in dist_pool.run(_train_all):
        for label, got in results:
            assert max(got["errors"].values()) < 1e-5, f"{label}: {got['errors']}"
            assert max(got["norm_errors"]) < 1e-5, f"{label}: norms {got['norm_errors']}"
            assert got["fallbacks"] == [], label
            assert got["step_collectives"] == {}, label
            # clip_grad_norm_'s default took foreach for global gradients
            assert "aten._foreach_norm.Scalar" in got["clip_foreach"], f"{label}: {got}"
            for calls, seen in zip(got["step_calls"], got["step_dispatches"], strict=True):
                assert any("_foreach_" in c for c in calls), f"{label}: {calls}"
                assert seen == calls, f"{label}: {len(seen)} dispatches for {len(calls)} calls"


# -- direct calls: local, fallback, reductions ------------------------------------------


def _lists(sbps: list[Any], seed: int, positive: bool = False) -> tuple[list[Any], list[Any]]:
    """(global tensors laid out as ``sbps``, their logical values), shapes varying by position."""
    pl = world()
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (4,), (3, 2), (5, 3)]
    values = []
    for k in range(len(sbps)):
        v = grid(torch.randn(shapes[k % len(shapes)], generator=gen))
        values.append(v.abs() + 0.5 if positive else v)
    return [
        make(v, pl, s, seed=seed + k) for k, (v, s) in enumerate(zip(values, sbps, strict=True))
    ], values


def _case(
    name: str, call: Callable[..., Any], operands: list[tuple[list[Any], bool]], *rest: Any
) -> dict[str, Any]:
    """Run ``call`` on the global lists and on their logical values (copies, for writes)."""
    globals_ = [
        _lists(sbps, seed=10 * k, positive=positive)[0]
        for k, (sbps, positive) in enumerate(operands)
    ]
    plains = [[v.clone() for v in logical(g)] for g in globals_]  # before any write
    with sbpflow.boxing.trace() as t, dispatched() as seen:
        out = call(*globals_, *rest)
    want_lists = [[v.clone() for v in p] for p in plains]
    want = call(*want_lists, *rest)
    if want is None:  # in place: compare the written list
        want = want_lists[0]
    got = logical(out if out is not None else globals_[0])
    sbps = [sbpflow.sbp.sbp_str(o.sbp) for o in out] if out is not None else None
    return {
        "name": name,
        "why": mismatch(got, want),
        "dispatches": len(seen),
        "collectives": dict(t.collectives()),
        "sbps": sbps,
    }


def _mul_first_(a: list[Any], b: list[Any]) -> None:
    """The single op the foreach one falls back to: a B tensor times P, written in place."""
    a[0].mul_(b[0])


def _direct_cases() -> list[dict[str, Any]]:
    f = torch._foreach_add
    cases = [
        # local: one dispatch, no collective
        ("add P+P", f, [([P, P, S0], False), ([P, P, S0], False)]),
        ("mul P*2", torch._foreach_mul, [([P, B, S1], False)], 2.0),
        ("mul P*B list", torch._foreach_mul, [([P, S0], False), ([B, S0], False)]),
        ("lerp_ P", torch._foreach_lerp_, [([P, B], False), ([P, B], False)], 0.3),
        ("addcmul P,P,B", torch._foreach_addcmul, [([P], False), ([P], False), ([B], False)], 0.5),
        (
            "addcdiv_ S0",
            torch._foreach_addcdiv_,
            [([S0, S0], False), ([S0, S0], False), ([S0, S0], True)],
            [0.1, 0.2],
        ),
        ("sqrt S0/B", torch._foreach_sqrt, [([S0, B, S1], True)]),
        ("neg_ P", torch._foreach_neg_, [([P, S0], False)]),
        # not local: the per-position path, still right
        ("mul P*P", torch._foreach_mul, [([P, B], False), ([P, B], False)]),
        ("sqrt P", torch._foreach_sqrt, [([B, P], True)]),
        ("add P+1", f, [([P, S0], False)], 1.0),
        ("mul_ B*=P", torch._foreach_mul_, [([B, B], False), ([P, B], False)]),
        ("Tensor.mul_ B*=P", _mul_first_, [([B], False), ([P], False)]),
        ("add S0+B", f, [([S0, B], False), ([B, B], False)]),
        ("norm P", torch._foreach_norm, [([B, P], False)]),
    ]
    return [_case(name, call, operands, *rest) for name, call, operands, *rest in cases]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_foreach_direct_calls(dist_pool: DistributedPool) -> None:
    """Each call equals torch on the logical lists; the linear ones are one dispatch with no
    collective and keep partial-sum operands P, the others go position by position."""
    local = {
        "add P+P",
        "mul P*2",
        "mul P*B list",
        "lerp_ P",
        "addcmul P,P,B",
        "addcdiv_ S0",
        "sqrt S0/B",
        "neg_ P",
    }
    for results in dist_pool.run(_direct_cases):
        for got in results:
            name = got["name"]
            assert got["why"] is None, f"{name}: {got['why']}"
            if name in local:
                assert got["dispatches"] == 1, f"{name}: {got}"
                assert got["collectives"] == {}, f"{name}: {got}"
            elif name.startswith("Tensor."):
                continue
            else:
                assert got["dispatches"] > 1, f"{name}: {got}"
        sbps = {got["name"]: got["sbps"] for got in results}
        assert sbps["add P+P"] == ["P", "P", "S(0)"]
        assert sbps["mul P*2"] == ["P", "B", "S(1)"]
        assert sbps["mul P*B list"] == ["P", "S(0)"]
        assert sbps["addcmul P,P,B"] == ["P"]


def _reduction_cases() -> list[dict[str, Any]]:
    pl = world()
    gen = torch.Generator().manual_seed(3)
    # (1, 4) split on dim 0 over 2 ranks leaves rank 1 an empty shard
    values = [grid(torch.randn(shape, generator=gen)) for shape in ((6, 5), (4, 7), (3,), (1, 4))]
    sbps = [S0, S1, B, S0]
    out = []
    for name, call in (
        ("norm 2", lambda ts: torch._foreach_norm(ts, 2)),
        ("norm 1", lambda ts: torch._foreach_norm(ts, 1)),
        ("norm 3", lambda ts: torch._foreach_norm(ts, 3.0)),
        ("norm inf", lambda ts: torch._foreach_norm(ts, math.inf)),
        ("max", torch._foreach_max),
    ):
        tensors = [make(v, pl, s) for v, s in zip(values, sbps, strict=True)]
        with sbpflow.boxing.trace() as t, dispatched() as seen:
            got = call(tensors)
        out.append(
            {
                "name": name,
                "why": mismatch(logical(got), call(values)),
                "dispatches": len(seen),
                "collectives": dict(t.collectives()),
                "sbps": [sbpflow.sbp.sbp_str(g.sbp) for g in got],
            }
        )
    return out


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_foreach_norm_and_max_on_split_lists(dist_pool: DistributedPool) -> None:
    """_foreach_norm (p = 1, 2, 3, inf) and _foreach_max of split and broadcast tensors equal
    torch's: one dispatch, one all_reduce for the split positions together, outputs B."""
    for results in dist_pool.run(_reduction_cases):
        for got in results:
            assert got["why"] is None, f"{got['name']}: {got['why']}"
            assert got["dispatches"] == 1, got
            assert got["collectives"] == {"all_reduce": 1}, got
            assert got["sbps"] == ["B"] * 4, got


def _write_into_detached_view() -> str:
    x = make(grid(torch.randn(6, 5, generator=torch.Generator().manual_seed(4))), world(), S1)
    view = x[:, 1]  # gathered from S(1): a copy, not a view of x's pieces
    try:
        torch._foreach_add_([view], 1.0)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_foreach_write_into_detached_view_is_refused(dist_pool: DistributedPool) -> None:
    """An in-place foreach op into a view holding a copy raises, as the single op does."""
    for message in dist_pool.run(_write_into_detached_view):
        assert "view of a global tensor" in message, message
