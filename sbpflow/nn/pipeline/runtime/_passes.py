"""The passes over a micro-batch: its forward (``build``), and its full or split backward.

NOTE [deferred backward] and [split backward] in _scope.py say what each computes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._scope import Backward, MicroBatch, Phase, Scope
from ._weight_pass import WeightPass

__all__ = [
    "Build",
    "run_backward",
    "run_forward",
    "run_input_gradients",
    "run_stage_weight_gradients",
    "run_weight_gradients",
]

Build = Callable[..., Any]


def run_forward(scope: Scope, build: Build) -> None:
    """``build`` on the micro-batch, recording its backward (NOTE [deferred backward])."""
    mb = scope.mb
    scope.phase = Phase.FORWARD
    try:
        if mb.saved is None:
            mb.output = build(*mb.args, **mb.kwargs)
        else:
            with mb.saved.hooks():  # NOTE [saved tensors of a split micro-batch]
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
        if bw.inputs is None:
            torch.Tensor.backward(bw.tensor, bw.gradient, bw.retain_graph, bw.create_graph)
        else:
            _backward_into(bw, mb)


# NOTE [backward into some inputs]
# ``loss.backward(inputs=...)`` runs only the part of the graph that leads to the
# named tensors, and each rank decides that on its own graph. A rank holding a
# later stage sees the earlier stages as stand-ins (NOTE [stages held elsewhere]),
# so a parameter of an earlier stage is out of its reach: it would skip sending
# the gradient across the placement while the earlier stage's rank waits for it.
# So every rank also names every tensor that crossed a placement in the
# micro-batch: all ranks then run every change of placement's backward, the
# messages of the full backward in its order, and the named tensors get exactly
# the gradients they get in one process. Autograd accumulates a named tensor's
# gradient into its ``.grad``; the crossed tensors' ``.grad`` are put back as
# they were, so only what the user named changes. A crossed leaf (a tied weight
# used on another stage) is left out on every rank: only its own gradient lies
# beyond that crossing, and naming it would run its gradient hooks.
def _backward_into(bw: Backward, mb: MicroBatch) -> None:
    named = _as_list(bw.inputs)
    crossed = [t for t in mb.crossed if t.grad_fn is not None and not any(t is n for n in named)]
    with warnings.catch_warnings():  # reading a non-leaf tensor's .grad warns
        warnings.simplefilter("ignore", UserWarning)
        before = [t.grad for t in crossed]
    inputs = _with_pieces(named, mb) + crossed
    torch.Tensor.backward(bw.tensor, bw.gradient, bw.retain_graph, bw.create_graph, inputs)
    for t, grad in zip(crossed, before, strict=True):
        t.grad = grad


def _as_list(inputs: Any) -> list[torch.Tensor]:
    return [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)


def _with_pieces(inputs: Any, mb: MicroBatch) -> list[torch.Tensor]:
    """``backward``'s ``inputs`` with the pieces of each parameter a stage computed with on
    its piece added (NOTE [parameter pieces are leaves] in _held_here.py)."""
    given = _as_list(inputs)
    pieces: dict[int, list[torch.Tensor]] = {}
    for param, piece in mb.pieces:
        pieces.setdefault(id(param), []).append(piece)
    return [each for t in given for each in (t, *pieces.get(id(t), ()))]


def run_input_gradients(mb: MicroBatch) -> None:
    """I: the gradients of every tensor that crossed a placement (NOTE [split backward]),
    keeping what the weight pass needs (NOTE [weight pass] in _weight_pass.py)."""
    for bw in mb.backwards:
        _check_splittable(bw)
    if not mb.crossed:
        return
    outputs = [bw.tensor for bw in mb.backwards]
    gradients = [bw.gradient for bw in mb.backwards]
    inputs = _with_pieces(mb.crossed, mb)  # a crossed parameter's gradient inside its stage too
    saved, weights = mb.saved, None
    if saved is not None:
        weights = WeightPass(outputs, gradients, inputs, mb.no_gradient)
        if saved.windowed and not weights.split(saved.window_of):
            weights = None  # NOTE [weight pass on several stages] in _workers.py
    if weights is None:  # the weight pass runs the backward again
        torch.autograd.grad(outputs, inputs, gradients, retain_graph=True, allow_unused=True)
        return
    # Set before I runs: on a rank holding several stages, the weight pass of a later stage
    # may run while I waits for this rank's next stage (NOTE [weight pass on several stages]).
    mb.weight_pass = weights
    with weights:
        grads = torch.autograd.grad(
            outputs, inputs, gradients, retain_graph=True, allow_unused=True
        )
    weights.complete(grads)


def run_stage_weight_gradients(mb: MicroBatch, window: int) -> None:
    """W of one stage on a rank holding several, not the micro-batch's last: the weight pass
    of that stage's window only, freeing its saved tensors when none of it is left (NOTE
    [weight pass on several stages] in _workers.py)."""
    weights = mb.weight_pass
    if weights is not None and weights.run_window(window) and mb.saved is not None:
        mb.saved.release(window)


def run_weight_gradients(mb: MicroBatch) -> None:
    """W: the weight gradients, from the gradients the input pass kept (NOTE [weight pass]
    in _weight_pass.py); or the rest of the backward, replaying what I moved, when it kept
    none (NOTE [split backward])."""
    weights, mb.weight_pass = mb.weight_pass, None
    if weights is not None and weights.completed:
        weights.run_all()
        return
    retain = any(bw.retain_graph for bw in mb.backwards)
    outputs = [bw.tensor for bw in mb.backwards]
    gradients = [bw.gradient for bw in mb.backwards]
    if weights is None or not weights.any_run:
        torch.autograd.backward(outputs, gradients, retain_graph=retain)
    else:  # the groups run so far are done: the other groups' weights only
        left = weights.weights()
        if left:
            torch.autograd.backward(outputs, gradients, retain_graph=retain, inputs=left)


def _check_splittable(bw: Backward) -> None:
    if bw.create_graph or bw.inputs is not None:
        raise ValueError(
            "a zero-bubble schedule splits loss.backward() into its input- and weight-gradient "
            f"halves, so it runs it without options; got create_graph={bw.create_graph}, "
            f"inputs={bw.inputs!r}. Call loss.backward() with no options, or use '1f1b'."
        )
