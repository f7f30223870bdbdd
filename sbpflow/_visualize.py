"""``sbpflow.visualize``: which rank holds which slice of a global tensor.

Pure geometry over ``_layout`` (no process group), so it works in a notebook
on a ``(shape, placement, sbp)`` triple as well as on a live ``GlobalTensor``.
``str`` gives a text table; ``_repr_html_`` an HTML table and, for 1-D and 2-D
tensors, a grid coloured by the rank(s) holding each block.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._global import GlobalTensor
from ._layout import Box, Layout, box_shape
from .placement import Placement
from .sbp import Broadcast, NdSbp, Partial, normalize, sbp_str

__all__ = ["LayoutView", "RankSlice", "visualize"]

_MAX_GRID_CELLS = 64  # per tensor dim; past this the grid is unreadable, the table stays


@dataclass(frozen=True)
class RankSlice:
    """One rank's piece: mesh coordinates, local shape, ``(start, stop)`` per dim, and a note."""

    rank: int
    coords: tuple[int, ...]
    local_shape: tuple[int, ...]
    box: Box
    note: str

    @property
    def slices(self) -> tuple[slice, ...]:
        """The piece as slices of the logical tensor: ``logical[piece.slices]``."""
        return tuple(slice(start, stop) for start, stop in self.box)


