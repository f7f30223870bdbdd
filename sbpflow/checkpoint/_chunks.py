"""Which chunk of a global tensor each rank writes to a checkpoint, and which it reads back.

Pure code: ``(layout, logical shape, rank) -> chunk``. No process group.

# NOTE [checkpoint chunks]
# A checkpoint stores every tensor as chunks of the logical tensor: boxes
# given by offsets and sizes, as ``torch.distributed.checkpoint`` (DCP) lays
# out a sharded tensor. A layout with no partial axis gives each rank one box
# (NOTE [balanced split] in _layout.py), so
#   - saving: a partial axis is first boxed to a split (reduce_scatter), or to
#     broadcast for a 0-d tensor (all_reduce); then each box is written by
#     one rank: the one at coordinate 0 on every broadcast axis. Empty boxes
#     are not written; a tensor with no elements is written once, by the
#     placement's first rank, so its entry still exists.
#   - loading: a partial axis is read as broadcast (every rank of the axis
#     reads the whole box) and then boxed to partial locally (the first rank
#     keeps the value, the others hold zeros): no collective.
# DCP reads each rank's box from whichever saved chunks overlap it, so a
# checkpoint loads into any placement, SBP and world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._layout import Layout
from ..sbp import Broadcast, NdSbp, Partial, SbpParallel, Split

__all__ = ["Chunk", "read_chunk", "readable_sbp", "storable_sbp", "write_chunk"]


@dataclass(frozen=True)
class Chunk:
    """A box of a logical tensor: where it starts and how long it is along each dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def storable_sbp(sbp: NdSbp, shape: Sequence[int]) -> NdSbp:
    """``sbp`` with every partial axis turned into a split of dim 0 (broadcast for 0-d)."""
    stored: SbpParallel = Split(0) if len(shape) > 0 else Broadcast()
    return tuple(stored if isinstance(s, Partial) else s for s in sbp)


def readable_sbp(sbp: NdSbp) -> NdSbp:
    """``sbp`` with every partial axis read as broadcast (NOTE [checkpoint chunks])."""
    return tuple(Broadcast() if isinstance(s, Partial) else s for s in sbp)


def _box_chunk(layout: Layout, shape: Sequence[int], rank: int) -> Chunk:
    box = layout.box(shape, rank)
    return Chunk(tuple(start for start, _ in box), tuple(stop - start for start, stop in box))


def write_chunk(layout: Layout, shape: Sequence[int], rank: int) -> Chunk | None:
    """The chunk ``rank`` writes for a tensor of ``layout`` (no partial axis), or None."""
    assert not layout.has_partial, "box partial axes away before saving"
    placement = layout.placement
    if rank not in placement:
        return None
    coords = placement.coords_of(rank)
    if math.prod(shape) == 0:
        return _box_chunk(layout, shape, rank) if not any(coords) else None
    replica = any(
        c != 0 for c, s in zip(coords, layout.sbp, strict=True) if not isinstance(s, Split)
    )
    chunk = _box_chunk(layout, shape, rank)
    if replica or 0 in chunk.sizes:
        return None
    return chunk


def read_chunk(layout: Layout, shape: Sequence[int], rank: int) -> Chunk | None:
    """The chunk ``rank`` reads for a tensor of ``layout`` (no partial axis), or None."""
    assert not layout.has_partial, "read partial axes as broadcast"
    if rank not in layout.placement:
        return None
    chunk = _box_chunk(layout, shape, rank)
    return None if 0 in chunk.sizes else chunk
