"""``build_schedule``: check the arguments, lay out each rank's compute order, add transfers, validate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import _orders
from ._validate import validate
from .actions import Action, ActionKind
from .schedule import Schedule

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULE_NAMES", "build_schedule"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
DEFAULT_SCHEDULE = "1f1b"

StageRanks = Sequence[int] | Mapping[int, int] | Sequence[tuple[int, int]]


def build_schedule(
    name: str, num_stages: int, stage_ranks: StageRanks, num_microbatches: int
) -> Schedule:
    """The validated schedule ``name`` for ``num_microbatches`` micro-batches through ``num_stages`` stages.

    ``stage_ranks`` says where each stage runs: a list (stage ``s`` on
    ``stage_ranks[s]``), a ``{stage_id: rank}`` mapping, or ``(stage_id, rank)``
    pairs; stage ids must be exactly ``0..num_stages-1``. ``gpipe``, ``1f1b``
    and ``zero_bubble`` run one stage per rank; ``interleaved_1f1b`` deals the
    stages round-robin over its ranks (``[0, 1, 0, 1]``: ranks 0 and 1 hold two
    stages each). Pure: needs no process group.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULE_NAMES)}."
        )
    num_stages = _count("num_stages", num_stages)
    num_microbatches = _count("num_microbatches", num_microbatches)
    ranks = _stage_ranks(stage_ranks, num_stages)
    holders = list(dict.fromkeys(ranks))
    p, v = len(holders), num_stages // len(holders)
    if name == "interleaved_1f1b":
        _check_round_robin(ranks, holders)
        if num_microbatches % p:
            raise ValueError(
                f"interleaved_1f1b needs num_microbatches to be a multiple of the number of "
                f"pipeline ranks ({p}), got {num_microbatches}; use "
                f"{max(p, num_microbatches // p * p)} or {(num_microbatches // p + 1) * p}."
            )
    else:
        _check_one_stage_per_rank(name, ranks)
        if name != "gpipe" and num_microbatches < num_stages:
            raise ValueError(
                f"{name} needs at least as many micro-batches as stages ({num_stages}), got "
                f"num_microbatches={num_microbatches}; use more micro-batches or 'gpipe'."
            )
    if name == "gpipe":
        orders = _orders.gpipe(p, num_microbatches)
    elif name == "1f1b":
        orders = _orders.one_f_one_b(p, num_microbatches)
    elif name == "interleaved_1f1b":
        orders = _orders.interleaved_1f1b(p, v, num_microbatches)
    else:
        orders = _orders.zero_bubble(p, num_microbatches)
    actions = {
        rank: _with_transfers(order, rank, ranks)
        for rank, order in zip(holders, orders, strict=True)
    }
    schedule = Schedule(name, num_stages, ranks, num_microbatches, actions)
    validate(schedule)
    return schedule


def _with_transfers(order: list[Action], rank: int, ranks: tuple[int, ...]) -> tuple[Action, ...]:
    """Put a receive just before each compute that reads another rank's tensor and a send just after each that feeds one."""
    last = len(ranks) - 1
    out: list[Action] = []
    for a in order:
        s, k = a.stage, a.microbatch
        prev_rank = ranks[s - 1] if s > 0 else rank
        next_rank = ranks[s + 1] if s < last else rank
        if a.kind is ActionKind.FORWARD:
            if prev_rank != rank:
                out.append(Action(ActionKind.RECV_ACTIVATION, s, k, prev_rank))
            out.append(a)
            if next_rank != rank:
                out.append(Action(ActionKind.SEND_ACTIVATION, s, k, next_rank))
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            if next_rank != rank:
                out.append(Action(ActionKind.RECV_GRAD, s, k, next_rank))
            out.append(a)
            if prev_rank != rank:
                out.append(Action(ActionKind.SEND_GRAD, s, k, prev_rank))
        else:
            out.append(a)
    return tuple(out)


def _count(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}: {value!r}.")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}.")
    return value


def _stage_ranks(stage_ranks: StageRanks, num_stages: int) -> tuple[int, ...]:
    if isinstance(stage_ranks, Mapping):
        pairs = list(stage_ranks.items())
    elif (
        isinstance(stage_ranks, Sequence)
        and all(isinstance(x, tuple) for x in stage_ranks)
        and stage_ranks
    ):
        pairs = [(x[0], x[1]) for x in stage_ranks]  # type: ignore[index]
    elif isinstance(stage_ranks, Sequence) and not isinstance(stage_ranks, str):
        if len(stage_ranks) != num_stages:
            raise ValueError(
                f"stage_ranks has {len(stage_ranks)} entries for num_stages={num_stages}; it needs "
                f"one rank per stage (stage s runs on stage_ranks[s]), got {list(stage_ranks)}."
            )
        pairs = list(enumerate(stage_ranks))  # type: ignore[arg-type]
    else:
        raise TypeError(
            f"stage_ranks must be a list of ranks, a {{stage_id: rank}} mapping or (stage_id, rank) "
            f"pairs, got {type(stage_ranks).__name__}: {stage_ranks!r}."
        )
    ids = [sid for sid, _ in pairs]
    for value in [*ids, *(r for _, r in pairs)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(
                f"stage ids and ranks must be non-negative ints, got {value!r} in {stage_ranks!r}."
            )
    repeated = sorted({sid for sid in ids if ids.count(sid) > 1})
    if repeated:
        raise ValueError(
            f"stage id {repeated[0]} is given {ids.count(repeated[0])} times in {stage_ranks!r}; "
            "each stage runs on exactly one rank."
        )
    if sorted(ids) != list(range(num_stages)):
        missing = sorted(set(range(num_stages)) - set(ids))
        extra = sorted(set(ids) - set(range(num_stages)))
        detail = f"missing {missing}" if missing else ""
        detail += (", " if missing and extra else "") + (f"unexpected {extra}" if extra else "")
        raise ValueError(
            f"stage ids must be 0..{num_stages - 1} with none skipped, got {sorted(ids)} "
            f"({detail}); number the stages consecutively from 0."
        )
    return tuple(rank for _, rank in sorted(pairs))


def _check_one_stage_per_rank(name: str, ranks: tuple[int, ...]) -> None:
    for rank in ranks:
        stages = [s for s, r in enumerate(ranks) if r == rank]
        if len(stages) > 1:
            raise ValueError(
                f"{name} runs one stage per rank, but rank {rank} holds stages {stages} in "
                f"stage_ranks={list(ranks)}; give each stage its own rank, or use "
                "'interleaved_1f1b' with stages dealt round-robin (e.g. [0, 1, 0, 1])."
            )


def _check_round_robin(ranks: tuple[int, ...], holders: list[int]) -> None:
    p = len(holders)
    expected = [holders[s % p] for s in range(len(ranks))]
    if len(ranks) % p or list(ranks) != expected:
        raise ValueError(
            f"interleaved_1f1b deals stages round-robin over its {p} ranks (stage s on "
            f"rank stage_ranks[s % {p}]), so stage_ranks should be {expected} with a multiple "
            f"of {p} stages; got {list(ranks)}."
        )
