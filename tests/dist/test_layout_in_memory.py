"""Strides and in-place ops of global tensors, against single-process torch.

A global tensor's strides are its logical tensor's (NOTE [logical strides] in
sbpflow/_global.py), the same on every rank: ``x.t()`` says it is transposed, as
a plain tensor does, so ``x.t().contiguous()`` really copies and a linear
weight's gradient comes out of backward laid out like the weight. Repeated in-place ops
take the dispatcher's fast path (NOTE [in-place fast path]): their values, the
object returned and the version counter must be plain torch's, and writes into
a view holding a copy must still be refused there.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, logical, make, placement, sbp_name


def strides_job(ranks: Any) -> list[tuple[str, str, Any, Any]]:
    """Worker: (what, layout, got, want) pairs to compare."""
    pl = placement(ranks)
    even = torch.arange(4.0 * len(ranks) * 6).reshape(4 * len(ranks), 6)
    uneven = torch.arange(24.0).reshape(3, 8)  # some pieces one row (contiguous either way)
    out = []
    for value, s in itertools.product((even, uneven), (B, S0, S1, P)):
        x = make(value, pl, s, 1)
        name = f"{sbp_name(s)} of {list(value.shape)}"
        out.append(("x.t().stride()", name, x.t().stride(), value.t().stride()))
        out.append(("x.stride()", name, x.stride(), value.stride()))
        y = x.t().contiguous()
        out.append(
            ("x.t().contiguous().stride()", name, y.stride(), value.t().contiguous().stride())
        )
        out.append(("its piece is contiguous", name, y.to_local().is_contiguous(), True))
        out.append(("its value", name, torch.equal(logical(y), value.t()), True))
        z = x.permute(1, 0).reshape(-1)
        out.append(
            (
                "x.permute(1, 0).reshape(-1)",
                name,
                torch.equal(logical(z), value.t().reshape(-1)),
                True,
            )
        )
    # A linear layer with its weight split unevenly (pieces of 2 rows and 1 row), whose
    # backward branches on the strides of W.t(): the same branch on every rank, right values.
    torch.manual_seed(1)
    h_value, w_value, b_value, g_value = (
        torch.randn(8, 8), torch.randn(3, 8), torch.randn(3), torch.randn(8, 3),
    )  # fmt: skip
    h, w, b = (
        make(v, pl, s).requires_grad_() for v, s in ((h_value, S1), (w_value, S0), (b_value, S0))
    )
    torch.nn.functional.linear(h, w, b).backward(make(g_value, pl, S0))
    plain = [v.clone().requires_grad_() for v in (h_value, w_value, b_value)]
    torch.nn.functional.linear(*plain).backward(g_value)
    for what, got, want in zip(("h", "W", "b"), (h, w, b), plain, strict=True):
        close = torch.allclose(logical(got.grad), want.grad, atol=1e-5)
        out.append((f"uneven linear: {what}.grad value", "", close, True))
    # global data parallelism: the weight's gradient is laid out like the weight, as in torch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    batch = torch.randn(2 * len(ranks), 6)
    model(batch).square().mean().backward()
    want_grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    model.to_global(pl, B)
    model(batch.to_global(pl, B).to_global(sbp=S0)).square().mean().backward()
    for (name, p), want, ref in zip(model.named_parameters(), want_grads, reference, strict=True):
        assert torch.equal(p.to_local(), ref)
        grad = p.grad.to_global(sbp=B)
        out.append((f"{name}.grad stride", sbp_name(p.grad.sbp[0]), p.grad.stride(), p.stride()))
        out.append((f"{name}.grad piece contiguous", "", p.grad.to_local().is_contiguous(), True))
        out.append(
            (f"{name}.grad value", "", torch.allclose(grad.to_local(), want, atol=1e-6), True)
        )
    return out


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_strides_follow_the_pieces_memory_order(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(strides_job, list(range(dist_pool.world_size)))
    for rank, per_rank in enumerate(results):
        assert per_rank == results[0], f"rank {rank} and rank 0 disagree"
        for what, sbp, got, want in per_rank:
            assert got == want, f"rank {rank}: {what} on {sbp}: got {got}, plain torch {want}"


def in_place_job(ranks: Any) -> list[tuple[str, str, Any, Any]]:
    """Worker: the same in-place update three times (the later ones on the fast path)."""
    pl = placement(ranks)
    value = (torch.arange(2.0 * len(ranks) * 3).reshape(2 * len(ranks), 3) - 3) / 4
    step = torch.full_like(value, 0.5)
    out = []
    for s in (B, S0, S1, P):
        name = sbp_name(s)
        x, g = make(value, pl, s, 1), make(step, pl, s if s != P else B, 2)
        want = value.clone()
        for k in range(3):
            version = x._version
            with torch.no_grad():
                returned = x.add_(g, alpha=-0.25).mul_(1.5)
            want.add_(step, alpha=-0.25).mul_(1.5)
            out.append((f"call {k}: returns x itself", name, returned is x, True))
            out.append((f"call {k}: version counter moved", name, x._version > version, True))
            out.append((f"call {k}: value", name, torch.equal(logical(x), want), True))
    # A view whose piece is a copy (x[:, 1] of a tensor split on dim 1) refuses writes, also
    # once the same in-place call on a tensor of its layout and shape is on the fast path.
    x = make(value, pl, S1, 1)
    column = x[:, 1]
    other = make(torch.zeros(column.shape), pl, column.sbp, 3)
    for _ in range(2):
        other.mul_(2)  # leaves a fast-path entry for mul_ of this layout and shape
    try:
        column.mul_(2)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    out.append(
        (
            "a write into a copied view",
            "S(1)",
            "to_global(sbp=sbpflow.sbp.broadcast)" in refused,
            True,
        )
    )
    out.append(("the base is unchanged", "S(1)", torch.equal(logical(x), value), True))
    return out


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_repeated_in_place_ops_equal_torch(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(in_place_job, list(range(dist_pool.world_size)))
    for rank, per_rank in enumerate(results):
        for what, sbp, got, want in per_rank:
            assert got == want, f"rank {rank}: {what} on {sbp}: got {got}, expected {want}"
