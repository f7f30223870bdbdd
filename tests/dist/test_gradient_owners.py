"""Where a global parameter's data-parallel state lives (NOTE [gradient owners] in _global).

On 2 ranks a broadcast ``Linear`` trains with the batch split over the ranks, so its
gradients join default buckets (a ``GradientSync``) after the first backward. The
parameters' ``__dict__`` must then hold nothing of data parallelism (the sync is found by
the parameter's identity, not through an attribute of the tensor), and ``copy.copy`` /
``copy.deepcopy`` of a parameter get layout hooks of their own, no owner, and train as
plain torch does on one process on the whole batch, as does the original next to them.
"""

from __future__ import annotations

import copy
import gc
import types
from typing import Any

import torch
import torch.nn.functional as F

import sbpflow
from sbpflow._global import gradient_owner, is_layout_hook
from sbpflow.nn.parallel._reducer import GradientSync
from sbpflow.sbp import broadcast, split
from sbpflow.testing import get_pool

LR = 0.1


def _reaches_a_sync(value: object, depth: int = 4) -> bool:
    """Whether ``value`` leads to a ``GradientSync`` through at most ``depth`` references,
    not through a function (the hooks autograd runs hold what they need; an attribute does
    not)."""
    if isinstance(value, GradientSync):
        return True
    if depth == 0 or isinstance(value, (torch.Tensor, types.FunctionType, type)):
        return False
    return any(_reaches_a_sync(v, depth - 1) for v in gc.get_referents(value))


def _has_layout_hooks(t: torch.Tensor) -> bool:
    return any(is_layout_hook(h) for h in (t._backward_hooks or {}).values())


def _step(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One SGD step of ``params`` (weight, bias) on the split batch, next to plain torch's on
    the whole batch from the same values: the largest difference, and whether each gradient
    has its parameter's layout."""
    placement = params[0].placement
    plain = [p.detach().to_local().clone().requires_grad_() for p in params]
    F.mse_loss(F.linear(x, *plain), y).backward()
    expected = [(p - LR * p.grad).detach() for p in plain]
    xs = x.to_global(placement, broadcast).to_global(sbp=split(0))
    ys = y.to_global(placement, broadcast).to_global(sbp=split(0))
    F.mse_loss(F.linear(xs, *params), ys).backward()
    layouts = all(p.grad.sbp == p.sbp for p in params)
    optimizer = torch.optim.SGD(params, lr=LR)
    optimizer.step()
    optimizer.zero_grad()
    got = [p.detach().to_local() for p in params]
    diff = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
    return {"layouts": layouts, "diff": diff}


def owners_job() -> dict[str, Any]:
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to_global(placement, broadcast)
    params = [model.weight, model.bias]
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(3)
    ]
    first = _step(params, *batches[0])  # the default buckets are made at its end
    syncs = [GradientSync.of(p) for p in params]
    out: dict[str, Any] = {
        "first": first,
        "one_sync": syncs[0] is not None and syncs[0] is syncs[1],
        "dict_keys_with_a_sync": [
            k for p in params for k, v in p.__dict__.items() if _reaches_a_sync(v)
        ],
        "original_keeps_layout_hooks": [_has_layout_hooks(p) for p in params],
    }
    copies = {kind: [getattr(copy, kind)(p) for p in params] for kind in ("copy", "deepcopy")}
    for kind, made in copies.items():
        out[kind] = {
            "owners": [gradient_owner(c) is None for c in made],
            "layout_hooks": [_has_layout_hooks(c) for c in made],
            "step": _step(made, *batches[1]),
        }
    out["original_after"] = _step(params, *batches[2])
    out["still_one_sync"] = all(GradientSync.of(p) is syncs[0] for p in params)
    return out


def test_data_parallel_state_is_not_kept_on_the_parameter() -> None:
    """After the default buckets take a broadcast Linear's gradients, nothing in its
    parameters' ``__dict__`` leads to the sync; copies get hooks of their own and no owner
    and train as plain torch on one process does, and so does the original after them."""
    for got in get_pool(2).run(owners_job):
        assert got["first"] == {"layouts": True, "diff": got["first"]["diff"]}, got
        assert got["first"]["diff"] < 1e-6, got
        assert got["one_sync"], got
        assert got["dict_keys_with_a_sync"] == [], got
        assert got["original_keeps_layout_hooks"] == [False, False], got  # the sync's now
        for kind in ("copy", "deepcopy"):
            assert got[kind]["owners"] == [True, True], (kind, got)
            assert got[kind]["layout_hooks"] == [True, True], (kind, got)
            assert got[kind]["step"]["layouts"], (kind, got)
            assert got[kind]["step"]["diff"] < 1e-6, (kind, got)
        assert got["original_after"]["layouts"] and got["original_after"]["diff"] < 1e-6, got
        assert got["still_one_sync"], got
