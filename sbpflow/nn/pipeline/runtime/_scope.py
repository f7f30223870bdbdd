"""One micro-batch of a pipelined step, and the scope its work runs in (NOTE [pipeline step context]).

# NOTE [deferred backward]
# ``build`` is the user's whole step on one micro-batch: forward through every
# stage, the loss, ``loss.backward()``. While the runtime runs ``build`` (the
# forward phase of the micro-batch's scope), ``GlobalTensor.backward`` (also
# ``scaler.scale(loss).backward()``) is recorded instead of run. Running
# ``build`` on micro-batch k is then the forward of k, and running the recorded
# backward is its backward. On a rank holding one stage, the forward of
# ``build`` computes that stage only (the stages held elsewhere return
# stand-ins, NOTE [stages held elsewhere]), receives the stage's input and
# sends its output: that is F(s, k). The recorded backward, run whole, receives
# the output's gradient, computes the stage's gradients and sends the input's
# gradient: B(s, k). A backward that runs inside ``build`` anyway
# (``torch.autograd.backward(loss)``, or ``backward`` on a plain tensor) would
# run out of the schedule's order; the first change of placement or stand-in
# it reaches raises, naming the fix.
#
# NOTE [one program, one message order]
# Transfers between stages are point-to-point messages matched per pair of
# ranks in the order they are posted (NOTE [deferred sends] in
# sbpflow/comm/_p2p.py). Every rank runs the same ``build`` on the same
# micro-batches and the same backward calls on the same graphs, so two ranks
# post the messages between them in the same order: forwards in micro-batch
# order, and within one micro-batch in program order (the autograd engine
# visits one graph in one order). The schedule fixes how a rank interleaves
# forwards and backwards; the validator checks that the schedule's own
# messages between two ranks are received in the order they are sent.
# Sends never wait for their receiver (they are waited for at the end of the
# step), so a stage runs ahead as far as the schedule lets it.
#
# NOTE [split backward]
# Zero bubble splits B into I (the input gradient, sent upstream at once) and
# W (the weight gradients, later). I runs ``torch.autograd.grad`` of the
# recorded loss with respect to every tensor that crossed a placement in the
# forward (NOTE [transfer hook] in sbpflow/boxing/_redistribute.py): the same
# call on every rank, so the same message order. Its graph is kept. W computes
# the weight gradients (the parameters, and any other leaf that needs a
# gradient) from the gradients I saw where they branch off its path (NOTE
# [weight pass] in _weight_pass.py), running again only the nodes where weight
# gradients branch off. On a rank holding several stages W instead runs the
# loss's backward again, to stop between its stages (NOTE [several stages on a
# rank] in _workers.py), and so does the first stage (_step.py); the changes of
# placement it crosses again return the gradients I computed (kept on the
# autograd node) instead of receiving them a second time, so W sends and
# receives nothing either way. Gradients and losses equal B's exactly.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .... import _rng, _step_context
from ...._global import GlobalTensor
from ...._layout import Layout
from ..schedules import Action
from ._weight_pass import SavedTensors

__all__ = ["Backward", "Driver", "MicroBatch", "Phase", "Scope", "current_action"]


class Phase(enum.Enum):
    """What a pass over a micro-batch is doing now."""

    IDLE = "idle"
    FORWARD = "forward"  # running build
    BACKWARD = "backward"  # a full backward
    INPUT = "input"  # the input-gradient half of a split backward
    WEIGHT = "weight"  # the weight-gradient half


@dataclass
class Backward:
    """One ``backward`` call recorded in ``build`` (NOTE [deferred backward])."""

    tensor: torch.Tensor
    gradient: torch.Tensor | None
    retain_graph: bool | None
    create_graph: bool
    inputs: Any


class MicroBatch:
    """One micro-batch of a step: its arguments, what ``build`` returned and recorded.

    ``context`` is the ``contextvars.Context`` its work runs in: its random
    stream (NOTE [micro-batch random streams] in sbpflow/_rng.py) and its scope.
    """

    def __init__(
        self,
        index: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: contextvars.Context,
        reuse: bool = False,
    ) -> None:
        self.index = index
        self.args, self.kwargs = args, kwargs
        self.context = context
        self.output: Any = None
        self.backwards: list[Backward] = []
        self.crossed: list[GlobalTensor] = []  # inputs of changes of placement, needing grad
        # (parameter, its piece) for each parameter a stage computed with on its piece
        # (NOTE [parameter pieces are leaves] in _held_here.py)
        self.pieces: list[tuple[GlobalTensor, torch.Tensor]] = []
        self.weight_pass: Any = None  # what the input pass kept for the weight pass
        # its saved tensors, when its weight pass reuses what the input pass computed (NOTE
        # [saved tensors of a split micro-batch] in _weight_pass.py)
        self.saved = SavedTensors() if reuse else None

    def release(self) -> None:
        """Drop the references to the micro-batch's graph (its backward is done)."""
        self.backwards = []
        self.crossed = []
        self.pieces = []
        self.weight_pass = None
        if self.saved is not None:
            self.saved.clear()


