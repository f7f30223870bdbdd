"""Single boxing steps: which exist from a layout, what they turn it into, what they cost.

Pure code, shared by the planner's search and by tests that search on their
own. The rules are NOTE [one-axis transitions] and NOTE [merged axes] in
planner.py.

The search looks at thousands of states and builds no ``Layout`` for them: a
state is a tuple of small ints, each the index of an SBP value in a
``Values`` table (hashing and comparing those is what the search does most).
``collective_edge`` is the same rule on ordinary SBP tuples.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from .._layout import Layout, box_at, box_numel
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Partial, SbpParallel, Split
from . import cost as _cost
from ._transfer import busiest_rank_bytes, is_positional, transfer_pieces

__all__ = [
    "Edge",
    "Values",
    "axis_groups",
    "candidate_values",
    "coded_edges",
    "collective_edge",
    "states",
    "transfer_edge",
]

# (op, axes, bytes sent by the busiest rank, estimated seconds, new sbp)
Edge = tuple[str, tuple[int, ...], int, float, NdSbp]
Codes = tuple[int, ...]
_BROADCAST, _PARTIAL, _SPLIT = 0, 1, 2


def candidate_values(tensor_ndim: int, extra: Sequence[SbpParallel] = ()) -> list[SbpParallel]:
    """The one-axis values the search tries: B, P, every S(d), and any other value in ``extra``."""
    values: list[SbpParallel] = [Broadcast(), Partial("sum")] + [
        Split(d) for d in range(tensor_ndim)
    ]
    for s in extra:
        if s not in values:
            values.append(s)
    return values


class Values:
    """The SBP values of one search, numbered; ``values[0]`` is B (see ``candidate_values``)."""

    def __init__(self, values: Sequence[SbpParallel]) -> None:
        assert isinstance(values[0], Broadcast) and len(set(values)) == len(values)
        self.values = tuple(values)
        self.kinds = tuple(
            _SPLIT if isinstance(v, Split) else _PARTIAL if isinstance(v, Partial) else _BROADCAST
            for v in values
        )
        self.dims = tuple(v.dim if isinstance(v, Split) else -1 for v in values)
        self.reduce_ops = tuple(v.reduce_op if isinstance(v, Partial) else "" for v in values)
        self.index = {v: k for k, v in enumerate(values)}

    def encode(self, sbp: NdSbp) -> Codes:
        return tuple(self.index[s] for s in sbp)

    def decode(self, codes: Codes) -> NdSbp:
        return tuple(self.values[c] for c in codes)

    def reductions(self, codes: Codes) -> set[str]:
        return {self.reduce_ops[c] for c in codes if self.kinds[c] == _PARTIAL}


def axis_groups(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The sets of mesh axes a step runs on: each axis with more than one rank, then all of
    them together (the groups a mesh makes: NOTE [meshes] in comm/_mesh.py)."""
    axes = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    return [(a,) for a in axes] + ([axes] if len(axes) > 1 else [])


def states(mesh_shape: Sequence[int], values: Sequence[SbpParallel]) -> list[NdSbp]:
    """Every N-D SBP on a mesh (size-1 axes written as B) that mixes no two reductions."""
    per_axis = [values if n > 1 else [Broadcast()] for n in mesh_shape]
    return [sbp for sbp in itertools.product(*per_axis) if _one_reduction(sbp)]


def _one_reduction(sbp: NdSbp) -> bool:
    ops = {s.reduce_op for s in sbp if isinstance(s, Partial)}
    return len(ops) <= 1


def collective_edge(
    shape: Sequence[int],
    itemsize: int,
    placement: Placement,
    sbp: NdSbp,
    axes: tuple[int, ...],
    value: SbpParallel,
    model: _cost.CostModel,
) -> Edge | None:
    """The step that sets every axis in ``axes`` of ``sbp`` to ``value``; ``None`` if none is direct.

    ``axes`` (ascending) must all hold the same value now; the step runs on the
    groups of ranks that vary only along them (see NOTE [merged axes]).
    """
    table = Values(candidate_values(len(shape), (*tuple(sbp), value)))
    wanted = table.encode((value,))[0]
    for k, op, sent, cost, codes in coded_edges(
        shape, itemsize, placement, table.encode(sbp), axes, table, model
    ):
        if k == wanted:
            return op, axes, sent, cost, table.decode(codes)
    return None


