"""The passes over a micro-batch: its forward (``build``), and its full or split backward.

NOTE [deferred backward] and [split backward] in _scope.py say what each computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._scope import Backward, MicroBatch, Phase, Scope

__all__ = ["Build", "run_backward", "run_forward", "run_input_gradients", "run_weight_gradients"]

Build = Callable[..., Any]


def run_forward(scope: Scope, build: Build) -> None:
    """``build`` on the micro-batch, recording its backward (NOTE [deferred backward])."""
    mb = scope.mb
    scope.phase = Phase.FORWARD
    try:
        mb.output = build(*mb.args, **mb.kwargs)
    finally:
        scope.phase = Phase.IDLE
    if not mb.backwards:
        raise ValueError(
            f"build did not call backward on micro-batch {mb.index}: a pipelined step runs "
            "each micro-batch's backward when the schedule says, so build must call "
            "loss.backward() (or scaler.scale(loss).backward()) on the global loss, which the "
            "graph records. Call loss.backward() in build before returning the loss."
        )


def run_backward(mb: MicroBatch) -> None:
    """The micro-batch's recorded backward calls, run whole."""
    for bw in mb.backwards:
        inputs = _with_pieces(bw.inputs, mb) if bw.inputs is not None else None
        torch.Tensor.backward(bw.tensor, bw.gradient, bw.retain_graph, bw.create_graph, inputs)


def _with_pieces(inputs: Any, mb: MicroBatch) -> list[torch.Tensor]:
    """``backward``'s ``inputs`` with the pieces of each parameter a stage computed with on
    its piece added (NOTE [parameter pieces are leaves] in _held_here.py)."""
    given = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    pieces: dict[int, list[torch.Tensor]] = {}
    for param, piece in mb.pieces:
        pieces.setdefault(id(param), []).append(piece)
    return [each for t in given for each in (t, *pieces.get(id(t), ()))]


def run_input_gradients(mb: MicroBatch) -> None:
    """I: the gradients of every tensor that crossed a placement (NOTE [split backward])."""
    for bw in mb.backwards:
        _check_splittable(bw)
    if not mb.crossed:
        return
    torch.autograd.grad(
        [bw.tensor for bw in mb.backwards],
        _with_pieces(mb.crossed, mb),  # a crossed parameter's gradient inside its stage too
        [bw.gradient for bw in mb.backwards],
        retain_graph=True,
        allow_unused=True,
    )


def run_weight_gradients(mb: MicroBatch) -> None:
    """W: the rest of the backward (the weight gradients), replaying what I moved (NOTE [split backward])."""
    retain = any(bw.retain_graph for bw in mb.backwards)
    torch.autograd.backward(
        [bw.tensor for bw in mb.backwards],
        [bw.gradient for bw in mb.backwards],
        retain_graph=retain,
    )


def _check_splittable(bw: Backward) -> None:
    if bw.create_graph or bw.inputs is not None:
        raise ValueError(
            "a zero-bubble schedule splits loss.backward() into its input- and weight-gradient "
            f"halves, so it runs it without options; got create_graph={bw.create_graph}, "
            f"inputs={bw.inputs!r}. Call loss.backward() with no options, or use '1f1b'."
        )
