"""Watching a pipelined step from the outside: what each rank computed, in what order, and
how many micro-batches' activations each stage held.

The runtime keeps its own record of what it ran (``graph.last_step()``); a test that
compares that record with the schedule checks the runtime against its own copy of the
plan. These probes sit in the model instead, where the work happens, and see it the way a
user's module would:

- ``ObservedStage`` wraps a stage's layers between two autograd Functions. On a rank that
  holds the stage (its pieces are not empty) the one at the input logs ``F`` with a
  fingerprint of the input (the sum of its local values); the one at the output logs
  ``O`` in backward, when the gradient of the stage's output arrives (a full backward B,
  an input half I that computes inside the stage, a weight half W when I did not), and
  links the input's fingerprint to the output's.
- ``at_loss`` marks the model's output: every rank, holding the last stage or not, logs
  ``L`` each time a backward pass starts from the loss (B or I; a weight half that runs the
  backward again from the loss instead of reusing what I computed logs a second one).
- The micro-batch of each event is found from the data, not from the runtime: the first
  stage's input fingerprints are those of the batch's slices, and each later stage's input
  is the previous stage's output (same values, same fingerprint).
- The output Function saves a marker tensor for backward: it lives from the end of the
  stage's forward until the backward that frees the stage's graph runs (B, or W for a
  split backward), so the markers alive per stage are the micro-batches it holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import sbpflow
from sbpflow.nn.pipeline import Action, ActionKind

Event = tuple[Any, ...]
_I, _W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT

_state: dict[str, Any] = {"log": None, "live": {}, "peak": {}, "held": 0, "held_peak": 0}


def start(log: bool = True) -> None:
    """Reset the counters; log events from now on (or not)."""
    _state.update(log=[] if log else None, live={}, peak={}, held=0, held_peak=0)


def events() -> list[Event]:
    return list(_state["log"] or [])


def peaks() -> tuple[dict[int, int], int]:
    """Per stage, the most markers alive at once; and the most over all stages of this rank."""
    return dict(_state["peak"]), _state["held_peak"]


def _fingerprint(x: torch.Tensor) -> float | None:
    local = x.to_local() if isinstance(x, sbpflow.GlobalTensor) else x
    return None if local.numel() == 0 else float(local.detach().sum())


def _log(*event: Any) -> None:
    if _state["log"] is not None:
        _state["log"].append(event)


def _released(stage: int) -> None:
    _state["live"][stage] -= 1
    _state["held"] -= 1


class _In(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stage: int, fp: float | None) -> torch.Tensor:
        if fp is not None:
            _log("F", stage, fp)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _Out(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, stage: int, fp: float | None) -> torch.Tensor:
        ctx.stage, ctx.fp = stage, fp
        marker = torch.empty(0)
        ctx.save_for_backward(marker)
        if fp is not None:  # this rank holds the stage
            _log("link", stage, fp, _fingerprint(y))
            live = _state["live"]
            live[stage] = live.get(stage, 0) + 1
            _state["peak"][stage] = max(_state["peak"].get(stage, 0), live[stage])
            _state["held"] += 1
            _state["held_peak"] = max(_state["held_peak"], _state["held"])
            weakref.finalize(marker, _released, stage)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.fp is not None:
            _log("O", ctx.stage, ctx.fp)
        return grad, None, None


class ObservedStage(nn.Module):
    """``layers`` between the two probes; ``stage`` is the stage id."""

    def __init__(self, stage: int, layers: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp = _fingerprint(x)
        return _Out.apply(self.layers(_In.apply(x, self.stage, fp)), self.stage, fp)


class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _log("L")
        return grad


def at_loss(y: torch.Tensor) -> torch.Tensor:
    """``y`` (the model's output), logging ``L`` whenever a backward pass runs through it."""
    return _Loss.apply(y)


def backwards_from_loss(events: Sequence[Event]) -> int:
    """How many backward passes ran from the loss (``at_loss``) in ``events``."""
    return sum(1 for e in events if e[0] == "L")


def observed_order(
    events_by_rank: Sequence[Sequence[Event]], first_inputs: Sequence[float]
) -> list[list[tuple[str, int, int]]]:
    """Each rank's ``(F or O, stage, micro-batch)`` in the order it happened.

    ``first_inputs[k]``: the fingerprint of micro-batch k's input to stage 0.
    """
    microbatch = {(0, fp): k for k, fp in enumerate(first_inputs)}
    links = sorted((e for log in events_by_rank for e in log if e[0] == "link"), key=lambda e: e[1])
    for _, stage, fp_in, fp_out in links:  # stage order: each input known before its output
        microbatch[(stage + 1, fp_out)] = microbatch[(stage, fp_in)]
    return [
        [(e[0], e[1], microbatch[(e[1], e[2])]) for e in log if e[0] in ("F", "O")]
        for log in events_by_rank
    ]


def expected_order(
    actions: Sequence[Action], input_half_reaches_first_stage: bool, whole_weight_pass: bool
) -> list[tuple[str, int, int]]:
    """What the probes see of a rank's compute actions, run in that order.

    F logs F; B reaches the stage's output gradient (O); so does I, except on the first
    stage, whose input needs no gradient, when no weight of it crossed to another placement
    (then I has nothing to compute inside the stage). W starts from the gradients I kept
    inside the stage (NOTE [weight pass] in sbpflow/nn/pipeline/runtime/_weight_pass.py),
    so it reaches O only where I did not: it then starts from the stage's output. With
    ``whole_weight_pass`` (a rank holding only the first stage, or several stages whose
    weight pass cannot be split by stage: NOTE [weight pass on several stages] in
    sbpflow/nn/pipeline/runtime/_workers.py) W runs the backward again and reaches O. In a
    micro-batch whose backward this rank splits, a B runs as its I and then its W (NOTE
    [several stages on a rank] in the same file).
    """
    split = {a.microbatch for a in actions if a.kind in (_I, _W)}
    seen: list[tuple[str, int, int]] = []

    def reaches(kind: ActionKind, stage: int) -> bool:
        input_half = stage > 0 or input_half_reaches_first_stage
        if kind is _I:
            return input_half
        return kind is not _W or whole_weight_pass or not input_half

    for a in actions:
        if a.kind is ActionKind.FORWARD:
            seen.append(("F", a.stage, a.microbatch))
            continue
        halves = (_I, _W) if a.kind is ActionKind.BACKWARD and a.microbatch in split else (a.kind,)
        seen += [("O", a.stage, a.microbatch) for kind in halves if reaches(kind, a.stage)]
    return seen


def check_order(
    observed: Sequence[Sequence[tuple[str, int, int]]],
    expected: Sequence[Sequence[tuple[str, int, int]]],
) -> None:
    """Raise ``AssertionError`` naming the first difference of the first rank that differs."""
    for rank, (got, want) in enumerate(zip(observed, expected, strict=True)):
        if list(got) != list(want):
            at = next(
                (i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                min(len(got), len(want)),
            )
            raise AssertionError(
                f"rank {rank} ran another order than its schedule: at step {at} it ran "
                f"{list(got[at : at + 3])}, the schedule says {list(want[at : at + 3])}"
            )
