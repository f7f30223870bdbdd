"""An optimizer's pointwise ops on operands of one layout go straight to the pieces (NOTE
[same-layout pointwise] in sbpflow/_dispatch_pointwise.py); every other call keeps the
general path. Compared with the same ops on plain tensors in one process.

2 gloo ranks. Operands broadcast, split on dim 0 or dim 1, partial-sum (which must not take
the handler: ``sqrt`` or ``+ eps`` of a partial sum is not the sum of the pieces' results),
or of mixed layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, grid, logical, make, mismatch, world

aten = torch.ops.aten
# The ops of AdamW's single-tensor loop (torch's default on CPU).
_LOOP_OPS = {
    aten.mul_.Tensor, aten.lerp_.Scalar, aten.addcmul_.default, aten.sqrt.default,
    aten.div.Tensor, aten.add_.Tensor, aten.addcdiv_.default,
}  # fmt: skip


def _adam_like(a: Any, b: Any, c: Any) -> list[Any]:
    """AdamW's single-tensor update on (param, grad, second moment), then the loop's other
    ops: what the handler is for."""
    a.mul_(0.99)
    m = c.clone()
    m.lerp_(b, 0.1)
    c.mul_(0.999).addcmul_(b, b, value=0.001)
    denom = (c.sqrt() / 0.7).add_(1e-3)
    a.addcdiv_(m, denom, value=-0.01)
    a.add_(b, alpha=0.5).sub_(0.25).div_(1.5)
    out = [a, c, denom, b * 2.0, b + c, b - 1.0, torch.maximum(b, c), b / c]
    d = c.clone()
    d.copy_(b)
    d.sqrt_()
    return [*out, d]


def _values(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [grid(torch.rand(6, 4, generator=gen) + 0.5) for _ in range(3)]


def same_layout_cases() -> dict[str, str | None]:
    """Worker: the update on each layout (and mixes) against plain tensors."""
    pl = world()
    cases = {
        "B": (B, B, B),
        "S(0)": (S0, S0, S0),
        "S(1)": (S1, S1, S1),
        "P": (P, P, P),  # never local: sqrt, +eps, x*x of partial sums
        "mixed B/S(0)": (B, S0, B),
        "mixed S(0)/S(1)": (S0, S1, S0),
        "mixed P/B": (B, P, B),
    }
    out = {}
    for name, sbps in cases.items():
        plain = _values(1)
        globals_ = [
            make(v.clone(), pl, s, seed=k) for k, (v, s) in enumerate(zip(plain, sbps, strict=True))
        ]
        with torch.no_grad():
            want = _adam_like(*[v.clone() for v in plain])
            got = [logical(g) for g in _adam_like(*globals_)]
        out[name] = mismatch(got, want, atol=1e-6, rtol=1e-6)
    return out


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_values_equal_plain_torch(dist_pool: DistributedPool) -> None:
    for rank_result in dist_pool.run(same_layout_cases):
        failed = {name: why for name, why in rank_result.items() if why}
        assert not failed, failed


def adamw_steps(layout: str, foreach: bool, evicted: bool = False) -> dict[str, Any]:
    """Worker: 3 AdamW steps (loop or foreach) on global parameters of one layout, gradients
    set to known values, against the same on plain tensors; and whether the loop's ops left
    entries in the general fast path (they do not when the handler takes them). ``evicted``:
    the interning table drops the parameters' metadata before the gradients are made, so
    parameters and gradients hold distinct but equal metadata objects."""
    if evicted:  # a small bound, then other shapes push the parameters' entries out
        metas = sbpflow._global._metas
        bound, metas.bound = metas.bound, 4
        try:
            return _adamw_steps_evicted(layout, foreach)
        finally:
            metas.bound = bound
    pl = world()
    sbp = {"B": B, "S(0)": S0, "S(1)": S1}[layout]
    gen = torch.Generator().manual_seed(3)
    plain = [torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in plain] for _ in range(3)]
    params = [
        torch.nn.Parameter(make(t, pl, sbp if t.dim() == 2 or sbp == B else S0)) for t in plain
    ]
    reference = [torch.nn.Parameter(t.clone()) for t in plain]
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=foreach)
    opt_ref = torch.optim.AdamW(reference, lr=0.05, weight_decay=0.1, foreach=foreach)
    fast = sbpflow.GlobalTensor._op_dispatcher.fast
    fast.clear()
    if _EVICT.get("now"):
        for n in range(1, 9):  # every metadata entry before these is dropped
            torch.zeros(n, 7).to_global(pl, B)
        assert not any(p._meta is m for p in params for m in sbpflow._global._metas.values())
    for step_grads in grads:
        for p, r, g in zip(params, reference, step_grads, strict=True):
            p.grad = make(g, pl, p.sbp)
            r.grad = g.clone()
        opt.step()
        opt_ref.step()
    ops = {key[0] for key in fast if isinstance(key, tuple)}
    return {
        "errors": [
            (logical(p) - r).abs().max().item() for p, r in zip(params, reference, strict=True)
        ],
        "general fast entries": sorted(str(op) for op in ops & _LOOP_OPS),
    }


_EVICT: dict[str, bool] = {}


def _adamw_steps_evicted(layout: str, foreach: bool) -> dict[str, Any]:
    _EVICT["now"] = True
    try:
        return adamw_steps(layout, foreach)
    finally:
        _EVICT.clear()


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_adamw_takes_the_handler_and_matches(dist_pool: DistributedPool) -> None:
    for layout in ("B", "S(0)", "S(1)"):
        for foreach in (False, True):
            for evicted in (False, True):
                for result in dist_pool.run(adamw_steps, layout, foreach, evicted):
                    where = (layout, foreach, evicted, result)
                    assert max(result["errors"]) < 1e-6, where
                    if not foreach:  # the loop's ops: not left to the general path
                        assert result["general fast entries"] == [], where


def detached_view_write() -> str:
    """Worker: a write into a view whose piece is a copy is refused, on this path too."""
    pl = world()
    x = make(torch.rand(4, 6), pl, S1)
    view = x[:, 1]
    y = torch.rand(view.shape).to_global(pl, view.sbp)
    try:
        view.mul_(2.0)
    except ValueError as error:
        first = str(error)
    else:
        return "mul_ into a detached view was not refused"
    try:
        view.add_(y)
    except ValueError:
        return first
    return "add_ into a detached view was not refused"


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_write_into_detached_view_is_refused(dist_pool: DistributedPool) -> None:
    for message in dist_pool.run(detached_view_write):
        assert "view of a global tensor" in message, message
