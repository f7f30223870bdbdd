"""Helpers for the op tests: build a global tensor from a logical one, read it back, compare.

Partial inputs are built from non-trivial parts (random pieces that sum to the
logical tensor), so a rule that wrongly treats P as B shows up in the values.
The parts are multiples of 2**-8, so for test values on that grid (``grid``)
they sum exactly in any order: two reductions of one partial tensor agree to
the bit, as the single-process tensor agrees with itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.sbp import Broadcast, Partial, SbpParallel, Split, normalize, sbp_str

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")
PMAX = Partial("max")


def placement(ranks: Any) -> sbpflow.Placement:
    return sbpflow.placement("cpu", ranks)


def world() -> sbpflow.Placement:
    return placement(list(range(sbpflow.env.get_world_size())))


def _term(layout: Layout, rank: int) -> tuple[int, int]:
    """(which partial-sum part ``rank`` holds, how many parts there are)."""
    index, count = 0, 1
    for c, n, s in zip(
        layout.placement.coords_of(rank), layout.placement.shape, layout.sbp, strict=True
    ):
        if isinstance(s, Partial):
            index, count = index * n + c, count * n
    return index, count


def grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to multiples of 2**-8 (partial parts then sum exactly, see above)."""
    return (t * 256).round() / 256


def make(
    value: torch.Tensor, pl: sbpflow.Placement, sbp: Any, seed: int = 0
) -> sbpflow.GlobalTensor:
    """A global tensor with logical value ``value`` laid out as ``sbp`` (no collective)."""
    rank = sbpflow.env.get_rank()
    if isinstance(sbp, SbpParallel) and pl.ndim > 1:
        sbp = (sbp,) * pl.ndim  # one SBP for every axis
    layout = Layout(pl, normalize(sbp, pl.ndim, value.dim()))
    if rank not in pl:
        local = value.clone()
    else:
        region = tuple(slice(a, b) for a, b in layout.box(value.shape, rank))
        local = value[region].clone()
        index, count = _term(layout, rank)
        if count > 1:
            if any(isinstance(s, Partial) and s.reduce_op == "max" for s in layout.sbp):
                # P(max): the other parts are smaller, the first holds the value.
                if index:
                    local = (
                        local
                        - 1
                        - torch.rand(local.shape, generator=torch.Generator().manual_seed(seed))
                    )
            else:
                gen = torch.Generator().manual_seed(seed + 17)
                noise = [
                    (torch.randint(-1024, 1025, value.shape, generator=gen) / 256).to(value.dtype)
                    for _ in range(count)
                ]
                noise[0] = -sum(noise[1:], torch.zeros_like(value))  # the parts sum to zero
                if value.is_floating_point():
                    local = local + noise[0][region] if index == 0 else noise[index][region].clone()
                elif index:
                    local = torch.zeros_like(local)
    return sbpflow.to_global(local, pl, layout.sbp, shape=value.shape, check_meta=False)


def logical(x: Any) -> Any:
    """The logical value of a global tensor as a plain tensor (a collective); others as they are."""
    if isinstance(x, sbpflow.GlobalTensor):
        full = x.to_global(sbp=tuple(Broadcast() for _ in x.sbp), check_meta=False)
        return full.to_local().detach()
    if isinstance(x, (list, tuple)):
        return type(x)(logical(v) for v in x)
    return x


def mismatch(got: Any, want: Any, atol: float = 1e-5, rtol: float = 1e-5) -> str | None:
    """None if ``got`` matches ``want`` (tensors, numbers, nested lists), else why not."""
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"expected {len(want)} items, got {got!r}"
        for g, w in zip(got, want, strict=True):
            why = mismatch(g, w, atol, rtol)
            if why:
                return why
        return None
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"shape/dtype {list(got.shape)} {got.dtype} != {list(want.shape)} {want.dtype}"
        if want.dtype in (torch.bool, torch.int64, torch.int32):
            return None if torch.equal(got, want) else f"{got} != {want}"
        if not torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol, equal_nan=True):
            return f"max error {(got.double() - want.double()).abs().max().item():.3g}"
        return None
    return None if got == want else f"{got!r} != {want!r}"


def check_cases(
    cases: Sequence[tuple[str, Callable[[], Any], Callable[[], Any]]], **tol: float
) -> tuple[list[str], list[str]]:
    """Run (name, global computation, reference) cases: (failures, fallbacks seen)."""
    failures, fallbacks = [], []
    for name, compute, reference in cases:
        with sbpflow.boxing.trace() as t:
            try:
                got = logical(compute())
            except Exception as error:  # report every case, not just the first
                failures.append(f"{name}: raised {type(error).__name__}: {error}")
                continue
        fallbacks.extend(f"{name}: {op}" for op in t.fallbacks)
        why = mismatch(got, reference(), **tol)
        if why:
            failures.append(f"{name}: {why}")
    return failures, fallbacks


def sbp_name(sbp: SbpParallel | Sequence[SbpParallel]) -> str:
    return str(sbp) if isinstance(sbp, SbpParallel) else sbp_str(tuple(sbp))
