"""Which splits view/reshape keep (NOTE [view rules]), checked without a process group.

The reference is a brute-force one: a split of input dim ``d`` may become a split
of output dim ``e`` exactly when, for every rank, the flat positions its input
piece covers are the flat positions its output piece covers.
"""

from __future__ import annotations

import math

import pytest
import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.ops.views import _pieces_line_up, view_split_target
from sbpflow.sbp import Split


def _flat_positions(shape: tuple[int, ...], dim: int, parts: int, index: int) -> set[int]:
    ids = torch.arange(math.prod(shape)).reshape(shape)
    return set(torch.tensor_split(ids, parts, dim=dim)[index].flatten().tolist())


def _brute_force_targets(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], dim: int, parts: int
) -> list[int]:
    return [
        e
        for e in range(len(out_shape))
        if all(
            _flat_positions(in_shape, dim, parts, r) == _flat_positions(out_shape, e, parts, r)
            for r in range(parts)
        )
    ]


SHAPE_PAIRS = [
    ((4, 6, 5), (4, 30)),
    ((4, 6, 5), (24, 5)),
    ((4, 6, 5), (4, 2, 3, 5)),
    ((5, 6, 3), (15, 6)),
    ((5, 6, 3), (5, 18)),
    ((6, 2), (12,)),
    ((6, 4), (3, 8)),
    ((2, 1, 5), (2, 5)),
    ((8, 3), (2, 4, 3)),
]


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("in_shape,out_shape", SHAPE_PAIRS)
def test_view_split_target_matches_brute_force(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], parts: int
) -> None:
    for dim in range(len(in_shape)):
        found = view_split_target(in_shape, out_shape, dim, parts)
        allowed = _brute_force_targets(in_shape, out_shape, dim, parts)
        if found is None:
            # Only size-1 output dims (pieces of one element or none) may be missed.
            assert all(out_shape[e] == 1 for e in allowed), (dim, allowed)
        else:
            assert found in allowed, (dim, found, allowed)


def test_nested_splits_that_do_not_line_up_are_detected() -> None:
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    src = Layout(mesh, (Split(0), Split(0)))
    # 6 rows over 2x2 are pieces of 2, 1, 2, 1 rows; viewed as 12 elements the
    # output pieces are 3, 3, 3, 3: each axis alone lines up, the nesting does not.
    assert view_split_target((6, 2), (12,), 0, 2) == 0
    assert not _pieces_line_up((6, 2), (12,), src, Layout(mesh, (Split(0), Split(0))))
    assert _pieces_line_up((8, 2), (16,), src, Layout(mesh, (Split(0), Split(0))))
