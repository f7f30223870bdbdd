"""Recording which boxing plans and collectives ran: ``with sbpflow.boxing.trace() as t``."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
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
    # Each collective that ran on this rank and the placement axes it ran over (``()``
    # between placements, None where the caller did not say), plans' and others' alike
    # (gradient buckets' all_reduces).
    collectives_run: list[tuple[str, tuple[int, ...] | None]] = field(default_factory=list)

    def collectives(self) -> collections.Counter[str]:
        """How many times each collective ran on this rank (local steps excluded)."""
        return collections.Counter(op for op in self.ops_run if op in COLLECTIVE_OPS)

    def collectives_by_axes(self) -> collections.Counter[tuple[str, tuple[int, ...] | None]]:
        """How many times each collective ran on this rank, keyed ``(op, axes)``: the
        placement axes it ran over (``()`` between placements, None where not known)."""
        return collections.Counter(self.collectives_run)

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


def record(
    plan: BoxingPlan | None,
    ops: list[str],
    axes: Sequence[tuple[int, ...] | None] | None = None,
) -> None:
    """Note ``ops`` (ran on this rank, from ``plan`` if any); ``axes``: the placement axes of
    each op, in order (None: not known)."""
    if axes is not None and len(axes) != len(ops):
        raise ValueError(f"record: {len(ops)} ops but {len(axes)} axes")
    ran = [
        (op, None if axes is None else axes[i]) for i, op in enumerate(ops) if op in COLLECTIVE_OPS
    ]
    for t in _active:
        if plan is not None:
            t.plans.append(plan)
        t.ops_run.extend(ops)
        t.collectives_run.extend(ran)


def record_fallback(op_name: str) -> None:
    for t in _active:
        t.fallbacks.append(op_name)
