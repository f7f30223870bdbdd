"""Storage and in-place metadata ops on global tensors, against single-process torch.

Storage ops address storage as torch's do (NOTE [storage ops]): on broadcast
tensors ``as_strided``, ``as_strided_``, ``as_strided_copy``,
``as_strided_scatter`` and ``resize_`` equal plain torch running the same program
in the same process, a transposed view and a transposed copy (read in memory
order, not row-major) included, and a tensor made from a view of a larger local
tensor (it owns its storage); gradients through ``as_strided`` too. A global
tensor that is a view into a larger storage (a slice, or detached from one) is
a ValueError naming the op and the fix, on every rank, where torch would read
the larger storage: never the elements of a copy. On split and partial tensors
they are a ValueError naming the op and the fix. In-place views (``squeeze_``,
``unsqueeze_``, ``t_``, ``transpose_``) on every layout give torch's value and
logical shape, and ``set_`` makes a global tensor an alias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, S2, B, P, check_cases, grid, logical, make, placement, sbp_name

Case = tuple[str, Callable[[], Any], Callable[[], Any]]
_X = torch.arange(24.0).reshape(4, 6) / 8
_BIG = torch.arange(40.0) / 4  # a larger storage to take views of
_STRIDED = [  # (size, stride, offset): windows, a transpose, overlap, a stride-0 dim
    ((3, 2), (6, 1), 0),
    ((2, 3), (1, 4), 2),
    ((6, 4), (1, 6), 0),
    ((5, 3), (2, 1), 1),
    ((2, 4), (0, 1), 7),
]


def _grads(x: torch.Tensor, size: Any, stride: Any, offset: int, weight: torch.Tensor) -> Any:
    leaf = x.detach().requires_grad_()
    (leaf.as_strided(size, stride, offset) * weight).sum().backward()
    return leaf.grad


def _inplace(x: torch.Tensor, method: str, *args: Any) -> torch.Tensor:
    getattr(x, method)(*args)
    return x


def _cases(ranks: Any) -> list[Case]:
    pl = placement(ranks)
    cases: list[Case] = []
    for size, stride, offset in _STRIDED:
        tag = f"{size} {stride} +{offset}"
        w = grid(torch.randn(size, generator=torch.Generator().manual_seed(offset)))
        cases += [
            (f"as_strided B {tag}", lambda a=(size, stride, offset): make(_X, pl, B).as_strided(*a),
             lambda a=(size, stride, offset): _X.as_strided(*a)),
            (f"as_strided of a transposed B {tag}",
             lambda a=(size, stride, offset): make(_X, pl, B).t().as_strided(*a),
             lambda a=(size, stride, offset): _X.clone().t().as_strided(*a)),
            (f"as_strided of a transposed copy B {tag}",
             lambda a=(size, stride, offset): make(_X, pl, B).t().clone().as_strided(*a),
             lambda a=(size, stride, offset): _X.t().clone().as_strided(*a)),
            (f"as_strided of a whole-storage view B {tag}",
             lambda a=(size, stride, offset): make(_X, pl, B).view(6, 4).as_strided(*a),
             lambda a=(size, stride, offset): _X.clone().view(6, 4).as_strided(*a)),
            (f"as_strided of a tensor made from a slice B {tag}",
             lambda a=(size, stride, offset): sbpflow.to_global(_BIG[5:29].view(4, 6), pl, B).as_strided(*a),
             lambda a=(size, stride, offset): _BIG[5:29].clone().view(4, 6).as_strided(*a)),
            (f"as_strided_copy B {tag}",
             lambda a=(size, stride, offset): torch.as_strided_copy(make(_X, pl, B), *a),
             lambda a=(size, stride, offset): torch.as_strided_copy(_X, *a)),
            (f"as_strided_ B {tag}", lambda a=(size, stride, offset): _inplace(make(_X, pl, B), "as_strided_", *a),
             lambda a=(size, stride, offset): _X.clone().as_strided_(*a)),
        ]  # fmt: skip
        if 0 not in stride:  # torch refuses to scatter into overlapping elements
            cases.append(
                (f"as_strided_scatter B {tag}",
                 lambda a=(size, stride, offset), w=w: torch.as_strided_scatter(make(_X, pl, B), make(w, pl, S0), *a),
                 lambda a=(size, stride, offset), w=w: torch.as_strided_scatter(_X, w, *a))
            )  # fmt: skip
        for s in (B, S0, S1, P):  # the gradient arrives in each layout
            cases.append(
                (f"as_strided grads, grad {sbp_name(s)} {tag}",
                 lambda a=(size, stride, offset), w=w, s=s: _grads(make(_X, pl, B), *a, make(w, pl, s, 5)),
                 lambda a=(size, stride, offset), w=w: _grads(_X, *a, w))
            )  # fmt: skip
    y = _X.reshape(4, 1, 6)
    for s in (B, S0, S1, P):
        tag = sbp_name(s)
        s3 = S2 if s == S1 else s  # (4, 6)'s S(1) is S(2) of (4, 1, 6)
        cases += [
            (f"squeeze_ {tag}", lambda s=s3: _inplace(make(y, pl, s), "squeeze_", 1), lambda: y.squeeze(1)),
            (f"squeeze_() {tag}", lambda s=s3: _inplace(make(y, pl, s), "squeeze_"), lambda: y.squeeze()),
            (f"unsqueeze_ {tag}", lambda s=s: _inplace(make(_X, pl, s), "unsqueeze_", 0), lambda: _X.unsqueeze(0)),
            (f"t_ {tag}", lambda s=s: _inplace(make(_X, pl, s), "t_") * 1, lambda: _X.t() * 1),
            (f"transpose_ {tag}", lambda s=s: _inplace(make(y, pl, s3), "transpose_", 0, 2) + 0,
             lambda: y.transpose(0, 2) + 0),
            (f"squeeze_ then op {tag}", lambda s=s3: _inplace(make(y, pl, s), "squeeze_", 1).sum(0),
             lambda: y.squeeze(1).sum(0)),
            (f"resize_ same size {tag}", lambda s=s: _inplace(make(_X, pl, s), "resize_", 4, 6), lambda: _X),
        ]  # fmt: skip
    cases += [
        ("resize_ B shrink", lambda: _inplace(make(_X, pl, B), "resize_", 5, 3), lambda: _X.clone().resize_(5, 3)),
        ("resize_ transposed B", lambda: _inplace(make(_X, pl, B).t(), "resize_", 2, 2),
         lambda: _X.clone().t().resize_(2, 2)),
        ("resize_ transposed copy B", lambda: _inplace(make(_X, pl, B).t().clone(), "resize_", 2, 2),
         lambda: _X.t().clone().resize_(2, 2)),
        ("set_ to a global", lambda: _inplace(make(_X, pl, S0), "set_", make(y, pl, S1)) * 1, lambda: y * 1),
    ]  # fmt: skip
    return cases


def run_cases(ranks: Any) -> tuple[list[str], list[str]]:
    """Worker: (failures, fallbacks) over every case."""
    return check_cases(_cases(ranks))


def _outcomes(calls: list[tuple[str, Callable[[], Any]]]) -> list[tuple[str, str]]:
    """(case, the ValueError's message or 'no error') for each call."""
    out = []
    for name, call in calls:
        try:
            call()
        except ValueError as error:
            out.append((name, str(error)))
        else:
            out.append((name, "no error"))
    return out


def run_errors(ranks: Any) -> list[tuple[str, str]]:
    """Worker: (case, error message or 'no error') for storage ops on split/partial tensors."""
    pl = placement(ranks)
    calls: list[tuple[str, Callable[[], Any]]] = []
    for s in (S0, S1, P):
        calls += [
            (f"as_strided {s}", lambda s=s: make(_X, pl, s).as_strided((2, 2), (1, 2))),
            (f"as_strided_ {s}", lambda s=s: make(_X, pl, s).as_strided_((2, 2), (1, 2))),
            (f"as_strided_scatter {s}",
             lambda s=s: torch.as_strided_scatter(make(_X, pl, s), make(_X[:2, :2], pl, B), (2, 2), (1, 2))),
            (f"resize_ {s}", lambda s=s: make(_X, pl, s).resize_(3, 3)),
        ]  # fmt: skip
    calls.append(("set_ storage", lambda: make(_X, pl, B).set_(_X.untyped_storage())))
    return _outcomes(calls)


def run_view_errors(ranks: Any) -> list[tuple[str, str]]:
    """Worker: (case, error message or 'no error') for storage ops on a broadcast tensor that
    is a view into a larger storage (torch would read elements outside the tensor)."""
    pl = placement(ranks)

    def view() -> sbpflow.GlobalTensor:
        return make(_X, pl, B).flatten()[5:15]

    calls: list[tuple[str, Callable[[], Any]]] = [
        ("as_strided of a slice", lambda: view().as_strided((2, 2), (1, 2), 0)),
        ("as_strided of a slice (its own offset)", lambda: view().as_strided((2, 2), (1, 2))),
        ("as_strided of a detached slice", lambda: view().detach().as_strided((2, 2), (1, 2), 0)),
        ("as_strided_ of a slice", lambda: view().as_strided_((2, 2), (1, 2), 0)),
        ("as_strided_copy of a slice", lambda: torch.as_strided_copy(view(), (2, 2), (1, 2), 0)),
        ("as_strided_scatter of a slice",
         lambda: torch.as_strided_scatter(view(), make(_X[:2, :2], pl, B), (2, 2), (1, 2), 0)),
        ("resize_ of a slice", lambda: view().resize_(12)),
        ("as_strided of a row", lambda: make(_X, pl, B)[1].as_strided((2,), (1,), 0)),
    ]  # fmt: skip
    return _outcomes(calls)


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_storage_ops_match_single_process(dist_pool: DistributedPool) -> None:
    """as_strided family and resize_ on broadcast, in-place views and set_ on every layout:
    values and logical shapes equal plain torch."""
    ranks = list(range(dist_pool.world_size))
    for rank, (failures, _) in enumerate(dist_pool.run(run_cases, ranks)):
        assert failures == [], f"rank {rank}: {len(failures)} failures: {failures[:12]}"


@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_storage_ops_on_a_view_of_a_larger_storage_are_errors(dist_pool: DistributedPool) -> None:
    """A broadcast view of part of a tensor: the op would address storage outside it (plain
    torch reads the base's elements there), so it is an error naming the op, the view and
    the fix on every rank, never a value computed from a copy."""
    results = dist_pool.run(run_view_errors, list(range(dist_pool.world_size)))
    assert all(r == results[0] for r in results)
    for name, message in results[0]:
        op = "resize_" if name.startswith("resize_") else "as_strided"
        assert op in message and "does not own its storage" in message, f"{name}: {message}"
        assert "x.clone()" in message, f"{name}: {message}"


def test_storage_ops_on_split_or_partial_are_errors(dist_pool: DistributedPool) -> None:
    """On split/partial tensors storage ops raise a ValueError naming the op, the layout and
    the fix, on every rank."""
    for rank, results in enumerate(dist_pool.run(run_errors, list(range(dist_pool.world_size)))):
        for name, message in results:
            op = name.split()[0]
            assert op in message, f"rank {rank}, {name}: {message}"
            fix = "global source" if op == "set_" else "to_global(sbp=sbpflow.sbp.broadcast"
            assert fix in message, f"rank {rank}, {name}: {message}"