@dataclass(frozen=True)
class LayoutView:
    """How a logical tensor of ``shape`` is laid out as ``sbp`` over ``placement``."""

    shape: tuple[int, ...]
    placement: Placement
    sbp: NdSbp
    pieces: tuple[RankSlice, ...]

    @property
    def title(self) -> str:
        return f"{sbp_str(self.sbp)} of shape {list(self.shape)} on {self.placement}"

    def __str__(self) -> str:
        header = (
            ["rank", "mesh", "local shape"]
            + [f"dim {d}" for d in range(len(self.shape))]
            + ["note"]
        )
        rows = [
            [str(p.rank), _coords_str(p.coords), str(list(p.local_shape))]
            + [f"{start}:{stop}" for start, stop in p.box]
            + [p.note]
            for p in self.pieces
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [self.title]
        for row in [header, *rows]:
            lines.append(
                "  "
                + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<LayoutView {self.title}>"

    def _repr_html_(self) -> str:
        header = "".join(
            f"<th>{html.escape(h)}</th>"
            for h in ["rank", "mesh", "local shape"]
            + [f"dim {d}" for d in range(len(self.shape))]
            + ["note"]
        )
        rows = "".join(
            "<tr>"
            + f'<td style="background:{_color(self._index(p.rank), self.placement.num_ranks)}">{p.rank}</td>'
            + "".join(
                f"<td>{html.escape(c)}</td>"
                for c in [_coords_str(p.coords), str(list(p.local_shape))]
                + [f"{start}:{stop}" for start, stop in p.box]
                + [p.note]
            )
            + "</tr>"
            for p in self.pieces
        )
        table = f'<table style="border-collapse:collapse"><tr>{header}</tr>{rows}</table>'
        return (
            f'<div class="sbpflow-layout"><b>{html.escape(self.title)}</b>'
            f"{self._grid_html()}{table}</div>"
        )

    # -- the grid ---------------------------------------------------------------------
    def _index(self, rank: int) -> int:
        return self.placement.flat_ranks.index(rank)

    def _grid_html(self) -> str:
        if len(self.shape) not in (1, 2) or any(n == 0 for n in self.shape):
            return ""
        shape2 = (1, *self.shape) if len(self.shape) == 1 else self.shape
        boxes = [((0, 1), *p.box) if len(self.shape) == 1 else p.box for p in self.pieces]
        cuts = [_cuts(shape2[d], [b[d] for b in boxes]) for d in range(2)]
        if any(len(c) - 1 > _MAX_GRID_CELLS for c in cuts):
            return ""
        has_partial = any(isinstance(s, Partial) for s in self.sbp)
        height = 24 if len(self.shape) == 1 else 240
        body = []
        for r0, r1 in zip(cuts[0], cuts[0][1:], strict=False):
            row_px = max(int(height * (r1 - r0) / shape2[0]), 20)
            cells = []
            for c0, c1 in zip(cuts[1], cuts[1][1:], strict=False):
                holders = [
                    p
                    for p, b in zip(self.pieces, boxes, strict=True)
                    if b[0][0] <= r0 < b[0][1] and b[1][0] <= c0 < b[1][1]
                ]
                label = self._holders_label(holders)
                where = f"[{r0}:{r1}, {c0}:{c1}]" if len(self.shape) == 2 else f"[{c0}:{c1}]"
                color = (
                    _color(self._index(holders[0].rank), self.placement.num_ranks)
                    if holders
                    else "#eee"
                )
                width = 100 * (c1 - c0) / shape2[1]
                cells.append(
                    f'<td title="{html.escape(where)} held by {html.escape(label)}" '
                    f'style="background:{color};width:{width:.2f}%;border:1px solid #555;'
                    f'text-align:center;font-size:11px">{html.escape(label)}</td>'
                )
            body.append(f'<tr style="height:{row_px}px">{"".join(cells)}</tr>')
        legend = "rank(s) holding each block; replicas are separated by commas"
        if has_partial:
            legend += ", and a+b means the block is the sum of those ranks' partial parts"
        return (
            f'<table style="border-collapse:collapse;width:100%;max-width:480px;table-layout:fixed;'
            f'margin:4px 0">{"".join(body)}</table><div style="font-size:11px;color:#555">'
            f"{html.escape(legend)}</div>"
        )

    def _holders_label(self, holders: Sequence[RankSlice]) -> str:
        """Ranks holding one block: replicas joined by ``, ``, partial parts by ``+``."""
        partial_axes = [a for a, s in enumerate(self.sbp) if isinstance(s, Partial)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for p in holders:
            key = tuple(c for a, c in enumerate(p.coords) if a not in partial_axes)
            groups.setdefault(key, []).append(p.rank)
        return ", ".join("+".join(map(str, ranks)) for ranks in groups.values())


def visualize(
    tensor_or_shape: Any, placement: Placement | None = None, sbp: Any = None
) -> LayoutView:
    """Which rank holds which slice of a global tensor; needs no process group.

    Call it with a ``GlobalTensor``, with ``(shape, placement, sbp)``, or with
    that triple as one tuple. Printing the result gives a table of every rank
    of the placement (mesh coordinates, local shape, ``start:stop`` per dim,
    and whether the piece is a replica or a partial-sum part); in a notebook it
    also draws the blocks of 1-D and 2-D tensors, coloured by rank.
    """
    shape, placement, nd_sbp = _arguments(tensor_or_shape, placement, sbp)
    layout = Layout(placement, nd_sbp)
    note = _note(placement, nd_sbp)
    pieces = []
    for rank in placement.flat_ranks:
        box = layout.box(shape, rank)
        local_shape = box_shape(box)
        empty = bool(shape) and any(n == 0 for n in local_shape) and all(n > 0 for n in shape)
        pieces.append(
            RankSlice(rank, placement.coords_of(rank), local_shape, box, "empty" if empty else note)
        )
    return LayoutView(shape, placement, nd_sbp, tuple(pieces))


def _arguments(
    value: Any, placement: Placement | None, sbp: Any
) -> tuple[tuple[int, ...], Placement, NdSbp]:
    if isinstance(value, GlobalTensor):
        if placement is not None or sbp is not None:
            raise TypeError(
                "visualize(global_tensor) takes no placement or sbp: the tensor has its own; "
                "to see another layout, call visualize(shape, placement, sbp)."
            )
        return tuple(value.shape), value.placement, value.sbp
    if placement is None and sbp is None and isinstance(value, tuple) and len(value) == 3:
        value, placement, sbp = value
    if placement is None or sbp is None:
        raise TypeError(
            f"visualize takes a GlobalTensor or (shape, placement, sbp), got {type(value).__name__}: "
            f"{value!r} with placement={placement!r}, sbp={sbp!r}; e.g. "
            "visualize((8, 12), sbpflow.placement('cpu', [0, 1]), sbpflow.sbp.split(0))."
        )
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: {placement!r}."
        )
    try:
        shape = tuple(int(n) for n in value)
    except (TypeError, ValueError):
        raise TypeError(
            f"shape must be a sequence of ints, got {type(value).__name__}: {value!r}; e.g. (8, 12)."
        ) from None
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must not have negative sizes, got {list(shape)}.")
    return shape, placement, normalize(sbp, placement.ndim, len(shape))


def _note(placement: Placement, nd_sbp: NdSbp) -> str:
    notes = []
    for axis, (size, s) in enumerate(zip(placement.shape, nd_sbp, strict=True)):
        if size == 1:
            continue
        where = f" (axis {axis})" if placement.ndim > 1 else ""
        if isinstance(s, Partial):
            notes.append(f"partial {s.reduce_op} part{where}")
        elif isinstance(s, Broadcast):
            notes.append(f"replica{where}")
    return "; ".join(notes)


def _cuts(length: int, ranges: Sequence[tuple[int, int]]) -> list[int]:
    points = {0, length}
    for start, stop in ranges:
        points.update((start, stop))
    return sorted(points)


def _coords_str(coords: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, coords)) + ")"


def _color(index: int, count: int) -> str:
    hue = int(360 * index / max(count, 1))
    return f"hsl({hue}, 65%, 82%)"
