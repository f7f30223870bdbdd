"""What a pipelined step actually ran: per-rank actions with measured times.

The runtime (``sbpflow.nn.pipeline.runtime``) fills a ``StepRecord`` on each
rank as it executes the schedule; ``StepRecord.combine`` joins the records of
several ranks (returned by the ranks of a job, say) into one picture. Pure:
no process group.

Times are seconds of ``time.monotonic()``, one clock for every process on a
host, so records of ranks on one host line up. A compute action's interval is
the time it computed: the time its receives waited is cut from its start and
shown as the receive (a stage waiting for its input is bubble, not work).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .actions import Action, ActionKind
from .schedule import ActionTiming, Schedule
from .timeline import draw_timeline

__all__ = ["Message", "StepRecord"]


@dataclass(frozen=True)
class Message:
    """One point-to-point message a rank sent or received during one of its compute actions."""

    rank: int
    action: Action  # the compute action it happened in
    direction: str  # "send" or "recv"
    peer: int  # the other rank (the real one, not the schedule's representative)
    nbytes: int
    start: float
    end: float


@dataclass(frozen=True)
class StepRecord:
    """The actions ranks ran in one step, in the order each ran them, with their times.

    ``timings`` holds, per rank in ``ranks`` order, every compute action and,
    around it, one receive per rank it received from and one send per rank it
    sent to (peers named as in the schedule: the first rank of the peer
    stage's placement). ``messages`` lists each point-to-point message with
    its real peer. ``schedule`` is the schedule the ranks ran.
    """

    schedule: Schedule
    ranks: tuple[int, ...]
    timings: tuple[ActionTiming, ...]
    messages: tuple[Message, ...] = ()

    @classmethod
    def combine(cls, records: Iterable[StepRecord]) -> StepRecord:
        """One record of several ranks' records of the same step (e.g. gathered from a job)."""
        records = list(records)
        if not records:
            raise ValueError("StepRecord.combine needs at least one record, got none.")
        first = records[0].schedule
        for r in records[1:]:
            if r.schedule != first:
                raise ValueError(
                    f"StepRecord.combine got records of different schedules ({r.schedule!r} and "
                    f"{first!r}); combine the records of one step."
                )
        ranks = tuple(rank for r in records for rank in r.ranks)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"StepRecord.combine got ranks {list(ranks)}: a rank twice.")
        return cls(
            first,
            ranks,
            tuple(t for r in records for t in r.timings),
            tuple(m for r in records for m in r.messages),
        )

    def actions_of(self, rank: int) -> tuple[Action, ...]:
        """The actions ``rank`` ran, in the order it ran them."""
        return tuple(t.action for t in self.timings if t.rank == rank)

    @property
    def compute_timings(self) -> tuple[ActionTiming, ...]:
        return tuple(t for t in self.timings if t.action.is_compute)

    @property
    def makespan(self) -> float:
        """Seconds from the first compute action's start to the last one's end, over the ranks."""
        compute = self.compute_timings
        if not compute:
            return 0.0
        return max(t.end for t in compute) - min(t.start for t in compute)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of ``len(ranks) * makespan``: 1 - computing time / (ranks * makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        busy = sum(t.end - t.start for t in self.compute_timings)
        return 1.0 - busy / (len(self.ranks) * span)

    @property
    def peak_live_microbatches(self) -> Mapping[int, int]:
        """Per stage, the most micro-batches whose activations it held at once.

        A micro-batch is live on a stage from the end of its forward until
        the end of the backward that frees its graph: B, or W for a split
        backward (the input-grad half I keeps the graph for W).
        """
        events: dict[int, list[tuple[float, int, int]]] = {}
        for i, t in enumerate(self.timings):
            a = t.action
            if a.kind is ActionKind.FORWARD:
                events.setdefault(a.stage, []).append((t.end, i, 1))
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                events.setdefault(a.stage, []).append((t.end, i, -1))
        peaks = {}
        for stage, found in events.items():
            held = peak = 0
            for _, _, delta in sorted(found):
                held += delta
                peak = max(peak, held)
            peaks[stage] = peak
        return dict(sorted(peaks.items()))

    def _repr_html_(self) -> str:
        title = f"executed {self.schedule._title()}"
        caption = (
            f"measured on ranks {list(self.ranks)}: step {self.makespan * 1e3:.1f} ms, "
            f"bubble {self.bubble_fraction:.1%}"
        )
        return (
            f'<div class="sbpflow-pipeline"><b>{html.escape(title)}</b>'
            f"{draw_timeline(self._in_ms(), self.ranks, title)}"
            f'<div style="font-size:11px;color:#555">{html.escape(caption)}</div></div>'
        )

    def svg(self) -> str:
        """The timeline alone, as an SVG document (for a file or a page)."""
        return draw_timeline(self._in_ms(), self.ranks, f"executed {self.schedule._title()}")

    def _in_ms(self) -> list[ActionTiming]:
        """The timings in milliseconds from the first start (the unit the drawing reads)."""
        t0 = min((t.start for t in self.timings), default=0.0)
        return [
            t._replace(start=(t.start - t0) * 1e3, end=(t.end - t0) * 1e3) for t in self.timings
        ]

    def __str__(self) -> str:
        lines = [f"executed {self.schedule._title()} on ranks {list(self.ranks)}"]
        for rank in self.ranks:
            done = " ".join(str(a) for a in self.actions_of(rank) if a.is_compute)
            lines.append(f"rank {rank}: {done}")
        peaks = ", ".join(f"stage {s}: {n}" for s, n in self.peak_live_microbatches.items())
        lines.append(
            f"step {self.makespan * 1e3:.1f} ms, bubble {self.bubble_fraction:.1%}; "
            f"peak live micro-batches {peaks}"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<StepRecord {self.schedule._title()} on ranks {list(self.ranks)}>"
