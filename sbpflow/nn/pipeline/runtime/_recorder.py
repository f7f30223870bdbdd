"""What this rank ran in a pipelined step, with times: the runtime's side of ``StepRecord``."""

from __future__ import annotations

from collections.abc import Sequence

from ..schedules import Action, ActionKind, ActionTiming, Message
from ._stages import Stage
from ._transfers import Message as Transfer

__all__ = ["Recorder"]


class Recorder:
    """The actions this rank ran, each with the messages it sent and received."""

    def __init__(self, rank: int, stages: Sequence[Stage]) -> None:
        self.rank = rank
        self.timings: list[ActionTiming] = []
        self.messages: list[Message] = []
        self._pending: list[Transfer] = []
        # A peer as the schedule names it: the first rank of its stage's placement.
        self._holder = {
            r: stage.placement.flat_ranks[0] for stage in stages for r in stage.placement.flat_ranks
        }

    def observe(self, message: Transfer) -> None:
        self._pending.append(message)

    def add(self, action: Action, start: float, end: float) -> None:
        found, self._pending = self._pending, []
        recv_kind, send_kind = (
            (ActionKind.RECV_ACTIVATION, ActionKind.SEND_ACTIVATION)
            if action.kind is ActionKind.FORWARD
            else (ActionKind.RECV_GRAD, ActionKind.SEND_GRAD)
        )
        waited = 0.0
        recvs: dict[int, tuple[float, float]] = {}
        sends: dict[int, float] = {}
        for m in found:
            self.messages.append(
                Message(self.rank, action, m.direction, m.peer, m.nbytes, m.start, m.end)
            )
            peer = self._holder.get(m.peer, m.peer)
            if m.direction == "recv":
                waited += m.end - m.start
                first, last = recvs.get(peer, (m.start, m.end))
                recvs[peer] = (min(first, m.start), max(last, m.end))
            else:
                sends.setdefault(peer, m.start)
        s, k = action.stage, action.microbatch
        for peer, (first, last) in recvs.items():
            self.timings.append(ActionTiming(self.rank, Action(recv_kind, s, k, peer), first, last))
        self.timings.append(ActionTiming(self.rank, action, min(start + waited, end), end))
        for peer, posted in sends.items():
            self.timings.append(
                ActionTiming(self.rank, Action(send_kind, s, k, peer), posted, posted)
            )
