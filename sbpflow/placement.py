"""Placements: a device type and an N-D mesh of ranks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Placement", "placement"]

_DEVICE_TYPES = ("cpu", "cuda")


def _to_nested_tuple(ranks: Any) -> tuple[Any, ...]:
    if hasattr(ranks, "tolist"):  # torch.Tensor / numpy array
        ranks = ranks.tolist()
    if isinstance(ranks, int):
        return (ranks,)
    if isinstance(ranks, range):
        return tuple(ranks)
    if not isinstance(ranks, (list, tuple)):
        raise TypeError(
            f"placement ranks must be a (nested) list of ints, got {type(ranks).__name__}: "
            f"{ranks!r}. Write e.g. ranks=[0, 1, 2, 3] or ranks=[[0, 1], [2, 3]]."
        )
    return tuple(_to_nested_tuple(r) if not isinstance(r, int) else r for r in ranks)


def _mesh_shape(ranks: tuple[Any, ...]) -> tuple[int, ...]:
    if all(isinstance(r, int) for r in ranks):
        return (len(ranks),)
    if any(isinstance(r, int) for r in ranks):
        raise ValueError(
            f"placement ranks mix ints and lists at one level: {ranks!r}. "
            "Every row of the mesh must have the same nesting, e.g. [[0, 1], [2, 3]]."
        )
    sub_shapes = {_mesh_shape(r) for r in ranks}
    if len(sub_shapes) != 1:
        raise ValueError(
            f"placement ranks are ragged: rows have shapes {sorted(sub_shapes)} in {ranks!r}. "
            "Every row of the mesh must have the same length."
        )
    return (len(ranks), *sub_shapes.pop())


def _flatten(ranks: tuple[Any, ...]) -> Iterator[int]:
    for r in ranks:
        if isinstance(r, tuple):
            yield from _flatten(r)
        else:
            yield r


@dataclass(frozen=True)
class Placement:
    """Where a global tensor lives: a device type and an N-D mesh of ranks.

    ``Placement("cpu", [0, 1, 2, 3])`` is a 1-D mesh of four ranks,
    ``Placement("cuda", [[0, 1], [2, 3]])`` a 2x2 mesh. The rank order is kept
    exactly as written: mesh position ``(i, j)`` holds ``ranks[i][j]``.
    """

    type: str
    ranks: tuple[Any, ...]
    shape: tuple[int, ...] = field(init=False, compare=False, repr=False)
    flat_ranks: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __init__(self, type: str, ranks: Any) -> None:
        if not isinstance(type, str) or type not in _DEVICE_TYPES:
            raise ValueError(
                f"placement type must be one of {_DEVICE_TYPES}, got {type!r}. "
                'Use sbpflow.placement("cpu", ranks) with gloo or "cuda" with NCCL.'
            )
        nested = _to_nested_tuple(ranks)
        if len(nested) == 0:
            raise ValueError("placement ranks are empty; give at least one rank, e.g. ranks=[0].")
        shape = _mesh_shape(nested)
        flat = tuple(_flatten(nested))
        for r in flat:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(
                    f"placement ranks must be non-negative ints, got {r!r} in {ranks!r}."
                )
        if len(set(flat)) != len(flat):
            dupes = sorted({r for r in flat if flat.count(r) > 1})
            raise ValueError(
                f"placement ranks repeat {dupes} in {ranks!r}; each rank may appear once."
            )
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "ranks", nested)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "flat_ranks", flat)

    # -- geometry -----------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.shape)

    @property
    def num_ranks(self) -> int:
        return len(self.flat_ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self.flat_ranks

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of ``rank``; raises ``ValueError`` if it is not in the mesh."""
        try:
            index = self.flat_ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in {self}") from None
        coords = []
        for size in reversed(self.shape):
            coords.append(index % size)
            index //= size
        return tuple(reversed(coords))

    def rank_at(self, coords: Sequence[int]) -> int:
        index = 0
        for c, size in zip(coords, self.shape, strict=True):
            index = index * size + c
        return self.flat_ranks[index]

    def all_coords(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(s) for s in self.shape))

    def group_along(self, axis: int, rank: int) -> tuple[int, ...]:
        """The ranks that share every mesh coordinate of ``rank`` except ``axis``, in mesh order."""
        coords = list(self.coords_of(rank))
        group = []
        for i in range(self.shape[axis]):
            coords[axis] = i
            group.append(self.rank_at(coords))
        return tuple(group)

    def groups_along(self, axes: Sequence[int]) -> list[tuple[int, ...]]:
        """Every group of ranks that varies only along ``axes`` (in mesh order, axes row-major)."""
        axes = sorted(axes)
        other = [a for a in range(self.ndim) if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(self.shape[a]) for a in other)):
            group = []
            for moving in itertools.product(*(range(self.shape[a]) for a in axes)):
                coords = [0] * self.ndim
                for a, c in zip(other, fixed, strict=True):
                    coords[a] = c
                for a, c in zip(axes, moving, strict=True):
                    coords[a] = c
                group.append(self.rank_at(coords))
            groups.append(tuple(group))
        return groups

    # -- printing -----------------------------------------------------------------
    def __str__(self) -> str:
        return f"placement({self.type!r}, {_ranks_str(self.ranks)})"

    __repr__ = __str__  # NOTE [one printed form] in sbp.py


def _ranks_str(ranks: tuple[Any, ...]) -> str:
    return "[" + ", ".join(_ranks_str(r) if isinstance(r, tuple) else str(r) for r in ranks) + "]"


placement = Placement
