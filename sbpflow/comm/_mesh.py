"""A placement's process groups, owned by one object per placement (DTensor's ``DeviceMesh``).

# NOTE [meshes]
# A ``Mesh`` creates the process groups of its placement when it is made, as
# DTensor's ``DeviceMesh`` does: the groups along each axis, and the group of
# the whole mesh (for two or more axes). It keeps this rank's group of each.
# A set of axes is a group it made when, leaving out axes of one rank, it is
# one axis or every axis: so on a mesh of at most two axes of more than one rank
# every set of axes has its group, and on a larger one the boxing planner merges
# a step over every axis or none (NOTE [merged axes] in boxing/planner.py), and a
# reduction over some of the axes runs one per axis (``Mesh.lines``).
# ``MESHES.of(placement, entry)`` makes it the first time a placement
# enters the program, at a point every rank reaches, member or not (creating a
# group is a collective over the world: NOTE [group creation order] in
# _groups.py): a local tensor converted onto it (``to_global``), a factory
# building on it, boxing or a device move onto it, data-parallel buckets or
# ``fully_shard`` on it. After that an op only looks its groups up: the
# boxing executor and the collectives the rules' local functions run through
# it find them made. The dispatcher still asks for its op's placement (a
# dictionary lookup) so that a placement no entry point announced gets its
# groups on every rank before a rank sits the op out; each mesh records the
# entry that made it, and tests/dist/test_meshes.py checks that a training
# step's placements were all made at their entry points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ._groups import group_of
from ._world import get_rank, on_teardown

__all__ = ["MESHES", "Mesh", "Meshes"]

Group = tuple[tuple[int, ...], dist.ProcessGroup | None]


class Mesh:
    """The process groups of ``placement``: along each axis and over the whole mesh."""

    def __init__(self, placement: Any, rank: int, entry: str) -> None:
        self.placement = placement
        self.entry = entry  # what made it (NOTE [meshes])
        self._mine: dict[tuple[int, ...], Group] = {}
        ndim = placement.ndim
        made = [(axis,) for axis in range(ndim)] + ([tuple(range(ndim))] if ndim > 1 else [])
        for axes in made:
            found = group_of(placement.type, placement.groups_along(axes), rank)
            if found is not None:
                self._mine[axes] = found

    def made(self, axes: Sequence[int]) -> tuple[int, ...] | None:
        """The key of the group this mesh made for the ranks along ``axes`` (non-empty), or
        None when it made none: two or more axes of more than one rank, not all of them."""
        shape = self.placement.shape
        moving = _moving(shape, axes)
        if not moving:
            return (min(axes),)  # a group of one rank, as along that axis
        if len(moving) == 1:
            return moving
        if moving == _moving(shape, range(len(shape))):
            return tuple(range(len(shape)))
        return None

    def group(self, axes: Sequence[int]) -> Group | None:
        """This rank's group along ``axes`` (its ranks and handle; the handle is None for a
        group of one rank), or None on a rank outside the placement. ``axes`` must leave out
        no axis of more than one rank, or hold one (``made``); ``lines`` covers the rest."""
        made = self.made(axes)
        if made is None:
            raise AssertionError(
                f"no group along axes {tuple(axes)} of {self.placement}: a mesh makes one per "
                "axis and one of the whole mesh (NOTE [meshes]); reduce along each axis in turn"
            )
        return self._mine.get(made)

    def lines(self, axes: Sequence[int]) -> list[tuple[tuple[int, ...], Group]]:
        """This rank's groups whose collectives, one after another, reduce or broadcast along
        ``axes``, each with its axes: the group along them if the mesh made one, else one
        group per axis of more than one rank (an all_reduce along each axis in turn is the
        all_reduce along all of them; a broadcast from each axis's first rank in turn, the
        broadcast from the first rank along all of them). Empty outside the placement."""
        made = self.made(axes)
        keys = [made] if made is not None else [(a,) for a in _moving(self.placement.shape, axes)]
        return [(k, self._mine[k]) for k in keys if k in self._mine]


def _moving(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """The axes of more than one rank among ``axes``, ascending."""
    return tuple(a for a in sorted(set(axes)) if shape[a] > 1)


class Meshes:
    """Every placement's ``Mesh``, made once (NOTE [meshes])."""

    def __init__(self) -> None:
        self._by_placement: dict[Any, Mesh] = {}

    def of(self, placement: Any, entry: str) -> Mesh:
        """``placement``'s mesh, made now (by every rank) if this is its first entry."""
        mesh = self._by_placement.get(placement)
        if mesh is None:
            mesh = self._by_placement[placement] = Mesh(placement, get_rank(), entry)
        return mesh

    def entries(self) -> dict[Any, str]:
        """Each placement with a mesh, and the entry that made it."""
        return {placement: mesh.entry for placement, mesh in self._by_placement.items()}

    def forget(self) -> None:
        """Drop every mesh, so that their groups are freed now (NOTE [teardown] in _world)."""
        self._by_placement.clear()


MESHES = Meshes()
on_teardown(MESHES.forget)
