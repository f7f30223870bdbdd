"""``build_schedule``: check the arguments, lay out each rank's compute order, add transfers, validate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import _orders
from ._validate import validate
from .actions import Action, ActionKind
from .schedule import Schedule

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULE_NAMES", "build_schedule"]

SCHEDULE_NAMES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "zero_bubble",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv",
    "dualpipev",
)
DEFAULT_SCHEDULE = "1f1b"
# How a schedule lays its stages on its ranks: one each; dealt round-robin (stage s on
# the (s % p)-th rank); or two each as a V (stage s and 2p-1-s on the same rank).
# zero_bubble takes one stage per rank, or several dealt round-robin (then it runs
# interleaved_zero_bubble's order).
_ROUND_ROBIN = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
_V_SHAPED = ("zbv", "dualpipev")

StageRanks = Sequence[int] | Mapping[int, int] | Sequence[tuple[int, int]]


def build_schedule(
    name: str, num_stages: int, stage_ranks: StageRanks, num_microbatches: int
) -> Schedule:
    """The validated schedule ``name`` for ``num_microbatches`` micro-batches through ``num_stages`` stages.

    ``stage_ranks`` says where each stage runs: a list (stage ``s`` on
    ``stage_ranks[s]``), a ``{stage_id: rank}`` mapping, or ``(stage_id, rank)``
    pairs; stage ids must be exactly ``0..num_stages-1``. ``gpipe`` and
    ``1f1b`` run one stage per rank; ``interleaved_1f1b``, ``looped_bfs`` and
    ``interleaved_zero_bubble`` deal the stages round-robin over their ranks
    (``[0, 1, 0, 1]``: ranks 0 and 1 hold two stages each), ``zero_bubble``
    takes either; ``zbv`` and ``dualpipev`` put two stages on each rank as a V
    (``[0, 1, 1, 0]``: rank 0 holds the first and the last stage). Pure: needs
    no process group.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULE_NAMES)}."
        )
    num_stages = _count("num_stages", num_stages)
    num_microbatches = _count("num_microbatches", num_microbatches)
    ranks = _stage_ranks(stage_ranks, num_stages)
    holders = list(dict.fromkeys(ranks))
    p, v, m = len(holders), num_stages // len(holders), num_microbatches
    if name in _V_SHAPED:
        _check_v_shape(name, ranks, holders)
    elif name in _ROUND_ROBIN or (name == "zero_bubble" and len(holders) < len(ranks)):
        _check_round_robin(name, ranks, holders)
    else:
        _check_one_stage_per_rank(name, ranks)
    _check_microbatches(name, num_stages, p, m, v)
    orders = _orders_of(name, p, v, m)
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


def _orders_of(name: str, p: int, v: int, m: int) -> list[list[Action]]:
    if name == "gpipe":
        return _orders.gpipe(p, m)
    if name == "1f1b":
        return _orders.one_f_one_b(p, m)
    if name == "interleaved_1f1b":
        return _orders.interleaved_1f1b(p, v, m)
    if name == "zero_bubble":
        return _orders.zero_bubble(p, m) if v == 1 else _orders.interleaved_zero_bubble(p, v, m)
    if name == "looped_bfs":
        return _orders.looped_bfs(p, v, m)
    if name == "interleaved_zero_bubble":
        return _orders.interleaved_zero_bubble(p, v, m)
    if name == "zbv":
        return _orders.zbv(p, m)
    assert name == "dualpipev", name
    return _orders.dualpipev(p, m)


def _check_microbatches(name: str, num_stages: int, p: int, m: int, v: int) -> None:
    """Raise ``ValueError`` for a micro-batch count the schedule cannot run."""
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches to be a multiple of the number of "
            f"pipeline ranks ({p}), got {m}; use {max(p, m // p * p)} or {(m // p + 1) * p}."
        )
    rounds = max(1, m // p)
    if (name == "interleaved_zero_bubble" or (name == "zero_bubble" and v > 1)) and m % rounds:
        raise ValueError(
            f"{name} with {v} stages per rank runs the micro-batches in rounds of about {p} "
            f"(the number of pipeline ranks), so num_microbatches must be a multiple of "
            f"num_microbatches // {p} = {rounds}, got {m}; use {m // p * p} or "
            f"{(m // p + 1) * p}."
        )
    least = {"1f1b": num_stages, "zero_bubble": num_stages, "dualpipev": num_stages}.get(name, 1)
    if name == "zero_bubble" and v > 1:
        least = 1
    if m < least:
        raise ValueError(
            f"{name} needs at least as many micro-batches as stages ({num_stages}), got "
            f"num_microbatches={m}; use more micro-batches or 'gpipe'."
        )


def _check_one_stage_per_rank(name: str, ranks: tuple[int, ...]) -> None:
    for rank in ranks:
        stages = [s for s, r in enumerate(ranks) if r == rank]
        if len(stages) > 1:
            raise ValueError(
                f"{name} runs one stage per rank, but rank {rank} holds stages {stages} in "
                f"stage_ranks={list(ranks)}; give each stage its own rank, or use "
                "'interleaved_1f1b' with stages dealt round-robin (e.g. [0, 1, 0, 1])."
            )


def _check_round_robin(name: str, ranks: tuple[int, ...], holders: list[int]) -> None:
    p = len(holders)
    expected = [holders[s % p] for s in range(len(ranks))]
    if len(ranks) % p or list(ranks) != expected:
        raise ValueError(
            f"{name} deals stages round-robin over its {p} ranks (stage s on "
            f"rank stage_ranks[s % {p}]), so stage_ranks should be {expected} with a multiple "
            f"of {p} stages; got {list(ranks)}."
        )


def _check_v_shape(name: str, ranks: tuple[int, ...], holders: list[int]) -> None:
    p = len(holders)
    expected = holders + holders[::-1]
    if list(ranks) != expected:
        raise ValueError(
            f"{name} puts two stages on each of its {p} ranks as a V (stage s and stage "
            f"{2 * p - 1} - s on the same rank), so stage_ranks should be {expected}; got "
            f"{list(ranks)}."
        )
