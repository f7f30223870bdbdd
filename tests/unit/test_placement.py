"""Placements: construction, value semantics, mesh geometry and the errors for bad ranks.

Pure code, one process: the expected coordinates and groups are written out by hand.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow.placement import Placement


def test_placement_is_the_public_alias() -> None:
    assert sbpflow.placement is Placement is sbpflow.Placement


@pytest.mark.parametrize(
    ("ranks", "shape", "flat"),
    [
        ([0, 1, 2, 3], (4,), (0, 1, 2, 3)),
        ([3, 1, 2, 0], (4,), (3, 1, 2, 0)),  # the user's order is kept
        ([[0, 1], [2, 3]], (2, 2), (0, 1, 2, 3)),
        ([[0, 1, 2], [3, 4, 5]], (2, 3), (0, 1, 2, 3, 4, 5)),
        ([[[0], [1]], [[2], [3]]], (2, 2, 1), (0, 1, 2, 3)),
        ([5], (1,), (5,)),
        (range(3), (3,), (0, 1, 2)),
        (torch.tensor([[0, 2], [1, 3]]), (2, 2), (0, 2, 1, 3)),
        (7, (1,), (7,)),
    ],
)
def test_mesh_shape_and_rank_order(
    ranks: object, shape: tuple[int, ...], flat: tuple[int, ...]
) -> None:
    pl = Placement("cpu", ranks)
    assert pl.shape == shape
    assert pl.ndim == len(shape)
    assert pl.flat_ranks == flat
    assert pl.num_ranks == len(flat)
    for r in flat:
        assert r in pl
    assert max(flat) + 1 not in pl


def test_value_semantics() -> None:
    a = Placement("cpu", [[0, 1], [2, 3]])
    b = Placement("cpu", ((0, 1), (2, 3)))
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != Placement("cpu", [0, 1, 2, 3])  # same ranks, other mesh
    assert a != Placement("cpu", [[0, 2], [1, 3]])  # other order
    assert Placement("cpu", [0, 1]) != Placement("cuda", [0, 1])
    with pytest.raises(AttributeError):
        a.type = "cuda"  # type: ignore[misc]


def test_printing() -> None:
    pl = Placement("cpu", [[0, 1], [2, 3]])
    assert str(pl) == "placement('cpu', [[0, 1], [2, 3]])"
    assert repr(pl) == str(pl) == f"{pl!r}"  # NOTE [one printed form]
    assert repr([pl]) == "[placement('cpu', [[0, 1], [2, 3]])]"
    assert str(Placement("cuda", [0, 1, 2])) == "placement('cuda', [0, 1, 2])"


def test_coords_round_trip() -> None:
    pl = Placement("cpu", [[4, 1, 2], [0, 5, 3]])
    assert pl.coords_of(4) == (0, 0)
    assert pl.coords_of(5) == (1, 1)
    assert pl.coords_of(3) == (1, 2)
    for coords in pl.all_coords():
        assert pl.coords_of(pl.rank_at(coords)) == coords
    assert list(pl.all_coords()) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    with pytest.raises(ValueError, match="rank 9 is not in"):
        pl.coords_of(9)


def test_groups_along_axes() -> None:
    pl = Placement("cpu", [[0, 1, 2], [3, 4, 5]])
    assert pl.group_along(0, 4) == (1, 4)
    assert pl.group_along(1, 4) == (3, 4, 5)
    assert pl.groups_along([0]) == [(0, 3), (1, 4), (2, 5)]
    assert pl.groups_along([1]) == [(0, 1, 2), (3, 4, 5)]
    assert pl.groups_along([0, 1]) == [(0, 1, 2, 3, 4, 5)]
    assert pl.groups_along([]) == [(r,) for r in range(6)]
    one_d = Placement("cpu", [2, 0, 1])
    assert one_d.groups_along([0]) == [(2, 0, 1)]
    assert one_d.group_along(0, 0) == (2, 0, 1)


@pytest.mark.parametrize(
    ("type_", "ranks", "error", "match"),
    [
        ("gpu", [0, 1], ValueError, r"type must be one of \('cpu', 'cuda'\), got 'gpu'"),
        (None, [0, 1], ValueError, "got None"),
        ("cpu", [], ValueError, "ranks are empty"),
        ("cpu", [0, 0, 1], ValueError, r"repeat \[0\]"),
        ("cpu", [0, -1], ValueError, "non-negative ints, got -1"),
        ("cpu", [0, True], ValueError, "non-negative ints, got True"),
        ("cpu", [[0, 1], [2]], ValueError, "ragged"),
        ("cpu", [[0, 1], 2], ValueError, "mix ints and lists"),
        ("cpu", "0,1", TypeError, "got str"),
        ("cpu", [0, 1.5], TypeError, "got float"),
    ],
)
def test_bad_placements_name_the_value(
    type_: object, ranks: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        Placement(type_, ranks)  # type: ignore[arg-type]
