"""A placement's process groups, owned by one object per placement (DTensor's ``DeviceMesh``).

# NOTE [meshes]
# A ``Mesh`` creates the process groups of its placement, along every set of
# its axes, all at once, when it is made, and keeps this rank's group per set
# of axes. ``MESHES.of(placement, entry)`` makes it the first time a placement
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

import itertools
from typing import Any

import torch.distributed as dist

from ._groups import group_of
from ._world import get_rank, on_teardown

__all__ = ["MESHES", "Mesh", "Meshes"]

Group = tuple[tuple[int, ...], dist.ProcessGroup | None]


class Mesh:
    """The process groups of ``placement`` along every set of its axes, made together."""

    def __init__(self, placement: Any, rank: int, entry: str) -> None:
        self.placement = placement
        self.entry = entry  # what made it (NOTE [meshes])
        self._mine: dict[tuple[int, ...], Group] = {}
        for count in range(1, placement.ndim + 1):
            for axes in itertools.combinations(range(placement.ndim), count):
                found = group_of(placement.type, placement.groups_along(axes), rank)
                if found is not None:
                    self._mine[axes] = found

    def group(self, axes: tuple[int, ...]) -> Group | None:
        """This rank's group along ``axes`` (its ranks and handle; the handle is None for a
        group of one rank), or None on a rank outside the placement."""
        return self._mine.get(tuple(axes))


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
