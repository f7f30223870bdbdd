"""Recording which boxing plans and collectives ran: ``with sbpflow.boxing.trace() as t``."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from .plan import COLLECTIVE_OPS, BoxingPlan

__all__ = ["Trace", "trace"]

_active: list[Trace] = []


@dataclass
class Trace:
    """Plans executed on this rank inside a ``trace()`` block, and the ops that ran."""

    plans: list[BoxingPlan] = field(default_factory=list)
    ops_run: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)

    def collectives(self) -> collections.Counter[str]:
        """How many times each collective ran on this rank (local steps excluded)."""
        return collections.Counter(op for op in self.ops_run if op in COLLECTIVE_OPS)

    def ops(self) -> collections.Counter[str]:
        """Every step that ran on this rank, local ones (slice, zero, copy) included."""
        return collections.Counter(self.ops_run)


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record every boxing plan executed inside the block on this rank."""
    t = Trace()
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)


def record(plan: BoxingPlan | None, ops: list[str]) -> None:
    for t in _active:
        if plan is not None:
            t.plans.append(plan)
        t.ops_run.extend(ops)


def record_fallback(op_name: str) -> None:
    for t in _active:
        t.fallbacks.append(op_name)
