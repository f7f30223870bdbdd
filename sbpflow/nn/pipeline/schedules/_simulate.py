"""Run per-rank action lists on a clock: sends never block, a receive waits for its message.

The one engine behind ``Schedule.simulate`` (timings), the text table (unit
time) and ``validate``'s deadlock check (a rank that can never get past a
receive). Pure: no process group, no tensors.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .actions import Action, ActionKind

# A message: (what, receiving stage, micro-batch, source rank, destination rank).
MessageKey = tuple[str, int, int, int, int]


def message_key(rank: int, action: Action) -> MessageKey:
    """The message a send posts or a receive waits for; a send and its receive share the key."""
    assert action.peer is not None
    if action.kind is ActionKind.SEND_ACTIVATION:
        return ("activation", action.stage + 1, action.microbatch, rank, action.peer)
    if action.kind is ActionKind.RECV_ACTIVATION:
        return ("activation", action.stage, action.microbatch, action.peer, rank)
    if action.kind is ActionKind.SEND_GRAD:
        return ("grad", action.stage - 1, action.microbatch, rank, action.peer)
    if action.kind is ActionKind.RECV_GRAD:
        return ("grad", action.stage, action.microbatch, action.peer, rank)
    raise AssertionError(f"{action} is not a transfer")


@dataclass(frozen=True)
class Run:
    """What the clock saw: ``(rank, action, start, end)`` per action run, and who got stuck.

    ``stuck`` maps each rank that could not finish to the index of the
    receive it waits on forever (empty when every rank finished).
    """

    timings: tuple[tuple[int, Action, float, float], ...]
    stuck: Mapping[int, int]


def run(
    actions: Mapping[int, Sequence[Action]],
    duration: Callable[[Action], float],
    comm_time: float = 0.0,
) -> Run:
    clock = dict.fromkeys(actions, 0.0)
    position = dict.fromkeys(actions, 0)
    mailbox: dict[MessageKey, deque[float]] = defaultdict(deque)  # arrival times
    timings: list[tuple[int, Action, float, float]] = []
    progress = True
    while progress:
        progress = False
        for rank, todo in actions.items():
            while position[rank] < len(todo):
                action = todo[position[rank]]
                start = clock[rank]
                if action.kind.is_recv:
                    queue = mailbox[message_key(rank, action)]
                    if not queue:
                        break  # blocked until the sender gets there
                    clock[rank] = max(start, queue.popleft())
                elif action.kind.is_send:
                    mailbox[message_key(rank, action)].append(start + comm_time)
                else:
                    clock[rank] = start + duration(action)
                timings.append((rank, action, start, clock[rank]))
                position[rank] += 1
                progress = True
    stuck = {rank: position[rank] for rank, todo in actions.items() if position[rank] < len(todo)}
    return Run(tuple(timings), stuck)


def describe(actions: Mapping[int, Sequence[Action]], done: Run) -> str:
    """Where each rank that could not finish waits (for a deadlock message)."""
    waits = "; ".join(
        f"rank {rank} waits at {actions[rank][i]} (position {i})" for rank, i in done.stuck.items()
    )
    return f"deadlock with blocking receives: {waits}"
