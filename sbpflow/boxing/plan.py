"""What a boxing plan is: steps from one layout to another, and how it prints."""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._layout import Layout

__all__ = ["COLLECTIVE_OPS", "LOCAL_OPS", "BoxingPlan", "BoxingStep"]

COLLECTIVE_OPS = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send_recv",
)
LOCAL_OPS = ("slice", "zero", "copy")


@dataclass(frozen=True)
class BoxingStep:
    """One step of a plan.

    ``op`` is the collective or local operation; ``axes`` the placement axes it
    runs along (empty for a transfer between placements); ``bytes_per_rank`` the
    bytes the busiest rank sends; ``cost`` the estimated seconds.
    """

    op: str
    src: Layout
    dst: Layout
    axes: tuple[int, ...]
    bytes_per_rank: int
    cost: float

    @property
    def axis(self) -> int | tuple[int, ...] | None:
        """The placement axis (an int), a tuple for merged axes, ``None`` between placements."""
        if not self.axes:
            return None
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @property
    def is_collective(self) -> bool:
        return self.op in COLLECTIVE_OPS

    def __str__(self) -> str:
        where = "between placements" if not self.axes else "axis " + ",".join(map(str, self.axes))
        return (
            f"{self.op:<14} {where:<18} {self.src!s:>10} -> {self.dst!s:<10} "
            f"{_fmt_bytes(self.bytes_per_rank)}/rank  ~{_fmt_seconds(self.cost)}"
        )


@dataclass(frozen=True)
class BoxingPlan:
    """The steps that turn ``src`` into ``dst`` for a tensor of ``shape`` and ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    src: Layout
    dst: Layout
    steps: tuple[BoxingStep, ...]
    # Builds the searched networkx graph on demand (see to_networkx): cached
    # plans stay small, and only a notebook pays for the graph.
    graph_factory: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def cost(self) -> float:
        """Estimated seconds."""
        return sum(step.cost for step in self.steps)

    def collectives(self) -> list[str]:
        return [s.op for s in self.steps if s.is_collective]

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst}"
        if self.src.placement != self.dst.placement:
            head += f"  ({self.src.placement} -> {self.dst.placement})"
        else:
            head += f"  on {self.src.placement}"
        head += f"  shape {list(self.shape)} {str(self.dtype).replace('torch.', '')}"
        head += f"  ~{_fmt_seconds(self.cost)}"
        if not self.steps:
            return head + "\n  (no steps: the layouts already match)"
        return head + "".join(f"\n  {i}. {step}" for i, step in enumerate(self.steps, 1))

    def __repr__(self) -> str:
        return f"<BoxingPlan {self.src} -> {self.dst}, {len(self.steps)} steps, ~{_fmt_seconds(self.cost)}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(c))}</td>"
                for c in (
                    i,
                    s.op,
                    "-" if s.axis is None else s.axis,
                    s.src,
                    s.dst,
                    _fmt_bytes(s.bytes_per_rank),
                    _fmt_seconds(s.cost),
                )
            )
            + "</tr>"
            for i, s in enumerate(self.steps, 1)
        )
        title = html.escape(str(self).splitlines()[0])
        return (
            f"<div><b>{title}</b><table><tr><th>#</th><th>op</th><th>axis</th><th>from</th>"
            f"<th>to</th><th>bytes/rank</th><th>est.</th></tr>{rows}</table></div>"
        )

    def to_networkx(self) -> Any:
        """The searched graph of layouts (a ``networkx.DiGraph``; nodes are layouts).

        Every edge the search weighed carries ``weight`` (seconds), ``op``,
        ``step`` (a ``BoxingStep``) and ``chosen``: ``True`` on this plan's path.
        """
        if self.graph_factory is None:
            return None
        return self.graph_factory()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"
