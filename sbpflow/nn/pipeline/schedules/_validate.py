"""``validate``: a schedule computes every micro-batch once, in a legal order, without deadlock.

Checks run from the cheapest to the most global and the first problem found
is raised as a ``ValueError``:
  1. shape       stage_ranks has num_stages entries; one list per rank that holds a stage
  2. actions     stages and micro-batches in range, each on the rank holding its stage,
                 transfers addressed to the adjacent stage's rank; no action twice
  3. coverage    each (stage, micro-batch) has one F and either one B or one I and one W
  4. matching    every receive has its send on the peer, every send its receive
  5. order       on each rank, an action comes after what it reads (F after its input
                 arrives, B/I after F and after the incoming grad, W after I, a send
                 after the compute producing it)
  6. deadlock    the lists run with blocking receives and non-blocking sends finish
  7. fifo        between two ranks, the activations (and the gradients) are received
                 in the order they are sent: the runtime's transfers are matched per
                 pair and lane in posting order (NOTE [deferred sends] and [lanes] in
                 nn/pipeline/runtime/_transfers.py), with no tag to tell them apart
"""

from __future__ import annotations

from collections import Counter

from . import _simulate
from .actions import Action, ActionKind
from .schedule import Schedule

__all__ = ["validate"]

_F = ActionKind.FORWARD
_B = ActionKind.BACKWARD
_I = ActionKind.BACKWARD_INPUT
_W = ActionKind.BACKWARD_WEIGHT


def validate(schedule: Schedule) -> None:
    """Raise ``ValueError`` describing the first problem of ``schedule``; return if it is sound."""
    for check in (_shape, _actions, _coverage, _matching, _order, _deadlock, _fifo):
        problem = check(schedule)
        if problem:
            raise ValueError(f"invalid pipeline schedule {schedule.name!r}: {problem}")


def _shape(sch: Schedule) -> str | None:
    if len(sch.stage_ranks) != sch.num_stages:
        return (
            f"stage_ranks has {len(sch.stage_ranks)} entries for {sch.num_stages} stages; "
            "it needs one rank per stage."
        )
    if sch.num_stages < 1 or sch.num_microbatches < 1:
        return f"needs at least one stage and one micro-batch, got {sch.num_stages} and {sch.num_microbatches}."
    holders, listed = set(sch.stage_ranks), set(sch.actions)
    if holders != listed:
        return (
            f"action lists are for ranks {sorted(listed)} but stages are held by ranks "
            f"{sorted(holders)}; give each rank holding a stage exactly one list."
        )
    return None


def _actions(sch: Schedule) -> str | None:
    S, m, ranks = sch.num_stages, sch.num_microbatches, sch.stage_ranks
    for rank, todo in sch.actions.items():
        for i, a in enumerate(todo):
            where = f"{a} at position {i} on rank {rank}"
            if not isinstance(a, Action):
                return f"rank {rank}'s list holds {a!r} at position {i}, not an Action."
            if not (0 <= a.stage < S and 0 <= a.microbatch < m):
                return f"{where} is out of range: stages are 0..{S - 1}, micro-batches 0..{m - 1}."
            if ranks[a.stage] != rank:
                return f"{where} belongs on rank {ranks[a.stage]}, which holds stage {a.stage}."
            if a.kind.is_transfer:
                upstream = a.kind in (ActionKind.RECV_ACTIVATION, ActionKind.SEND_GRAD)
                other = a.stage - 1 if upstream else a.stage + 1
                if not 0 <= other < S:
                    return f"{where} has no {'previous' if upstream else 'next'} stage to talk to."
                if ranks[other] == rank:
                    return f"{where} transfers to stage {other} on its own rank; adjacent stages on one rank hand over locally."
                if a.peer != ranks[other]:
                    return f"{where} names peer rank {a.peer}, but stage {other} is on rank {ranks[other]}."
        twice = [a for a, n in Counter(todo).items() if n > 1]
        if twice:
            return f"{twice[0]} appears {Counter(todo)[twice[0]]} times on rank {rank}."
    return None


def _coverage(sch: Schedule) -> str | None:
    seen: dict[tuple[ActionKind, int, int], int] = {}
    for rank, todo in sch.actions.items():
        for a in todo:
            if a.is_compute:
                seen[(a.kind, a.stage, a.microbatch)] = rank
    for s in range(sch.num_stages):
        for k in range(sch.num_microbatches):
            has = {kind for kind in (_F, _B, _I, _W) if (kind, s, k) in seen}
            what = f"micro-batch {k} on stage {s} (rank {sch.stage_ranks[s]})"
            if _F not in has:
                return f"{what} never runs its forward (F{k}s{s})."
            if _B in has and has & {_I, _W}:
                return f"{what} runs a full backward B and split halves I/W; use one or the other."
            if _B not in has and has & {_I, _W} != {_I, _W}:
                missing = sorted(kind.value for kind in {_B, _I, _W} - has)
                if has & {_I, _W}:
                    return f"{what} runs {'I' if _I in has else 'W'} without its other half {missing[-1]}."
                return f"{what} never runs its backward (B{k}s{s})."
    return None


