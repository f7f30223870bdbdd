"""Matrix products: mm, addmm, bmm, baddbmm, mv, addmv, dot (``matmul``/``linear`` decompose
into these and views before they reach dispatch).

# NOTE [matmul rules]
# For ``a [m, k] @ b [k, n]`` on one mesh axis:
#   (S(0), B)    -> S(0)   rows of a split: each rank computes its rows
#   (B, S(1))    -> S(1)   columns of b split: each rank computes its columns
#   (S(1), S(0)) -> P      the contracted dim split: partial products sum up
#   (P, B), (B, P) -> P    a product is linear in each factor
#   (B, B)       -> B
# Batched products add (S(0), S(0)) -> S(0) on the batch dim and shift the
# rest by one. ``addmm``-style ops take the added tensor split like the output
# (or broadcast where it is broadcast), and P where the product is P, since
# ``beta * c + alpha * a @ b`` is linear in (c, a, b) jointly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..sbp import Broadcast, Partial, SbpParallel, Split
from ._registry import OpInfo, Strategy, TensorMeta, register

__all__ = ["product_strategies"]

aten = torch.ops.aten

B, P = Broadcast(), Partial()
Table = Sequence[tuple[SbpParallel, ...]]
# (a, b, out) per strategy for each product family; all-broadcast comes last.
_MM: list[tuple[SbpParallel, SbpParallel, SbpParallel]] = [
    (Split(0), B, Split(0)),
    (B, Split(1), Split(1)),
    (Split(1), Split(0), P),
    (P, B, P),
    (B, P, P),
    (B, B, B),
]
_MV: list[tuple[SbpParallel, SbpParallel, SbpParallel]] = [
    (Split(0), B, Split(0)),
    (Split(1), Split(0), P),
    (P, B, P),
    (B, P, P),
    (B, B, B),
]
_DOT: list[tuple[SbpParallel, SbpParallel, SbpParallel]] = [
    (Split(0), Split(0), P),
    (P, B, P),
    (B, P, P),
    (B, B, B),
]


def _shifted(table: Sequence[tuple[SbpParallel, ...]]) -> list[tuple[SbpParallel, ...]]:
    """The 2-D table with every split moved one dim right, for a leading batch dim."""

    def shift(s: SbpParallel) -> SbpParallel:
        return Split(s.dim + 1) if isinstance(s, Split) else s

    return [tuple(shift(s) for s in row) for row in table]


_BMM: list[tuple[SbpParallel, ...]] = [(Split(0), Split(0), Split(0)), *_shifted(_MM)]


def _added_sbp(added: TensorMeta, out: TensorMeta, out_sbp: SbpParallel) -> SbpParallel:
    """How the added tensor of ``addmm``-style ops is laid out for an output SBP."""
    if isinstance(out_sbp, Split):
        d = out_sbp.dim - (out.ndim - added.ndim)
        if d < 0 or (added.shape[d] == 1 and out.shape[out_sbp.dim] != 1):
            return B  # broadcast along the split dim: every rank needs all of it
        return Split(d)
    return out_sbp


def product_strategies(info: OpInfo, table: Table, added: int | None = None) -> list[Strategy]:
    """Strategies from a (a, b, out) table; ``added`` is the input index of ``c`` in
    ``beta * c + alpha * a @ b`` (it comes first), or None for a plain product."""
    out = info.outputs[0]
    strategies = []
    for a, b, o in table:
        if isinstance(o, Split) and out.shape[o.dim] < 1:
            continue
        ins: tuple[SbpParallel, ...] = (a, b)
        if added is not None:
            ins = (_added_sbp(info.inputs[0], out, o), a, b)
        strategies.append(Strategy(ins, (o,)))
    return strategies


def _rule(table: Table, with_added: bool) -> Callable[[OpInfo], list[Strategy]]:
    def rule(info: OpInfo) -> list[Strategy]:
        if not with_added:
            return product_strategies(info, table)
        if info.input_at(0) is not None:
            return product_strategies(info, table, added=0)
        # The added operand is a plain 0-dim tensor: every rank would add it, so no P.
        return product_strategies(info, [row for row in table if not isinstance(row[2], Partial)])

    return rule


register(aten.mm, family="matmul")(_rule(_MM, False))
register(aten.addmm, aten.addmm_, family="matmul")(_rule(_MM, True))
register(aten.bmm, family="matmul")(_rule(_BMM, False))
register(aten.baddbmm, aten.baddbmm_, family="matmul")(_rule(_BMM, True))
register(aten.mv, family="matmul")(_rule(_MV, False))
register(aten.addmv, aten.addmv_, family="matmul")(_rule(_MV, True))
register(aten.dot, aten.vdot, family="matmul")(_rule(_DOT, False))


@register(aten.t, family="matmul")
def transpose_2d(info: OpInfo) -> list[Strategy]:
    """``t`` (needed by every matmul backward) takes any layout: split dims swap."""
    s, ndim = info.current[0], info.inputs[0].ndim
    return [Strategy((s,), (Split(ndim - 1 - s.dim) if isinstance(s, Split) else s,))]
