"""Point-to-point transfers between placements: who sends which box to whom.

Pure geometry. Two kinds:
- *positional*: the two layouts hold the same pieces rank for rank when both
  meshes are read in flat (row-major) order: rank ``k`` of the source covers
  the same box as rank ``k`` of the destination, and the two layouts group
  the ranks into the same replicas and partial terms. Rank ``k`` of the source
  then sends its whole local tensor to rank ``k`` of the destination; this
  also moves partial layouts (``(P, P)`` on a 2x2 mesh -> ``P`` on four ranks).
- *region*: the source has no partial axis; every destination rank receives,
  from some source rank holding it, each part of the logical tensor it needs.
  Destination ``P(sum)`` axes are filled on the first rank of each partial
  group (the others get zeros), so ``B``/``S`` -> ``P`` needs no extra step;
  ``P(max)`` axes are filled on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .._layout import Box, Layout, box_at, box_numel, intersect
from ..sbp import Broadcast, Partial

__all__ = [
    "Piece",
    "busiest_rank_bytes",
    "clear_cache",
    "flat_boxes",
    "is_positional",
    "receives_data",
    "transfer_pieces",
]


@dataclass(frozen=True)
class Piece:
    src_rank: int
    dst_rank: int
    box: Box  # in logical coordinates


def is_positional(shape: Sequence[int], src: Layout, dst: Layout) -> bool:
    """Whether rank ``k`` of ``src`` can hand its local tensor, as it is, to rank ``k`` of ``dst``.

    Both layouts must cover the same box at every flat mesh position and split
    the positions into the same classes of identical data (same box, same
    partial term), with the same reduction: then both read the ranks' local
    tensors as the same logical tensor.
    """
    if src.placement.shape == dst.placement.shape and src.sbp == dst.sbp:
        return True
    if src.placement.num_ranks != dst.placement.num_ranks:
        return False
    if not src.has_partial and not dst.has_partial:
        return False  # a region transfer moves the same pieces
    if _reduce_ops(src) != _reduce_ops(dst):
        return False
    src_keys = _piece_keys(shape, src)
    dst_keys = _piece_keys(shape, dst)
    if any(a[0] != b[0] for a, b in zip(src_keys, dst_keys, strict=True)):
        return False
    # Same partition of positions into classes: the key pairs match one to one.
    pairs = set(zip(src_keys, dst_keys, strict=True))
    return len(pairs) == len(set(src_keys)) == len(set(dst_keys))


def _reduce_ops(layout: Layout) -> frozenset[str]:
    return frozenset(s.reduce_op for s in layout.sbp if isinstance(s, Partial))


def _piece_keys(shape: Sequence[int], layout: Layout) -> list[tuple[Box, tuple[int, ...]]]:
    """Per flat mesh position: its box and its partial term (coordinates on partial axes)."""
    pl, sbp = layout.placement, layout.sbp
    partial_axes = [a for a, s in enumerate(sbp) if isinstance(s, Partial)]
    boxes = flat_boxes(tuple(shape), layout)
    return [
        (box, tuple(coords[a] for a in partial_axes))
        for box, coords in zip(boxes, pl.all_coords(), strict=True)
    ]


@functools.lru_cache(maxsize=4096)
def flat_boxes(shape: tuple[int, ...], layout: Layout) -> tuple[Box, ...]:
    """The box of every rank of ``layout``, in flat mesh order (cached: planning asks often)."""
    pl = layout.placement
    return tuple(box_at(shape, pl, layout.sbp, coords) for coords in pl.all_coords())


def receives_data(dst: Layout, rank: int) -> bool:
    """False for destination ranks that only hold zeros (not first on a ``P(sum)`` axis)."""
    coords = dst.placement.coords_of(rank)
    return all(
        c == 0
        for c, s in zip(coords, dst.sbp, strict=True)
        if isinstance(s, Partial) and s.reduce_op == "sum"
    )


def transfer_pieces(shape: Sequence[int], src: Layout, dst: Layout) -> tuple[Piece, ...]:
    """Every piece that moves, in a deterministic order every rank computes alike (cached)."""
    return _pieces(tuple(int(n) for n in shape), src, dst)


@functools.lru_cache(maxsize=8192)
def _pieces(shape: tuple[int, ...], src: Layout, dst: Layout) -> tuple[Piece, ...]:
    src_boxes = flat_boxes(shape, src)
    if is_positional(shape, src, dst):
        moves = zip(src.placement.flat_ranks, dst.placement.flat_ranks, src_boxes, strict=True)
        return tuple(Piece(s, d, box) for s, d, box in moves if box_numel(box) > 0)
    assert not src.has_partial, "region transfers need a source without partial axes"
    # Distinct source boxes and the ranks holding each (broadcast axes replicate).
    holders: dict[Box, list[int]] = {}
    for r, box in zip(src.placement.flat_ranks, src_boxes, strict=True):
        if box_numel(box) > 0:
            holders.setdefault(box, []).append(r)
    dst_as_data = Layout(
        dst.placement, tuple(Broadcast() if isinstance(s, Partial) else s for s in dst.sbp)
    )
    summed = [a for a, s in enumerate(dst.sbp) if isinstance(s, Partial) and s.reduce_op == "sum"]
    pieces = []
    targets = zip(
        dst.placement.flat_ranks,
        dst.placement.all_coords(),
        flat_boxes(shape, dst_as_data),
        strict=True,
    )
    for t_index, (t, coords, need) in enumerate(targets):
        if any(coords[a] != 0 for a in summed):
            continue  # see receives_data
        for box, ranks in holders.items():
            part = intersect(box, need)
            if part is None or box_numel(part) == 0:
                continue
            sender = t if t in ranks else ranks[t_index % len(ranks)]
            pieces.append(Piece(sender, t, part))
    return tuple(pieces)


def busiest_rank_bytes(pieces: Sequence[Piece], itemsize: int) -> tuple[int, int]:
    """``(bytes, messages)`` of the rank that sends or receives the most (self-copies free)."""
    load: dict[int, int] = {}
    count: dict[int, int] = {}
    for p in pieces:
        if p.src_rank == p.dst_rank:
            continue
        nbytes = box_numel(p.box) * itemsize
        for r in (p.src_rank, p.dst_rank):
            load[r] = load.get(r, 0) + nbytes
            count[r] = count.get(r, 0) + 1
    if not load:
        return 0, 0
    busiest = max(load, key=lambda r: load[r])
    return load[busiest], count[busiest]


def clear_cache() -> None:
    """Forget cached boxes and pieces."""
    flat_boxes.cache_clear()
    _pieces.cache_clear()
