"""Drawing a pipeline timeline: one lane per rank, one box per compute action.

``draw_timeline`` takes ``(rank, action, start, end)`` rows, so it draws a
simulated schedule (``Schedule.simulate().timings``) and timings measured on
a real run alike. Transfers are skipped: they are instants on the clock.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from .actions import Action, ActionKind

__all__ = ["draw_timeline"]

KIND_COLORS = {
    ActionKind.FORWARD: "#8ecae6",
    ActionKind.BACKWARD: "#f4a261",
    ActionKind.BACKWARD_INPUT: "#e76f51",
    ActionKind.BACKWARD_WEIGHT: "#90be6d",
}
_LANE_PX = 24
_LABEL_PX = 56  # left margin holding "rank N"
_MAX_WIDTH_PX = 960


def draw_timeline(
    timings: Iterable[tuple[int, Action, float, float]],
    ranks: Sequence[int] | None = None,
    title: str = "",
) -> str:
    """An inline SVG of ``(rank, action, start, end)`` rows: lanes in ``ranks`` order (default sorted).

    Each compute action is a box coloured by kind (F, B, I, W) and labelled with
    its micro-batch; hovering shows the action and its times.
    """
    rows = [(r, a, float(s), float(e)) for r, a, s, e in timings if a.is_compute]
    lanes = list(ranks) if ranks is not None else sorted({r for r, _, _, _ in rows})
    unknown = {r for r, _, _, _ in rows} - set(lanes)
    if unknown:
        raise ValueError(
            f"draw_timeline got timings for ranks {sorted(unknown)} that are not in "
            f"ranks={lanes}; pass every rank that appears, or ranks=None."
        )
    t0 = min((s for _, _, s, _ in rows), default=0.0)
    t1 = max((e for _, _, _, e in rows), default=t0 + 1.0)
    span = max(t1 - t0, 1e-12)
    scale = min(40.0, (_MAX_WIDTH_PX - _LABEL_PX) / span)  # px per time unit
    width = _LABEL_PX + span * scale + 4
    height = len(lanes) * _LANE_PX + 18
    lane_of = {rank: i for i, rank in enumerate(lanes)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'font-family="monospace" font-size="10">'
    ]
    if title:
        parts.append(f"<title>{html.escape(title)}</title>")
    for rank, i in lane_of.items():
        y = i * _LANE_PX
        parts.append(
            f'<g class="lane" data-rank="{rank}">'
            f'<text x="2" y="{y + 16}">rank {rank}</text>'
            f'<line x1="{_LABEL_PX}" y1="{y + _LANE_PX - 1}" x2="{width:.1f}" '
            f'y2="{y + _LANE_PX - 1}" stroke="#ddd"/>'
        )
        for r, action, start, end in rows:
            if r != rank:
                continue
            x = _LABEL_PX + (start - t0) * scale
            w = max((end - start) * scale, 1.0)
            tip = f"{action} on rank {rank}: {start:g} to {end:g}"
            parts.append(
                f'<g class="action {action.kind.value}"><title>{html.escape(tip)}</title>'
                f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{_LANE_PX - 5}" '
                f'fill="{KIND_COLORS[action.kind]}" stroke="#555" stroke-width="0.5"/>'
            )
            if w >= 12:
                parts.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + 15}" text-anchor="middle">'
                    f"{action.microbatch}</text>"
                )
            parts.append("</g>")
        parts.append("</g>")
    legend_y = len(lanes) * _LANE_PX + 13
    x = float(_LABEL_PX)
    for kind in (k for k in KIND_COLORS if any(a.kind is k for _, a, _, _ in rows)):
        parts.append(
            f'<rect x="{x:.0f}" y="{legend_y - 9}" width="10" height="10" '
            f'fill="{KIND_COLORS[kind]}"/><text x="{x + 13:.0f}" y="{legend_y}">'
            f"{kind.value} {kind.name.lower()}</text>"
        )
        x += 150
    parts.append("</svg>")
    return "".join(parts)


def slot_table(
    timings: Iterable[tuple[int, Action, float, float]], ranks: Sequence[int]
) -> list[str]:
    """Lines of a text table of a unit-time run: one row per rank, one column per time slot."""
    cells: dict[tuple[int, int], str] = {}
    for rank, action, start, end in timings:
        if action.is_compute:
            assert end - start == 1 and start == int(start), "slot_table needs unit times"
            cells[(rank, int(start))] = str(action)
    num_slots = max((slot + 1 for _, slot in cells), default=0)
    width = max((len(c) for c in cells.values()), default=1)
    width = max(width, len(str(num_slots - 1)))
    head = max(len(f"rank {r}") for r in ranks)
    slots = " ".join(str(t).ljust(width) for t in range(num_slots))
    lines = [(" " * head + " | " + slots).rstrip()]
    for rank in ranks:
        row = " ".join(cells.get((rank, t), ".").ljust(width) for t in range(num_slots))
        lines.append(f"rank {rank}".ljust(head) + " | " + row.rstrip())
    return lines
