"""A pipeline schedule: one list of actions per rank, and how it prints, draws and simulates."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from . import _simulate
from .actions import Action, ActionKind
from .timeline import draw_timeline, slot_table

__all__ = ["ActionTiming", "Schedule", "Simulation"]


class ActionTiming(NamedTuple):
    """When one action ran: the shape ``draw_timeline`` takes, simulated or measured."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """A schedule run on a clock with fixed action times (see ``Schedule.simulate``).

    ``timings`` has every action (a transfer's start is when its rank reached
    it, its end when it completed; a send completes at once). ``bubble_fraction``
    is the idle share of ``num_ranks * makespan``. ``peak_activations[stage]`` is
    the most micro-batches whose activations the stage held at once (forward
    done, backward or backward_input not yet); ``peak_activations_per_rank`` sums
    a rank's stages at each instant.
    """

    timings: tuple[ActionTiming, ...]
    ranks: tuple[int, ...]
    makespan: float
    bubble_fraction: float
    peak_activations: Mapping[int, int]
    peak_activations_per_rank: Mapping[int, int]

    @property
    def compute_timings(self) -> tuple[ActionTiming, ...]:
        return tuple(t for t in self.timings if t.action.is_compute)

    def _repr_html_(self) -> str:
        return draw_timeline(self.timings, self.ranks)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for ``num_microbatches`` micro-batches through ``num_stages`` stages.

    Stage ``s`` runs on rank ``stage_ranks[s]``; ``actions[rank]`` is that rank's
    list, run in order. Build one with ``build_schedule`` (which validates it);
    a hand-made one is checked by ``validate``.
    """

    name: str
    num_stages: int
    stage_ranks: tuple[int, ...]
    num_microbatches: int
    actions: Mapping[int, tuple[Action, ...]]

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks in pipeline order (first stage first)."""
        return tuple(dict.fromkeys(self.stage_ranks))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    @property
    def peak_live_microbatches(self) -> Mapping[int, int]:
        """Per stage, the most micro-batches whose activations it holds at once.

        A micro-batch is live on a stage from its forward until the backward
        that frees its graph: B, or W for a split backward (I keeps the graph
        for W). Read off the lists, so whatever the actions' times: the memory
        a schedule needs, which ``StepRecord.peak_live_microbatches`` measures.
        """
        return {s: n for s, n in sorted(self._live_peaks()[0].items())}

    @property
    def peak_live_per_rank(self) -> Mapping[int, int]:
        """Per rank, the most (stage, micro-batch) activations its stages hold at once."""
        return self._live_peaks()[1]

    def _live_peaks(self) -> tuple[dict[int, int], dict[int, int]]:
        per_stage: dict[int, int] = {}
        per_rank: dict[int, int] = {}
        for rank in self.ranks:
            live: dict[int, int] = {}
            held = peak = 0
            for a in self.actions[rank]:
                if a.kind is ActionKind.FORWARD:
                    delta = 1
                elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                    delta = -1
                else:
                    continue
                live[a.stage] = live.get(a.stage, 0) + delta
                per_stage[a.stage] = max(per_stage.get(a.stage, 0), live[a.stage])
                held += delta
                peak = max(peak, held)
            per_rank[rank] = peak
        return per_stage, per_rank

    def simulate(
        self,
        forward_time: float = 1.0,
        backward_time: float = 2.0,
        backward_input_time: float | None = None,
        backward_weight_time: float | None = None,
        comm_time: float = 0.0,
    ) -> Simulation:
        """Run the lists on a clock: each action kind takes a fixed time, transfers ``comm_time``.

        ``backward_input_time`` and ``backward_weight_time`` (the halves of a
        split backward) default to half of ``backward_time`` each. Receives
        block until their message arrives; sends do not block.
        """
        times = {
            ActionKind.FORWARD: forward_time,
            ActionKind.BACKWARD: backward_time,
            ActionKind.BACKWARD_INPUT: (
                backward_time / 2 if backward_input_time is None else backward_input_time
            ),
            ActionKind.BACKWARD_WEIGHT: (
                backward_time / 2 if backward_weight_time is None else backward_weight_time
            ),
        }
        for kind, value in [*times.items(), (None, comm_time)]:
            what = "comm_time" if kind is None else f"the {kind.name.lower()} time"
            if not value >= 0:
                raise ValueError(f"{what} must be >= 0, got {value!r}.")
        return self._simulate(lambda action: times[action.kind], comm_time)

    def _simulate(self, duration: Callable[[Action], float], comm_time: float) -> Simulation:
        done = _simulate.run(self.actions, duration, comm_time)
        if done.stuck:
            raise ValueError(
                f"schedule {self.name!r} cannot run to its end: {_simulate.describe(self.actions, done)}; "
                "validate(schedule) names the first problem of a hand-made schedule."
            )
        timings = tuple(ActionTiming(*t) for t in done.timings)
        makespan = max((t.end for t in timings), default=0.0)
        busy = sum(t.end - t.start for t in timings if t.action.is_compute)
        bubble = 1.0 - busy / (len(self.ranks) * makespan) if makespan > 0 else 0.0
        per_stage = {s: _peak(timings, {s}) for s in range(self.num_stages)}
        per_rank = {r: _peak(timings, set(self.stages_of(r))) for r in self.ranks}
        return Simulation(timings, self.ranks, makespan, bubble, per_stage, per_rank)

    def __str__(self) -> str:
        unit = self._simulate(lambda action: 1.0, 0.0)
        peaks = ", ".join(f"rank {r}: {n}" for r, n in unit.peak_activations_per_rank.items())
        return "\n".join(
            [
                self._title(),
                *slot_table(unit.timings, self.ranks),
                f"bubble {unit.bubble_fraction:.1%} with every compute action one slot long; "
                f"peak in-flight activations {peaks}",
            ]
        )

    def __repr__(self) -> str:
        return f"<Schedule {self._title()}>"

    def _repr_html_(self) -> str:
        sim = self.simulate()
        caption = (
            f"simulated with forward 1, backward 2 (input and weight halves 1 each): "
            f"bubble {sim.bubble_fraction:.1%}"
        )
        return (
            f'<div class="sbpflow-pipeline"><b>{html.escape(self._title())}</b>'
            f"{draw_timeline(sim.timings, self.ranks, self._title())}"
            f'<div style="font-size:11px;color:#555">{html.escape(caption)}</div></div>'
        )

    def _title(self) -> str:
        where = ", ".join(f"s{s}:r{r}" for s, r in enumerate(self.stage_ranks))
        return (
            f"{self.name}: {self.num_stages} stages ({where}), "
            f"{self.num_microbatches} micro-batches"
        )


def _peak(timings: tuple[ActionTiming, ...], stages: set[int]) -> int:
    """Most (stage, micro-batch) activations held at once: from a forward's end to its backward's end."""
    events = []
    for t in timings:
        if t.action.stage not in stages:
            continue
        if t.action.kind is ActionKind.FORWARD:
            events.append((t.end, 1))
        elif t.action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            events.append((t.end, -1))
    held = peak = 0
    for _, delta in sorted(events):  # a release sorts before a forward ending at the same time
        held += delta
        peak = max(peak, held)
    return peak
