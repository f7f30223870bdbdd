"""Scaled dot-product attention and padding on global tensors, against single-process torch.

``F.scaled_dot_product_attention`` (lowered on CPU to the fused flash kernel
and its backward) with query, key, value and mask split on the batch or the
heads dim equals plain torch on the logical tensors (computed in the same
process), gradients included, with no fallback and no collective inside the
attention. ``F.pad`` (constant, reflect, replicate) along unsplit dims
likewise, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, grid, logical, make, mismatch, placement, sbp_name


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return grid(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inputs needing a gradient: all but a mask (the fused kernels give no mask gradient)."""
    return [t.detach().requires_grad_(i < 3) for i, t in enumerate(tensors)]


def _with_grads(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> list[torch.Tensor]:
    leaves = _leaves(list(tensors))
    out = fn(*leaves)
    (out * out.detach()).sum().backward()
    return [out.detach(), *(t.grad for t in leaves if t.requires_grad)]  # type: ignore[misc]


def _attention_cases() -> list[tuple[str, Callable[..., torch.Tensor], list[torch.Tensor]]]:
    q, k, v = _randn(4, 2, 5, 3, seed=1), _randn(4, 2, 6, 3, seed=2), _randn(4, 2, 6, 3, seed=3)
    mask = _randn(4, 2, 5, 6, seed=4)
    heads_mask = _randn(1, 2, 5, 6, seed=5)  # broadcast over the batch
    bool_mask = _randn(5, 6, seed=6) > -0.5
    return [
        ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [q, k, v]),
        ("sdpa causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         [q, k, v]),
        ("sdpa scale", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), [q, k, v]),
        ("sdpa float mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
         [q, k, v, mask]),
        ("sdpa mask over heads", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
         [q, k, v, heads_mask]),
        ("sdpa bool mask (plain)",
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), [q, k, v]),
    ]  # fmt: skip


def _pad_cases() -> list[tuple[str, Callable[..., torch.Tensor], list[torch.Tensor]]]:
    x3, x4 = _randn(4, 3, 6, seed=7), _randn(4, 3, 5, 6, seed=8)
    return [
        ("constant pad", lambda x: F.pad(x, (1, 2), value=0.5), [x3]),
        ("constant pad 2 dims", lambda x: F.pad(x, (1, 2, 0, 1)), [x4]),
        ("reflect pad 1d", lambda x: F.pad(x, (2, 1), mode="reflect"), [x3]),
        ("reflect pad 2d", lambda x: F.pad(x, (2, 1, 1, 1), mode="reflect"), [x4]),
        ("replicate pad 1d", lambda x: F.pad(x, (2, 1), mode="replicate"), [x3]),
        ("replicate pad 2d", lambda x: F.pad(x, (1, 1, 2, 0), mode="replicate"), [x4]),
    ]


def _layout(t: torch.Tensor, sbp: Any) -> Any:
    """``sbp`` for a tensor running along the split dim, B where that dim is broadcast (1)."""
    return B if sbp.dim < t.dim() and t.shape[sbp.dim] == 1 else sbp


def run_cases(ranks: Any) -> list[tuple[str, str | None, list[str], dict[str, int]]]:
    """Worker: (case, mismatch or None, fallbacks, collectives inside the op) per case."""
    pl = placement(ranks)
    out = []
    cases = [(n, f, ts, s) for n, f, ts in _attention_cases() for s in (S0, S1)]
    cases += [(n, f, ts, s) for n, f, ts in _pad_cases() for s in (S0, S1, P)]
    for name, fn, tensors, sbp in cases:
        globals_ = [
            make(t, pl, sbp if sbp == P else _layout(t, sbp), 10 + i) for i, t in enumerate(tensors)
        ]
        leaves = _leaves(globals_)
        with sbpflow.boxing.trace() as t:
            result = fn(*leaves)
        collectives = dict(t.collectives())
        fallbacks = list(t.fallbacks)
        (result * make(logical(result), pl, B)).sum().backward()
        got = [logical(result), *(logical(x.grad) for x in leaves if x.requires_grad)]
        want = _with_grads(fn, *tensors)
        out.append((f"{name} {sbp_name(sbp)}", mismatch(got, want), fallbacks, collectives))
    return out


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_attention_and_padding_split_run_locally(dist_pool: DistributedPool) -> None:
    """Batch or heads split attention, and pads along unsplit dims, equal torch (values and
    gradients) with no fallback and no collective in the forward op."""
    for rank, per_rank in enumerate(dist_pool.run(run_cases, list(range(dist_pool.world_size)))):
        for name, why, fallbacks, collectives in per_rank:
            assert why is None, f"rank {rank}, {name}: {why}"
            assert fallbacks == [], f"rank {rank}, {name}: fell back on {fallbacks}"
            assert collectives == {}, f"rank {rank}, {name}: ran {collectives}"


def _grouped_query_cases() -> list[tuple[str, int, int]]:
    """(name, query heads, key/value heads): grouped-query and multi-query attention."""
    return [("gqa 4/2", 4, 2), ("gqa 8/4", 8, 4), ("gqa 6/3", 6, 3), ("mqa 4/1", 4, 1)]


def run_grouped_query_cases(ranks: Any) -> list[tuple[str, str | None, list[str], dict, str]]:
    """Worker: query, key and value given split on heads (key/value heads fewer); per case
    (name, mismatch or None, fallbacks, collectives inside the op, the output's SBP)."""
    pl = placement(ranks)
    out = []
    for name, heads, kv_heads in _grouped_query_cases():
        q = _randn(2, heads, 5, 3, seed=heads)
        k, v = _randn(2, kv_heads, 6, 3, seed=20 + kv_heads), _randn(2, kv_heads, 6, 3, seed=30)

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        leaves = _leaves([make(t, pl, _layout(t, S1), 10 + i) for i, t in enumerate((q, k, v))])
        with sbpflow.boxing.trace() as t:
            result = fn(*leaves)
        collectives, fallbacks = dict(t.collectives()), list(t.fallbacks)
        (result * make(logical(result), pl, B)).sum().backward()
        got = [logical(result), *(logical(x.grad) for x in leaves)]
        want = _with_grads(fn, q, k, v)
        out.append((name, mismatch(got, want), fallbacks, collectives, sbp_name(result.sbp[0])))
    return out


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_grouped_query_attention_splits_heads_in_whole_groups(dist_pool: DistributedPool) -> None:
    """Key/value heads fewer than query heads: with the heads split so that every rank holds
    whole groups (its query heads and exactly their key/value heads), attention runs locally;
    otherwise it is laid out another way. Values and gradients equal torch either way."""
    world_size = dist_pool.world_size
    # (4/2 on 4 ranks would give the ranks 1,1,1,1 query heads and 1,1,0,0 key/value heads.)
    local = {2: {"gqa 4/2", "gqa 8/4", "mqa 4/1"}, 4: {"gqa 8/4", "mqa 4/1"}}[world_size]
    for rank, per_rank in enumerate(
        dist_pool.run(run_grouped_query_cases, list(range(world_size)))
    ):
        for name, why, fallbacks, collectives, sbp in per_rank:
            where = f"rank {rank}, {name} on {world_size} ranks"
            assert why is None, f"{where}: {why}"
            assert fallbacks == [], f"{where}: fell back on {fallbacks}"
            if name in local:
                assert (collectives, sbp) == ({}, "S(1)"), f"{where}: ran {collectives}, {sbp}"
            else:
                assert collectives, f"{where}: split heads across groups with no collective"