class Driver(Protocol):
    """How the runtime runs passes: on its own thread, or on parked worker threads."""

    def crossing_forward(self, scope: Scope, ctx: Any, x: GlobalTensor, dst: Layout) -> None: ...

    def before_gradient(self, scope: Scope, ctx: Any) -> None: ...


class Scope:
    """The step context of one pass over a micro-batch (NOTE [pipeline step context])."""

    def __init__(self, mb: MicroBatch, driver: Driver | None = None) -> None:
        self.mb = mb
        self.driver = driver
        self.phase = Phase.IDLE
        self.action: Action | None = None  # the schedule's action this pass runs now

    def enter(self, context: contextvars.Context) -> None:
        """Make this the scope of the work run in ``context``."""
        context.run(_step_context.current.set, self)

    def defer_backward(
        self,
        tensor: torch.Tensor,
        gradient: Any,
        retain_graph: bool | None,
        create_graph: bool,
        inputs: Any,
    ) -> bool:
        if self.phase is not Phase.FORWARD:
            return False
        self.mb.backwards.append(Backward(tensor, gradient, retain_graph, create_graph, inputs))
        return True

    def transfer_forward(self, ctx: Any, x: GlobalTensor, dst: Layout) -> None:
        if self.phase is not Phase.FORWARD:
            return  # a gradient moved by a backward pass
        if x.requires_grad:
            self.mb.crossed.append(x)
        if self.driver is not None:
            self.driver.crossing_forward(self, ctx, x, dst)

    def transfer_backward(self, ctx: Any, compute: Callable[[], GlobalTensor]) -> GlobalTensor:
        self.check_backward_allowed()
        if self.driver is not None:
            self.driver.before_gradient(self, ctx)
        if self.phase is Phase.WEIGHT:
            kept = getattr(ctx, "pipeline_grad", None)
            assert kept is not None, "a weight pass crossed a placement its input pass did not"
            return kept  # dropped with the graph
        grad = compute()
        if self.phase is Phase.INPUT:
            ctx.pipeline_grad = grad  # for the weight pass (NOTE [split backward])
        return grad

    def check_backward_allowed(self) -> None:
        """Raise if a backward runs inside ``build`` (NOTE [deferred backward])."""
        if self.phase is Phase.FORWARD:
            raise ValueError(
                "build ran a backward pass while the pipelined step ran its forward: a pipeline "
                "runs each micro-batch's backward when the schedule says, so build must call "
                "loss.backward() (or scaler.scale(loss).backward()) on the global loss, which "
                "the graph records; torch.autograd.backward(loss), torch.autograd.grad and "
                "backward on a plain tensor run at once. Call loss.backward() in build."
            )


def current_action() -> Action | None:
    """The compute action this rank is running now in a pipelined step, else ``None``.

    For code that must know which half of a split backward runs (a benchmark's
    timed stage, say).
    """
    scope = _step_context.current.get()
    return scope.action if isinstance(scope, Scope) else None


def microbatch_contexts(count: int) -> list[contextvars.Context]:
    """A ``contextvars.Context`` per micro-batch, each with its random stream (none for one)."""
    streams: list[_rng.RandomStream | None] = (
        list(_rng.microbatch_streams(count)) if count > 1 else [None]
    )
    contexts = []
    for stream in streams:
        context = contextvars.copy_context()
        context.run(_rng.set_stream, stream)
        contexts.append(context)
    return contexts


def finish_streams(contexts: list[contextvars.Context]) -> None:
    """Move the program's random state past what the micro-batches' streams drew."""
    drawn = 0
    for context in contexts:
        stream = context.run(_rng.current_stream)
        if stream is not None:
            drawn += stream.offset
    if drawn:
        _rng.advance(drawn)
