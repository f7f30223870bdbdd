"""``sbpflow.visualize``: the slices it reports are the ones the layout geometry gives each rank.

The reference is a plain tensor: cutting ``logical[piece.slices]`` for every
rank must reproduce the shards a split layout concatenates back into it.
No process group is used.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow import sbp
from sbpflow._layout import Layout
from sbpflow.tensor import GlobalTensor

P1 = sbpflow.placement("cpu", [0, 1, 2, 3])
P2 = sbpflow.placement("cpu", [[0, 1], [2, 3]])


def test_split_pieces_follow_the_balanced_rule_and_tile_the_tensor() -> None:
    view = sbpflow.visualize((13, 5), P1, sbp.split(0))
    assert [p.box for p in view.pieces] == [
        ((0, 4), (0, 5)),
        ((4, 7), (0, 5)),
        ((7, 10), (0, 5)),
        ((10, 13), (0, 5)),
    ]
    assert [p.local_shape for p in view.pieces] == [(4, 5), (3, 5), (3, 5), (3, 5)]
    logical = torch.arange(65).reshape(13, 5)
    assert torch.equal(torch.cat([logical[p.slices] for p in view.pieces]), logical)
    assert all(p.note == "" for p in view.pieces)


def test_2d_mesh_coordinates_and_notes() -> None:
    view = sbpflow.visualize((8, 12), P2, (sbp.split(0), sbp.partial_sum))
    assert [p.coords for p in view.pieces] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.box for p in view.pieces] == [((0, 4), (0, 12))] * 2 + [((4, 8), (0, 12))] * 2
    assert {p.note for p in view.pieces} == {"partial sum part (axis 1)"}
    view = sbpflow.visualize((8, 12), P2, (sbp.broadcast, sbp.split(1)))
    assert [p.box[1] for p in view.pieces] == [(0, 6), (6, 12), (0, 6), (6, 12)]
    assert {p.note for p in view.pieces} == {"replica (axis 0)"}


def test_1d_notes_and_empty_pieces() -> None:
    assert {p.note for p in sbpflow.visualize((4,), P1, sbp.broadcast).pieces} == {"replica"}
    assert {p.note for p in sbpflow.visualize((4,), P1, sbp.partial_sum).pieces} == {
        "partial sum part"
    }
    notes = [p.note for p in sbpflow.visualize((2,), P1, sbp.split(0)).pieces]
    assert notes == ["", "", "empty", "empty"]


def test_text_table() -> None:
    text = str(sbpflow.visualize((13, 5), P1, sbp.split(0)))
    lines = text.splitlines()
    assert lines[0] == "S(0) of shape [13, 5] on placement('cpu', [0, 1, 2, 3])"
    assert lines[1].split() == ["rank", "mesh", "local", "shape", "dim", "0", "dim", "1", "note"]
    assert lines[2].split() == ["0", "(0)", "[4,", "5]", "0:4", "0:5"]
    assert lines[5].split() == ["3", "(3)", "[3,", "5]", "10:13", "0:5"]


def test_accepts_a_global_tensor_and_a_triple() -> None:
    layout = Layout(P2, (sbp.split(0), sbp.split(1)))
    t = GlobalTensor(torch.zeros(4, 6), layout, (8, 12))  # metadata only: no process group
    from_tensor = sbpflow.visualize(t)
    assert from_tensor == sbpflow.visualize(((8, 12), P2, (sbp.split(0), sbp.split(1))))
    assert from_tensor == sbpflow.visualize(torch.Size([8, 12]), P2, (sbp.split(0), sbp.split(-1)))
    with pytest.raises(TypeError, match="takes no placement or sbp"):
        sbpflow.visualize(t, P2, sbp.broadcast)


def test_html_grid_labels_replicas_and_partial_parts() -> None:
    page = sbpflow.visualize((8, 12), P2, (sbp.split(0), sbp.split(1)))._repr_html_()
    assert page.count("<td title=") == 4  # a 2x2 grid of blocks
    assert 'title="[4:8, 6:12] held by 3"' in page
    page = sbpflow.visualize((8, 12), P2, (sbp.broadcast, sbp.partial_sum))._repr_html_()
    assert 'title="[0:8, 0:12] held by 0+1, 2+3"' in page
    assert "sum of those ranks&#x27; partial parts" in page
    page = sbpflow.visualize((13,), P1, sbp.split(0))._repr_html_()
    assert 'title="[10:13] held by 3"' in page
    page = sbpflow.visualize((2, 3, 4), P1, sbp.split(2))._repr_html_()
    assert "<td title=" not in page and "<th>dim 2</th>" in page  # no grid past 2-D, table only


@pytest.mark.parametrize(
    "args, error, match",
    [
        (((8, 12),), TypeError, r"GlobalTensor or \(shape, placement, sbp\)"),
        (((8, 12), [0, 1], sbp.split(0)), TypeError, "placement must be an sbpflow.placement"),
        (((8, -1), P1, sbp.split(0)), ValueError, "negative sizes"),
        (((8, 12), P1, sbp.split(2)), ValueError, "out of range"),
        (((8, 12), P2, sbp.split(0)), ValueError, "placement has 2 axes"),
        (("ab", P1, sbp.split(0)), TypeError, "shape must be a sequence of ints"),
    ],
)
def test_bad_arguments(args: tuple, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        sbpflow.visualize(*args)


def _torch_piece(logical: torch.Tensor, mesh_shape: tuple[int, ...], sbps: tuple, coords: tuple):
    """The piece at mesh ``coords``, cut with ``torch.tensor_split`` one mesh axis after the
    other (each split axis cuts the piece the axes before it left)."""
    piece = logical
    for n, s, c in zip(mesh_shape, sbps, coords, strict=True):
        if isinstance(s, sbp.Split):
            piece = torch.tensor_split(piece, n, dim=s.dim)[c]
    return piece


@pytest.mark.parametrize(
    "placement, sbps",
    [
        (P1, (sbp.split(0),)),
        (P1, (sbp.split(1),)),
        (P1, (sbp.broadcast,)),
        (P2, (sbp.split(0), sbp.split(1))),
        (P2, (sbp.split(1), sbp.split(0))),
        (P2, (sbp.split(0), sbp.split(0))),
        (P2, (sbp.split(1), sbp.split(1))),
        (P2, (sbp.broadcast, sbp.split(0))),
        (P2, (sbp.partial_sum, sbp.split(1))),
    ],
)
@pytest.mark.parametrize("shape", [(13, 5), (6, 7), (3, 2), (0, 4)])
def test_every_piece_is_what_torch_tensor_split_cuts(
    placement: sbpflow.placement, sbps: tuple, shape: tuple[int, int]
) -> None:
    """Through the public name, for even, uneven and empty shapes and nested splits: each
    rank's slices of the logical tensor are the piece ``torch.tensor_split`` gives."""
    from sbpflow import visualize  # the name users import

    logical = torch.arange(shape[0] * shape[1]).reshape(shape)
    view = visualize(shape, placement, sbps)
    assert tuple(p.rank for p in view.pieces) == placement.flat_ranks
    for p in view.pieces:
        expected = _torch_piece(logical, placement.shape, sbps, p.coords)
        assert p.local_shape == tuple(expected.shape), (p, expected.shape)
        assert torch.equal(logical[p.slices], expected), p