def _matching(sch: Schedule) -> str | None:
    sends: dict[_simulate.MessageKey, tuple[int, Action]] = {}
    recvs: dict[_simulate.MessageKey, tuple[int, Action]] = {}
    for rank, todo in sch.actions.items():
        for a in todo:
            if a.kind.is_send:
                sends[_simulate.message_key(rank, a)] = (rank, a)
            elif a.kind.is_recv:
                recvs[_simulate.message_key(rank, a)] = (rank, a)
    for key, (rank, a) in recvs.items():
        if key not in sends:
            return (
                f"{a} on rank {rank} has no matching send: rank {a.peer} never runs "
                f"{_counterpart(a, rank)}, so the receive would wait forever."
            )
    for key, (rank, a) in sends.items():
        if key not in recvs:
            return f"{a} on rank {rank} is never received: rank {a.peer} has no {_counterpart(a, rank)}."
    return None


def _counterpart(a: Action, rank: int) -> Action:
    flip = {
        ActionKind.SEND_ACTIVATION: (ActionKind.RECV_ACTIVATION, 1),
        ActionKind.RECV_ACTIVATION: (ActionKind.SEND_ACTIVATION, -1),
        ActionKind.SEND_GRAD: (ActionKind.RECV_GRAD, -1),
        ActionKind.RECV_GRAD: (ActionKind.SEND_GRAD, 1),
    }
    kind, step = flip[a.kind]
    return Action(kind, a.stage + step, a.microbatch, peer=rank)


def _order(sch: Schedule) -> str | None:
    S = sch.num_stages
    for rank, todo in sch.actions.items():
        at = {a: i for i, a in enumerate(todo)}
        for i, a in enumerate(todo):
            s, k = a.stage, a.microbatch
            needs: list[tuple[list[Action], str]] = []
            if a.kind is _F and s > 0:
                needs = [
                    ([_input_of(sch, rank, a)], "reads its input activation before it arrives")
                ]
            elif a.kind in (_B, _I):
                needs = [([Action(_F, s, k)], "runs before its forward")]
                if s < S - 1:
                    needs.append(
                        ([_grad_of(sch, rank, a)], "runs before its incoming grad arrives")
                    )
            elif a.kind is _W:
                needs = [([Action(_I, s, k)], "runs before its input-grad half I")]
            elif a.kind is ActionKind.SEND_ACTIVATION:
                needs = [([Action(_F, s, k)], "sends an activation not computed yet")]
            elif a.kind is ActionKind.SEND_GRAD:
                needs = [([Action(_B, s, k), Action(_I, s, k)], "sends a grad not computed yet")]
            for options, why in needs:
                found = [at[n] for n in options if n in at]
                if found and min(found) < i:
                    continue
                if found:
                    where = f"{todo[min(found)]} comes later, at position {min(found)}"
                else:
                    where = " or ".join(map(str, options)) + " is not on this rank"
                return f"{a} at position {i} on rank {rank} {why}: {where}."
    return None


def _input_of(sch: Schedule, rank: int, a: Action) -> Action:
    """What a forward on stage s > 0 reads: the local F of stage s-1, or a receive."""
    prev = a.stage - 1
    if sch.stage_ranks[prev] == rank:
        return Action(_F, prev, a.microbatch)
    return Action(ActionKind.RECV_ACTIVATION, a.stage, a.microbatch, peer=sch.stage_ranks[prev])


def _grad_of(sch: Schedule, rank: int, a: Action) -> Action:
    """What a backward on stage s < S-1 reads: the local B/I of stage s+1, or a receive."""
    nxt = a.stage + 1
    if sch.stage_ranks[nxt] == rank:
        local = [Action(_B, nxt, a.microbatch), Action(_I, nxt, a.microbatch)]
        return next((b for b in local if b in sch.actions[rank]), local[0])
    return Action(ActionKind.RECV_GRAD, a.stage, a.microbatch, peer=sch.stage_ranks[nxt])


def _deadlock(sch: Schedule) -> str | None:
    done = _simulate.run(sch.actions, lambda action: 1.0)
    if not done.stuck:
        return None
    return (
        f"{_simulate.describe(sch.actions, done)}; each waits for a send its peer only "
        "reaches after its own blocked receive. Reorder so one side sends first."
    )


def _fifo(sch: Schedule) -> str | None:
    Lane = tuple[int, int, str]  # (sending rank, receiving rank, "activation" or "grad")
    sent: dict[Lane, list[_simulate.MessageKey]] = {}
    received: dict[Lane, list[tuple[_simulate.MessageKey, Action]]] = {}
    for rank, todo in sch.actions.items():
        for a in todo:
            if a.kind.is_transfer:
                key = _simulate.message_key(rank, a)
                what, _, _, src, dst = key
                if a.kind.is_send:
                    sent.setdefault((src, dst, what), []).append(key)
                else:
                    received.setdefault((src, dst, what), []).append((key, a))
    for (src, dst, what), keys in sorted(received.items()):
        order = sent.get((src, dst, what), [])
        for i, (key, a) in enumerate(keys):
            if i >= len(order) or order[i] != key:
                return (
                    f"rank {dst} receives {a} as its message number {i} from rank {src}, but "
                    f"rank {src} sends its messages to rank {dst} in another order (counting "
                    f"{what}s only: the {what}s one rank sends another are matched in the order "
                    "they are posted); receive them in the order they are sent."
                )
    return None
