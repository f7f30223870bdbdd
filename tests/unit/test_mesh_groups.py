"""A mesh makes one group per axis and one of the whole mesh, and plans use only those
(NOTE [meshes] in comm/_mesh.py, NOTE [merged axes] in boxing/planner.py).

Checked in one process: ``Mesh`` is built with its group maker replaced by a recorder
(so no process group is made), and plans on a 2x2x2 mesh run through the mechanical
simulator of ``tests/boxing_support.py`` must give the single-device reference tensor
with every step on a group the mesh made. tests/dist/test_mesh_groups.py runs the real
executor on three-axis meshes of four ranks.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.boxing import planner
from sbpflow.comm import _mesh
from sbpflow.sbp import Broadcast, Partial, Split
from tests.boxing_support import assemble, make_locals, reference, simulate

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")
MESH_2X2X2 = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def _recorded_mesh(
    ranks: Any, rank: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[_mesh.Mesh, list[tuple[int, ...]]]:
    """The mesh of ``ranks`` as ``rank`` builds it, and every group of ranks it asked for."""
    asked: list[tuple[int, ...]] = []

    def group_of(device_type: str, groups: Any, me: int, tag: Any = None) -> Any:
        asked.extend(tuple(g) for g in groups)
        mine = [tuple(g) for g in groups if me in g]
        return (mine[0], object()) if mine else None

    monkeypatch.setattr(_mesh, "group_of", group_of)
    return _mesh.Mesh(sbpflow.placement("cpu", ranks), rank, "a test"), asked


def test_a_3_axis_mesh_makes_a_group_per_axis_and_the_whole() -> None:
    """2x2x2: 4 groups along each axis and the whole mesh (13), not every set of axes (19),
    each group once; what ``group`` answers for a set of axes is that set's ranks."""
    with pytest.MonkeyPatch.context() as mp:
        mesh, asked = _recorded_mesh(MESH_2X2X2, 5, mp)
    assert len(asked) == len(set(asked)) == 3 * 4 + 1, asked
    assert len(mesh._mine) == 4, mesh._mine  # this rank's groups: one per axis, the whole
    pl = mesh.placement
    for axes in [(0,), (1,), (2,), (0, 1, 2)]:
        group = mesh.group(axes)
        assert group is not None and group[0] == next(g for g in pl.groups_along(axes) if 5 in g)
    with pytest.raises(AssertionError, match="no group along axes"):
        mesh.group((0, 2))


@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 2, 2), (2, 1, 2)])
def test_axes_of_one_rank_are_left_out(shape: tuple[int, int, int]) -> None:
    """On a 3-axis mesh of 4 ranks with an axis of one rank, the two other axes together are
    the whole mesh: ``group`` of them answers the whole mesh's group, with the same members
    in the same order as the ranks along them."""
    ranks = torch.arange(4).reshape(shape).tolist()
    with pytest.MonkeyPatch.context() as mp:
        mesh, asked = _recorded_mesh(ranks, 0, mp)
    moving = tuple(a for a in range(3) if shape[a] > 1)
    made = {g for g in asked if len(g) > 1}  # gloo makes no group of one rank
    assert len(made) == 5, asked  # 2 + 2 along the axes of two ranks, 1 whole
    group = mesh.group(moving)
    assert group is not None and group[0] == tuple(mesh.placement.groups_along(moving)[0])
    assert [a for a, _ in mesh.lines(moving)] == [(0, 1, 2)]


def test_lines_of_a_strict_subset_go_one_axis_at_a_time() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mesh, _ = _recorded_mesh(MESH_2X2X2, 6, mp)
    lines = mesh.lines((0, 2))
    assert [a for a, _ in lines] == [(0,), (2,)]
    pl = mesh.placement
    assert [g[0] for _, g in lines] == [
        next(g for g in pl.groups_along((a,)) if 6 in g) for a in (0, 2)
    ]


@pytest.mark.parametrize("shape", [(8, 8, 8), (5, 6, 7)], ids=["even", "uneven"])
def test_plans_on_2x2x2_use_only_groups_the_mesh_makes(shape: tuple[int, int, int]) -> None:
    """Every plan among sampled pairs of 3-D layouts gives the single-device reference, and
    each of its steps runs on one axis or on all three."""
    mesh = sbpflow.placement("cpu", MESH_2X2X2)
    signatures = list(itertools.product([S0, S1, S2, B, P], repeat=3))
    rnd = random.Random(sum(shape) + 1)
    ref = reference(shape)
    pairs = [(rnd.choice(signatures), rnd.choice(signatures)) for _ in range(150)]
    pairs += [((S0, S0, S0), (B, B, S0)), ((P, P, P), (S0, S0, P)), ((P, P, B), (B, B, B))]
    for a, b in pairs:
        src, dst = Layout(mesh, a), Layout(mesh, b)
        plan = planner.plan(shape, torch.float32, src, dst)
        for step in plan.steps:
            assert len(step.axes) in (1, 3), f"{src.describe()} -> {dst.describe()}\n{plan}"
        got = assemble(shape, plan.dst, simulate(plan, make_locals(ref, plan.src)))
        assert torch.equal(got, ref), f"{src.describe()} -> {dst.describe()}\n{plan}"
