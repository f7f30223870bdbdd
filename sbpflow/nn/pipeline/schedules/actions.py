"""What a rank does in a pipeline step: one small value per action.

A schedule is a list of these per rank. Compute actions run a stage on one
micro-batch; transfer actions move a stage boundary's tensor between ranks.
``stage`` is always the stage *on the rank running the action*: ``SEND_F3s1>r2``
sends stage 1's output for micro-batch 3 to rank 2, where ``RECV_F3s2<r1``
receives it as stage 2's input. Gradients flow the other way (``SEND_B`` /
``RECV_B``). Adjacent stages on the same rank hand tensors over locally, with
no transfer action.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Action", "ActionKind"]


class ActionKind(enum.Enum):
    """The kinds of action, with the short code each prints as."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # input gradient only (zero bubble); its W comes later
    BACKWARD_WEIGHT = "W"  # weight gradient only
    SEND_ACTIVATION = "SEND_F"
    RECV_ACTIVATION = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_transfer(self) -> bool:
        return not self.is_compute

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRAD)


_COMPUTE = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)


@dataclass(frozen=True)
class Action:
    """One action: its kind, the stage and micro-batch it is for, and the peer rank of a transfer.

    ``str`` is short: ``F3s1`` is the forward of micro-batch 3 on stage 1;
    ``B``, ``I`` and ``W`` are the full, input-grad and weight-grad backwards;
    ``SEND_F3s1>r2`` / ``RECV_B3s1<r2`` are transfers with their peer.
    """

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind.is_transfer and self.peer is None:
            raise ValueError(
                f"a {self.kind.name.lower()} action needs the peer rank, got peer=None "
                f"for stage {self.stage}, micro-batch {self.microbatch}; pass peer=<rank>."
            )
        if self.kind.is_compute and self.peer is not None:
            raise ValueError(
                f"a {self.kind.name.lower()} action runs locally and takes no peer, got "
                f"peer={self.peer}; drop it."
            )

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.microbatch}s{self.stage}"
        if self.kind.is_send:
            return f"{text}>r{self.peer}"
        if self.kind.is_recv:
            return f"{text}<r{self.peer}"
        return text

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f", peer={self.peer}"
        return f"Action({self.kind.name}, stage={self.stage}, microbatch={self.microbatch}{peer})"


def forward(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.FORWARD, stage, microbatch)


def backward(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.BACKWARD, stage, microbatch)


def backward_input(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.BACKWARD_INPUT, stage, microbatch)


def backward_weight(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.BACKWARD_WEIGHT, stage, microbatch)