def coded_edges(
    shape: Sequence[int],
    itemsize: int,
    placement: Placement,
    codes: Codes,
    axes: tuple[int, ...],
    table: Values,
    model: _cost.CostModel,
    blocks: dict[Codes, int] | None = None,
) -> Iterator[tuple[int, str, int, float, Codes]]:
    """Every step on the groups along ``axes`` from the state ``codes``.

    Yields ``(value index, op, bytes sent, cost, new codes)``, one per value the
    axes can go to directly. ``blocks`` caches block sizes across one search.
    """
    current = codes[axes[0]]
    for a in axes[1:]:
        if codes[a] != current:
            return
    kinds, dims, reduce_ops = table.kinds, table.dims, table.reduce_ops
    # Dims split by axes after the group's first one that are not in it: a
    # step touching one of them is not a group collective (NOTE [one-axis transitions]).
    first = axes[0]
    cut_inside = {
        dims[c] for b, c in enumerate(codes) if b > first and kinds[c] == _SPLIT and b not in axes
    }
    if kinds[current] == _SPLIT and dims[current] in cut_inside:
        return
    other_reductions = {
        reduce_ops[c] for b, c in enumerate(codes) if kinds[c] == _PARTIAL and b not in axes
    }
    block_codes = tuple(0 if a in axes else c for a, c in enumerate(codes))
    block = None if blocks is None else blocks.get(block_codes)
    if block is None:
        block_sbp = table.decode(block_codes)
        block = box_numel(box_at(shape, placement, block_sbp, (0,) * len(codes))) * itemsize
        if blocks is not None:
            blocks[block_codes] = block
    p = 1
    for a in axes:
        p *= placement.shape[a]
    kind_from = kinds[current]
    for k, kind_to in enumerate(kinds):
        if k == current:
            continue
        if kind_to == _SPLIT and dims[k] in cut_inside:
            continue
        if kind_to == _PARTIAL and other_reductions - {reduce_ops[k]}:
            continue  # one layout reduces one way only
        found = _transition(kind_from, kind_to, p, block, model)
        if found is None:
            continue
        op, cost, sent = found
        yield k, op, int(sent), cost, tuple(k if a in axes else c for a, c in enumerate(codes))


def _transition(
    kind_from: int, kind_to: int, p: int, block: float, model: _cost.CostModel
) -> tuple[str, float, float] | None:
    """The table of NOTE [one-axis transitions]: ``(op, cost, bytes sent)`` over ``p`` ranks."""
    if kind_from == _SPLIT and kind_to == _BROADCAST:
        return "all_gather", model.all_gather(p, block), (p - 1) / p * block
    if kind_from == _PARTIAL and kind_to == _BROADCAST:
        return "all_reduce", model.all_reduce(p, block), 2 * (p - 1) / p * block
    if kind_from == _PARTIAL and kind_to == _SPLIT:
        return "reduce_scatter", model.reduce_scatter(p, block), (p - 1) / p * block
    if kind_from == _SPLIT and kind_to == _SPLIT:
        return "all_to_all", model.all_to_all(p, block), (p - 1) / (p * p) * block
    if kind_from == _BROADCAST and kind_to == _SPLIT:
        return "slice", model.local(0), 0
    if kind_to == _PARTIAL and kind_from != _PARTIAL:
        return "zero", model.local(block), 0
    return None  # P(sum) <-> P(max): no direct step


def transfer_edge(
    shape: Sequence[int], itemsize: int, src: Layout, dst: Layout, model: _cost.CostModel
) -> Edge | None:
    """Point-to-point step from ``src`` to ``dst`` on another placement; ``None`` if none is direct.

    A source with a partial axis moves only positionally (see _transfer.py).
    The op is ``copy`` when every piece stays on its rank.
    """
    positional = is_positional(shape, src, dst)
    if src.has_partial and not positional:
        return None
    pieces = transfer_pieces(shape, src, dst)
    nbytes, messages = busiest_rank_bytes(pieces, itemsize)
    local_bytes = box_numel(dst.box(shape, dst.placement.flat_ranks[0])) * itemsize
    if messages == 0:
        op, cost = "copy", model.local(local_bytes)
    else:
        op, cost = "send_recv", model.send_recv(messages, nbytes)
        if dst.has_partial and not positional:
            cost += model.local(local_bytes)  # the zero fill of the other partial ranks
    return op, (), nbytes, cost, dst.sbp
