"""Shard geometry: which slice of the logical tensor each rank holds.

Pure code: ``(shape, placement, sbp, rank) -> local slice``. No process group.

# NOTE [balanced split]
# A length ``n`` split over ``p`` ranks gives the first ``n % p`` ranks
# ``n // p + 1`` elements and the rest ``n // p`` (13 over 4 -> 4,3,3,3).
# On an N-D mesh the axes split in order: axis 0 cuts the logical tensor,
# axis 1 cuts each axis-0 piece again, and so on. A partial or broadcast axis
# leaves the box as it is (every rank of that axis "covers" the whole box).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .placement import Placement
from .sbp import Broadcast, NdSbp, Partial, Split, normalize, sbp_str

Box = tuple[tuple[int, int], ...]  # (start, stop) per tensor dim


def balanced_sizes(length: int, num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` balanced pieces of ``length`` (first ones one larger)."""
    base, extra = divmod(length, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def balanced_range(length: int, num_parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``index`` of a balanced split."""
    base, extra = divmod(length, num_parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class Layout:
    """A placement and an N-D SBP: how a logical tensor is spread over ranks."""

    placement: Placement
    sbp: NdSbp

    def __post_init__(self) -> None:
        object.__setattr__(self, "sbp", normalize(self.sbp, self.placement.ndim))

    def __str__(self) -> str:
        return sbp_str(self.sbp)

    def describe(self) -> str:
        return f"{sbp_str(self.sbp)} on {self.placement}"

    @property
    def has_partial(self) -> bool:
        return any(isinstance(s, Partial) for s in self.sbp)

    def box(self, shape: Sequence[int], rank: int) -> Box:
        """The region of the logical tensor that ``rank``'s local tensor covers."""
        return box_at(shape, self.placement, self.sbp, self.placement.coords_of(rank))

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        if rank not in self.placement:
            return empty_local_shape(len(shape))
        return tuple(stop - start for start, stop in self.box(shape, rank))

    def without_partial(self) -> Layout:
        """The same layout with partial axes written as broadcast."""
        return Layout(
            self.placement, tuple(Broadcast() if isinstance(s, Partial) else s for s in self.sbp)
        )

    def normalized(self) -> Layout:
        """The same layout with size-1 mesh axes written as broadcast.

        On a mesh axis of one rank every SBP means the same thing, so plans
        compare layouts in this form.
        """
        sbp = tuple(
            Broadcast() if size == 1 else s
            for size, s in zip(self.placement.shape, self.sbp, strict=True)
        )
        return Layout(self.placement, sbp)


def box_at(shape: Sequence[int], placement: Placement, sbp: NdSbp, coords: Sequence[int]) -> Box:
    bounds = [(0, n) for n in shape]
    for axis, s in enumerate(sbp):
        if isinstance(s, Split):
            start, stop = bounds[s.dim]
            lo, hi = balanced_range(stop - start, placement.shape[axis], coords[axis])
            bounds[s.dim] = (start + lo, start + hi)
    return tuple(bounds)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    numel = 1
    for start, stop in box:
        numel *= stop - start
    return numel


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that cut ``inner`` out of a tensor covering ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def dual_sbp(sbp: NdSbp) -> NdSbp:
    """The layout a gradient crosses the local/global boundary in (NOTE [gradient duals] in
    sbpflow/tensor.py): split stays split, broadcast reads as partial sum and back."""
    return tuple(
        Partial("sum") if isinstance(s, Broadcast) else Broadcast() if isinstance(s, Partial) else s
        for s in sbp
    )


def empty_local_shape(ndim: int) -> tuple[int, ...]:
    """Shape of the (empty) local tensor of a rank outside the placement."""
    return (0,) * max(ndim, 1)


def member_sizes(
    shape: Sequence[int], layout: Layout, members: Sequence[int], dim: int
) -> list[int]:
    """Length along ``dim`` of each member rank's box, in member order.

    Taken from each member's own box, not from a flat balanced split of the
    group's block: nested splits over several mesh axes give other sizes.
    """
    return [stop - start for start, stop in (layout.box(shape, r)[dim] for r in members)]


def logical_shape_from_locals(
    local_shapes: dict[int, tuple[int, ...]], placement: Placement, sbp: NdSbp
) -> tuple[int, ...]:
    """Infer the logical shape from the ranks' local shapes, checking the balanced rule.

    Raises ``ValueError`` naming the offending ranks when the local shapes
    cannot come from one logical tensor laid out as ``sbp``.
    """
    first = local_shapes[placement.flat_ranks[0]]
    ndim = len(first)
    for r in placement.flat_ranks:
        if len(local_shapes[r]) != ndim:
            raise ValueError(
                f"ranks pass local tensors of different ndim to to_global: rank "
                f"{placement.flat_ranks[0]} has shape {list(first)}, rank {r} has "
                f"{list(local_shapes[r])}. Every rank must pass a piece of the same logical tensor."
            )
    shape = list(first)
    split_dims = {s.dim for s in sbp if isinstance(s, Split)}
    for dim in split_dims:
        # Sum the pieces along every split axis that cuts this dim, walking the mesh.
        shape[dim] = _logical_length(local_shapes, placement, sbp, dim)
    expected_shape = tuple(shape)
    for r in placement.flat_ranks:
        expected = tuple(
            stop - start
            for start, stop in box_at(expected_shape, placement, sbp, placement.coords_of(r))
        )
        if tuple(local_shapes[r]) != expected:
            got = {q: list(local_shapes[q]) for q in placement.flat_ranks}
            raise ValueError(
                f"local shapes {got} do not form one logical tensor with SBP {sbp_str(sbp)} on "
                f"{placement}: rank {r} passed shape {list(local_shapes[r])}, expected "
                f"{list(expected)}. {_shape_rule(sbp, expected_shape, placement.flat_ranks[0])}"
            )
    return expected_shape


def _shape_rule(sbp: NdSbp, logical: tuple[int, ...], first_rank: int) -> str:
    """What the ranks' local shapes must be for ``sbp``, for an error message."""
    if not any(isinstance(s, Split) for s in sbp):
        return (
            f"With SBP {sbp_str(sbp)} every rank passes the whole tensor (broadcast sends the "
            "first rank's data, partial_sum adds the ranks' tensors), so every rank passes the "
            f"same shape; the first rank, {first_rank}, passed {list(logical)}. Pass tensors "
            "of one shape on every rank."
        )
    return (
        f"Along a split dim the pieces follow the balanced rule (the first n % p ranks hold "
        f"one extra element; these pieces make a logical {list(logical)}); every other dim, "
        "and every rank along a broadcast or partial axis, has the same size. Pass pieces cut "
        "by the balanced rule, or of equal shape."
    )


def _logical_length(
    local_shapes: dict[int, tuple[int, ...]], placement: Placement, sbp: NdSbp, dim: int
) -> int:
    # The axes that split `dim`, in order; sum local lengths over one rank per
    # combination of their coordinates (other axes fixed at 0).
    split_axes = [a for a, s in enumerate(sbp) if isinstance(s, Split) and s.dim == dim]
    total = 0
    for coords in placement.all_coords():
        if all(coords[a] == 0 for a in range(placement.ndim) if a not in split_axes):
            total += local_shapes[placement.rank_at(coords)][dim]
    return total


def partial_piece(local: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``local`` as ``rank``'s part of a partial layout holding it once.

    On a partial axis the group's first rank keeps the value and the others hold
    the reduction's identity: zeros for a sum, the lowest value for a max (zeros
    would turn negative entries of a partial_max tensor into 0).
    """
    coords = layout.placement.coords_of(rank)
    for c, s in zip(coords, layout.sbp, strict=True):
        if isinstance(s, Partial) and c != 0:
            return torch.full_like(local, s.identity(local.dtype))
    return local


def local_piece(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """This rank's piece of a logical tensor that every rank holds whole."""
    box = layout.box(tuple(full.shape), rank)
    return partial_piece(full[tuple(slice(a, b) for a, b in box)], layout, rank)
