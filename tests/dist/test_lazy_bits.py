"""Lazy conjugate and negative bits on global tensors, against single-process torch.

``x.conj()`` and ``torch._neg_view(x)`` only flag a view; kernels run below
``__torch_dispatch__`` would read the unflagged data (NOTE [lazy bits]). Each
case is computed on global tensors laid out as B, P, S(0) and S(1) and
compared with the same expression on plain tensors in the same process:
hfftn of a real input with default ``s`` (it conjugates internally), ops on a
conjugated or negated global, the imaginary part of a conjugate (a negative
view), plain flagged tensors mixed into an op with a global (the products
let flagged inputs through to the kernel), and ``to_global`` of a flagged
local tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, check_cases, grid, logical, make, placement, sbp_name

Case = tuple[str, Callable[[], Any], Callable[[], Any]]


def _real(*shape: int, seed: int) -> torch.Tensor:
    return grid(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def _complex(*shape: int, seed: int) -> torch.Tensor:
    return torch.complex(_real(*shape, seed=seed), _real(*shape, seed=seed + 100))


def _flagged_shards(value: torch.Tensor, pl: sbpflow.Placement, sbp: Any) -> Any:
    """``value.conj()`` given to ``to_global`` as every rank's shard (S(0)) or whole (B):
    each rank's local tensor carries the conjugate bit."""
    flagged = value.conj()
    assert flagged.is_conj()
    if sbp == S0:
        rank = sbpflow.env.get_rank()
        return torch.tensor_split(flagged, pl.num_ranks)[rank].to_global(pl, S0)
    return flagged.to_global(pl, B)


def _cases(ranks: Any) -> list[Case]:
    pl = placement(ranks)
    x, c, d = _real(4, 6, seed=1), _complex(4, 6, seed=2), _complex(6, 3, seed=3)
    cases: list[Case] = []
    for s in (B, P, S0, S1):
        tag = sbp_name(s)
        real_layouts = s  # partial real inputs: fft is linear, so P is meaningful too
        cases += [
            (f"hfftn {tag}", lambda s=real_layouts: torch.fft.hfftn(make(x, pl, s, 1)),
             lambda: torch.fft.hfftn(x)),
            (f"hfft {tag}", lambda s=s: torch.fft.hfft(make(x, pl, s, 2)), lambda: torch.fft.hfft(x)),
            (f"conj * 2 {tag}", lambda s=s: make(c, pl, s, 3).conj() * 2, lambda: c.conj() * 2),
            (f"conj + x {tag}", lambda s=s: make(c, pl, s, 4).conj() + make(c, pl, B), lambda: c.conj() + c),
            (f"conj @ d {tag}", lambda s=s: make(c, pl, s, 5).conj() @ make(d, pl, B), lambda: c.conj() @ d),
            (f"conj sum {tag}", lambda s=s: make(c, pl, s, 6).conj().sum(0), lambda: c.conj().sum(0)),
            (f"mH {tag}", lambda s=s: make(c, pl, s, 7).mH * 1, lambda: c.mH * 1),
            (f"conj imag {tag}", lambda s=s: make(c, pl, s, 8).conj().imag * 3, lambda: c.conj().imag * 3),
            (f"neg_view + 1 {tag}", lambda s=s: torch._neg_view(make(x, pl, s, 9)) * 3,
             lambda: torch._neg_view(x) * 3),
            (f"neg_view @ {tag}", lambda s=s: torch._neg_view(make(x, pl, s, 10)) @ make(x.t().contiguous(), pl, B),
             lambda: torch._neg_view(x) @ x.t()),
            (f"global @ plain conj {tag}", lambda s=s: make(c, pl, s, 11) @ d.conj(), lambda: c @ d.conj()),
            (f"global @ plain neg {tag}", lambda s=s: make(x, pl, s, 12) @ torch._neg_view(x.t()),
             lambda: x @ torch._neg_view(x.t())),
            (f"global * plain conj {tag}", lambda s=s: make(c, pl, s, 13) * c.conj(), lambda: c * c.conj()),
        ]  # fmt: skip
    cases += [
        ("to_global(conj local, B)", lambda: _flagged_shards(c, pl, B) * 1, lambda: c.conj() * 1),
        (
            "to_global(conj shards, S(0))",
            lambda: _flagged_shards(c, pl, S0) * 1,
            lambda: c.conj() * 1,
        ),
        ("to_global(neg local, B)", lambda: torch._neg_view(x).to_global(pl, B) + 0, lambda: -x),
    ]
    return cases


def _as_real(t: Any) -> Any:
    """Complex results as (..., 2) real tensors, so both parts are compared."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def run_cases(ranks: Any) -> tuple[list[str], list[str]]:
    """Worker: (failures, fallbacks) over every case."""
    cases = [
        (name, lambda f=f: _as_real(logical(f())), lambda g=g: _as_real(g()))
        for name, f, g in _cases(ranks)
    ]
    return check_cases(cases, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_lazy_bits_match_single_process(dist_pool: DistributedPool) -> None:
    """Conjugated and negated views (global or plain, any layout) give plain torch's values."""
    ranks = list(range(dist_pool.world_size))
    for rank, (failures, _) in enumerate(dist_pool.run(run_cases, ranks)):
        assert failures == [], f"rank {rank}: {len(failures)} failures: {failures[:12]}"
