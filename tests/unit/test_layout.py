"""Shard geometry: the balanced rule, boxes on 1-D and N-D meshes, and local-shape inference.

Pure code, one process. The reference for every box is ``torch.tensor_split``
applied axis by axis to a tensor of unique values (it cuts by the balanced rule).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sbpflow._layout import (
    Layout,
    balanced_range,
    balanced_sizes,
    box_numel,
    box_shape,
    empty_local_shape,
    intersect,
    logical_shape_from_locals,
    member_sizes,
    relative,
)
from sbpflow.placement import Placement
from sbpflow.sbp import Broadcast, Partial, Split

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")


def test_balanced_rule_examples_from_the_design() -> None:
    assert balanced_sizes(13, 4) == [4, 3, 3, 3]
    assert balanced_sizes(2, 4) == [1, 1, 0, 0]
    assert balanced_sizes(12, 4) == [3, 3, 3, 3]
    assert balanced_sizes(0, 3) == [0, 0, 0]
    assert balanced_sizes(5, 1) == [5]


@pytest.mark.parametrize(("length", "parts"), [(n, p) for n in range(0, 15) for p in range(1, 6)])
def test_balanced_ranges_tile_the_length_like_tensor_split(length: int, parts: int) -> None:
    sizes = balanced_sizes(length, parts)
    reference = [len(piece) for piece in torch.tensor_split(torch.arange(length), parts)]
    assert sizes == reference
    ranges = [balanced_range(length, parts, i) for i in range(parts)]
    assert [stop - start for start, stop in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def _reference_piece(
    logical: torch.Tensor, pl: Placement, sbp: tuple, coords: tuple[int, ...]
) -> torch.Tensor:
    """Cut ``logical`` axis by axis with tensor_split (P and B axes keep the block)."""
    piece = logical
    for axis, s in enumerate(sbp):
        if isinstance(s, Split):
            piece = torch.tensor_split(piece, pl.shape[axis], dim=s.dim)[coords[axis]]
    return piece


_MESHES = [
    [0, 1, 2, 3],
    [2, 0, 1],
    [[0, 1], [2, 3]],
    [[0, 1, 2], [3, 4, 5]],
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
]


@pytest.mark.parametrize("ranks", _MESHES, ids=str)
@pytest.mark.parametrize("shape", [(13, 5), (3, 7, 2), (0, 4), (2, 1)], ids=str)
def test_boxes_match_nested_tensor_split(ranks: list, shape: tuple[int, ...]) -> None:
    pl = Placement("cpu", ranks)
    values = [B, P] + [Split(d) for d in range(len(shape))]
    logical = (
        torch.arange(max(1, torch.Size(shape).numel()))
        .reshape(-1)[: torch.Size(shape).numel()]
        .reshape(shape)
    )
    for sbp in itertools.product(values, repeat=pl.ndim):
        layout = Layout(pl, sbp)
        for rank in pl.flat_ranks:
            box = layout.box(shape, rank)
            expected = _reference_piece(logical, pl, sbp, pl.coords_of(rank))
            got = logical[tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got, expected), (sbp, rank, box)
            assert layout.local_shape(shape, rank) == tuple(expected.shape) == box_shape(box)
            assert box_numel(box) == expected.numel()


def test_nested_split_of_one_dim_on_a_2x2_mesh() -> None:
    """Axis 0 cuts 13 into 7, 6; axis 1 cuts each piece again: 4, 3 and 3, 3."""
    layout = Layout(Placement("cpu", [[0, 1], [2, 3]]), (S0, S0))
    assert [layout.box((13,), r) for r in range(4)] == [
        ((0, 4),),
        ((4, 7),),
        ((7, 10),),
        ((10, 13),),
    ]
    mixed = Layout(Placement("cpu", [[0, 1], [2, 3]]), (S1, P))
    assert mixed.box((3, 5), 1) == ((0, 3), (0, 3))
    assert mixed.box((3, 5), 2) == ((0, 3), (3, 5))


def test_rank_outside_the_placement_holds_an_empty_local() -> None:
    layout = Layout(Placement("cpu", [1, 2]), (S0,))
    assert layout.local_shape((8, 3), 0) == (0, 0)
    assert layout.local_shape((8, 3), 2) == (4, 3)
    assert empty_local_shape(0) == (0,)
    assert empty_local_shape(3) == (0, 0, 0)


def test_layout_value_semantics_and_normalized() -> None:
    pl = Placement("cpu", [[0, 1, 2]])  # a 1x3 mesh: axis 0 has one rank
    a = Layout(pl, (S0, S1))
    assert a == Layout(pl, [Split(0), Split(1)]) and hash(a) == hash(Layout(pl, (S0, S1)))
    assert a.normalized() == Layout(pl, (B, S1))
    assert str(a) == "(S(0), S(1))"
    assert "on placement('cpu', [[0, 1, 2]])" in a.describe()
    assert Layout(pl, (P, B)).has_partial and not a.has_partial
    with pytest.raises(ValueError, match="has 1 entry but the placement has 2 axes"):
        Layout(pl, S0)


def test_intersect_and_relative() -> None:
    assert intersect(((0, 4), (2, 6)), ((2, 8), (0, 3))) == ((2, 4), (2, 3))
    assert intersect(((0, 4),), ((4, 8),)) is None
    assert relative(((2, 4), (2, 3)), ((0, 4), (2, 6))) == (slice(2, 4), slice(0, 1))


def test_member_sizes_along_an_axis() -> None:
    pl = Placement("cpu", [[0, 1], [2, 3]])
    nested = Layout(pl, (S0, S0))
    assert member_sizes((13,), nested, pl.group_along(1, 2), 0) == [3, 3]
    assert member_sizes((13,), nested, pl.group_along(0, 1), 0) == [3, 3]
    assert member_sizes((13,), Layout(pl, (S0, B)), pl.group_along(0, 3), 0) == [7, 6]
    flat = Placement("cpu", [0, 1, 2, 3])
    assert member_sizes((13, 3), Layout(flat, (S0,)), flat.group_along(0, 0), 0) == [4, 3, 3, 3]
    # Merged axes: each member's own nested box, not a flat balanced split of 6 over 4.
    assert member_sizes((6,), nested, pl.groups_along((0, 1))[0], 0) == [2, 1, 2, 1]


def test_logical_shape_from_balanced_locals() -> None:
    one_d = Placement("cpu", [0, 1, 2, 3])
    assert logical_shape_from_locals(
        {0: (4, 2), 1: (3, 2), 2: (3, 2), 3: (3, 2)}, one_d, (S0,)
    ) == (13, 2)
    assert logical_shape_from_locals({0: (1,), 1: (1,), 2: (0,), 3: (0,)}, one_d, (S0,)) == (2,)
    assert logical_shape_from_locals({r: (5, 3) for r in range(4)}, one_d, (B,)) == (5, 3)
    assert logical_shape_from_locals({r: (5, 3) for r in range(4)}, one_d, (P,)) == (5, 3)
    mesh = Placement("cpu", [[0, 1], [2, 3]])
    locals_ = {0: (4, 2), 1: (4, 1), 2: (3, 2), 3: (3, 1)}
    assert logical_shape_from_locals(locals_, mesh, (S0, S1)) == (7, 3)
    nested = {0: (4,), 1: (3,), 2: (3,), 3: (3,)}
    assert logical_shape_from_locals(nested, mesh, (S0, S0)) == (13,)


@pytest.mark.parametrize(
    ("local_shapes", "sbp", "match"),
    [
        (
            {0: (2, 3), 1: (4, 3)},
            (S0,),
            r"rank 0 passed shape \[2, 3\], expected \[3, 3\].*balanced rule.*logical \[6, 3\]",
        ),
        ({0: (1, 3), 1: (2, 3)}, (S0,), r"rank 0 passed shape \[1, 3\], expected \[2, 3\]"),
        ({0: (2, 3), 1: (2, 4)}, (S0,), r"rank 1 passed shape \[2, 4\], expected \[2, 3\]"),
        (
            {0: (5, 3), 1: (4, 3)},
            (B,),
            r"rank 1 passed shape \[4, 3\], expected \[5, 3\]\. With SBP B every rank passes "
            r"the whole tensor.*the first rank, 0, passed \[5, 3\]",
        ),
        ({0: (5, 3), 1: (5, 4)}, (P,), r"With SBP P every rank passes the whole tensor"),
        (
            {0: (5, 3), 1: (5,)},
            (P,),
            r"different ndim.*rank 0 has shape \[5, 3\], rank 1 has \[5\]",
        ),
    ],
)
def test_logical_shape_errors_name_the_ranks_and_shapes(
    local_shapes: dict, sbp: tuple, match: str
) -> None:
    """A broadcast or partial mismatch says what broadcast expects, never a balanced split."""
    with pytest.raises(ValueError, match=match) as info:
        logical_shape_from_locals(local_shapes, Placement("cpu", [0, 1]), sbp)
    split = any(isinstance(s, Split) for s in sbp)
    if "ndim" not in match:
        assert ("balanced" in str(info.value)) == split, str(info.value)
