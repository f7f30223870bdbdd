"""Forward-and-backward op cases for the view and nn rule tests.

A case runs one function twice on every rank: on plain tensors (the
single-process reference) and on global tensors laid out as the case says,
then compares the logical output and the logical gradient of every floating
input. It also records the output's SBP and any fallback, so a test can assert
the rule kept a split and never fell back to broadcasting everything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import sbpflow
from sbpflow.sbp import Broadcast

from ._ops_support import logical, make, mismatch


@dataclass
class Case:
    name: str
    fn: Callable[..., torch.Tensor]
    inputs: Sequence[torch.Tensor]
    sbps: Sequence[Any]  # one SBP (or N-D tuple) per input
    expect: Any = None  # the output's SBP tuple, when the rule's choice is part of the test
    grad: bool = True
    atol: float = 1e-5
    seed: int = 0
    extra: Callable[[Any, Any], str | None] | None = None  # (global result, reference) -> problem
    notes: list[str] = field(default_factory=list)


def _grad_for(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 101))


def run_case(case: Case, pl: sbpflow.Placement) -> list[str]:
    """Problems found (empty when the case passes)."""
    problems: list[str] = []
    refs = [x.clone().requires_grad_(case.grad and x.is_floating_point()) for x in case.inputs]
    torch.manual_seed(case.seed)
    want = case.fn(*refs)
    grad_out = _grad_for(want.shape, case.seed)
    if case.grad:
        want.backward(grad_out)
    with sbpflow.boxing.trace() as t:
        try:
            globals_ = [
                make(x, pl, s, seed=case.seed)
                .detach()
                .requires_grad_(case.grad and x.is_floating_point())
                for x, s in zip(case.inputs, case.sbps, strict=True)
            ]
            torch.manual_seed(case.seed)
            got = case.fn(*globals_)
            if case.grad:
                got.backward(make(grad_out, pl, (Broadcast(),) * pl.ndim))
        except Exception as error:  # report every case, not only the first failure
            return [f"{case.name}: raised {type(error).__name__}: {error}"]
    problems += [f"{case.name}: fell back on {op}" for op in t.fallbacks]
    if case.expect is not None and tuple(got.sbp) != tuple(case.expect):
        problems.append(f"{case.name}: output SBP {got.sbp}, expected {case.expect}")
    why = mismatch(logical(got), want.detach(), atol=case.atol, rtol=case.atol)
    if why:
        problems.append(f"{case.name} forward: {why}")
    if case.grad:
        for i, (g, r) in enumerate(zip(globals_, refs, strict=True)):
            if r.grad is None:
                continue
            if g.grad is None:
                problems.append(f"{case.name}: input {i} got no gradient")
                continue
            why = mismatch(logical(g.grad), r.grad, atol=case.atol, rtol=case.atol)
            if why:
                problems.append(f"{case.name} grad of input {i}: {why}")
    if case.extra is not None:
        why = case.extra(got, want)
        if why:
            problems.append(f"{case.name}: {why}")
    return problems


def run_cases(cases: Sequence[Case], pl: sbpflow.Placement) -> list[str]:
    problems: list[str] = []
    for case in cases:
        problems += run_case(case, pl)
    return problems


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def randint(high: int, *shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))
