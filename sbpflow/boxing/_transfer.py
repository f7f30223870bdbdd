"""Point-to-point transfers between placements: who sends which box to whom.

Pure geometry. Two kinds:
- *positional*: same mesh shape and same SBP; the rank at mesh coordinates
  ``c`` of the source sends its whole local tensor to the rank at ``c`` of the
  destination (works for partial layouts too).
- *region*: the source has no partial axis; every destination rank receives,
  from some source rank holding it, each part of the logical tensor it needs.
  Destination partial axes are filled on the first rank of each partial group
  (the others get zeros), so ``B``/``S`` -> ``P`` needs no extra step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .._layout import Box, Layout, box_numel, intersect
from ..sbp import Broadcast, Partial


@dataclass(frozen=True)
class Piece:
    src_rank: int
    dst_rank: int
    box: Box  # in logical coordinates


def is_positional(src: Layout, dst: Layout) -> bool:
    return src.placement.shape == dst.placement.shape and src.sbp == dst.sbp


def receives_data(dst: Layout, rank: int) -> bool:
    """False for destination ranks that only hold zeros (not first on a partial axis)."""
    coords = dst.placement.coords_of(rank)
    return all(c == 0 for c, s in zip(coords, dst.sbp) if isinstance(s, Partial))


def transfer_pieces(shape: Sequence[int], src: Layout, dst: Layout) -> list[Piece]:
    """Every piece that moves, in a deterministic order every rank computes alike."""
    if is_positional(src, dst):
        return [
            Piece(src.placement.rank_at(c), dst.placement.rank_at(c), src.box(shape, src.placement.rank_at(c)))
            for c in src.placement.all_coords()
        ]
    assert not src.has_partial, "region transfers need a source without partial axes"
    # Distinct source boxes and the ranks holding each (broadcast axes replicate).
    holders: dict[Box, list[int]] = {}
    for r in src.placement.flat_ranks:
        holders.setdefault(src.box(shape, r), []).append(r)
    dst_as_data = Layout(dst.placement, tuple(Broadcast() if isinstance(s, Partial) else s for s in dst.sbp))
    pieces = []
    for t_index, t in enumerate(dst.placement.flat_ranks):
        if not receives_data(dst, t):
            continue
        need = dst_as_data.box(shape, t)
        for box, ranks in holders.items():
            part = intersect(box, need)
            if part is None or box_numel(part) == 0:
                continue
            sender = t if t in ranks else ranks[t_index % len(ranks)]
            pieces.append(Piece(sender, t, part))
    return pieces


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
