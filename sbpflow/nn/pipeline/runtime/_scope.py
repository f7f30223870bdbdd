"""One micro-batch of a pipelined step, and the scope its work runs in (NOTE [pipeline step context]).

# NOTE [pipeline step context]
# While the runtime runs a step, each micro-batch's work runs in a
# ``contextvars.Context`` of its own (``Context.run`` on the runtime's thread, or
# the micro-batch's worker threads when a rank holds several stages) holding:
#   - its ``Scope``, installed as the step hooks (NOTE [step hooks] in
#     sbpflow/_step_context.py): ``GlobalTensor.backward`` in ``build`` is
#     handed to the scope instead of run (NOTE [deferred backward]), and each
#     change of placement is shown to it (NOTE [crossings in a step]);
#   - boxing's agreement turned off (NOTE [no agreement in a pipelined step]);
#   - its random stream (NOTE [micro-batch random streams]).
# So the values follow the micro-batch, two threads never see each other's, and
# nothing outlives the step. The runtime runs its backward passes with
# ``torch.autograd.set_multithreading_enabled(False)`` (the engine on the calling
# thread), so a node's backward sees the scope of the pass running it.
#
# NOTE [no agreement in a pipelined step]
# The ranks run the forwards and backwards of different micro-batches at the
# same time, so a world-wide agreement per ``to_global`` would pair calls of
# different micro-batches and make every rank wait for the slowest: the stages
# would not overlap. So a micro-batch's context turns boxing's agreement off
# (NOTE [boxing agreement turned off] in sbpflow/_meta_check.py). The ranks
# still agree by construction (every rank runs the same ``build`` on the same
# micro-batches); a disagreement then surfaces as a timeout naming each rank's
# call instead of a prompt error.
#
# NOTE [micro-batch random streams]
# A graph step with gradient accumulation runs ``build`` once per micro-batch,
# and a pipeline schedule runs the micro-batches' work interleaved (a rank with
# several stages starts micro-batch 1 before micro-batch 0's build is done). So
# that the values drawn do not depend on that order, each micro-batch draws
# from a random stream of its own (NOTE [random streams] in sbpflow/_rng.py):
# seed ``stream_seed(stream_seed(seed, offset), k)`` for micro-batch k (seed and
# offset where the program is at the call), positions from 0, set in the
# micro-batch's context. After the step the program's offset advances by
# everything the streams drew. A staged graph thus draws exactly what the same
# graph without stages draws, whatever its schedule. With one micro-batch there
# is no stream: ``build`` draws from the program's state directly, as eager code
# does.
#
# NOTE [crossings in a step]
# The scope sees each change of placement ``Redistribute`` makes (NOTE [crossing
# hooks] in sbpflow/boxing/_redistribute.py): a stage boundary, a weight used on
# another stage. In forward it keeps the input (the split backward's input pass
# differentiates with respect to it) and gives the move lane 0 of its pair of
# placements; in backward it moves the gradient back on lane 1 (NOTE [lanes] in
# _transfers.py), so the ranks need to agree on the order of messages within
# each lane only. The gradient may be computed once and replayed: a zero-bubble
# weight pass crosses the same boundaries as the input pass before it, and must
# not receive their gradients twice.
#
# NOTE [gradients cross in the layout their tensor crossed in]
# Inside a pipelined step a gradient changes placement only from the layout
# its tensor had after the change in forward: it is first boxed to that layout
# within the destination placement (e.g. a partial-sum gradient of a
# tensor-parallel stage is all-reduced among the stage's ranks), then moved.
# A rank that does not hold a stage never computes the stage's gradients (NOTE
# [stages held elsewhere] in _held_elsewhere.py); it cannot know the layout they
# come out in, but it knows this one, so the ranks on both sides of the move
# plan the same transfer.

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
# _transfers.py). Every rank runs the same ``build`` on the same
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
# forward (NOTE [crossings in a step]): the same
# call on every rank, so the same message order. Its graph is kept. W computes
# the weight gradients (the parameters, and any other leaf that needs a
# gradient) from the gradients I saw where they branch off its path (NOTE
# [weight pass] in _weight_pass.py), running again only the nodes where weight
# gradients branch off; on a rank holding several stages, stage by stage (NOTE
# [weight pass on several stages] in _workers.py). On a rank holding only the
# first stage (_step.py), and where it cannot, W runs the
# loss's backward again, stopping between the rank's stages; the changes of
# placement it crosses again return the gradients I computed (kept on the
# autograd node) instead of receiving them a second time, so W sends and
# receives nothing either way. Gradients and losses equal B's exactly.
"""

from __future__ import annotations

import contextvars
import enum
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .... import _meta_check, _rng, _step_context
from ...._global import GlobalTensor
from ...._layout import Layout
from ....boxing._redistribute import Redistribute, box_below_autograd
from ....boxing.executor import Transport
from ..schedules import Action
from ._transfers import StepTransfers
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
    stream (NOTE [micro-batch random streams]) and its scope.
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
        self.no_gradient: tuple[torch.Tensor, ...] = ()  # leaves no backward gives a gradient
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

    def __init__(
        self, mb: MicroBatch, transfers: StepTransfers, driver: Driver | None = None
    ) -> None:
        self.mb = mb
        self.transfers = transfers  # the step's (NOTE [deferred sends] in _transfers.py)
        self.driver = driver
        self.phase = Phase.IDLE
        self.action: Action | None = None  # the schedule's action this pass runs now

    def enter(self, context: contextvars.Context) -> None:
        """Make this the scope of the work run in ``context`` (NOTE [pipeline step context])."""
        context.run(_step_context.current.set, self)
        context.run(_meta_check.boxing_agreement.set, False)

    def take_backward(
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

    def crossing_forward(self, ctx: Any, x: GlobalTensor, dst: Layout) -> Transport:
        """NOTE [crossings in a step]: the move goes on lane 0 of its pair of placements."""
        if self.phase is Phase.FORWARD:  # else a gradient moved by a backward pass
            if x.requires_grad:
                self.mb.crossed.append(x)
            if self.driver is not None:
                self.driver.crossing_forward(self, ctx, x, dst)
        return self.transfers.lane(x.placement, dst.placement, 0)

    def crossing_backward(self, ctx: Any, grad: GlobalTensor) -> GlobalTensor:
        """NOTE [crossings in a step]: the gradient goes back on lane 1."""
        self.check_backward_allowed()
        if self.driver is not None:
            self.driver.before_gradient(self, ctx)
        if self.phase is Phase.WEIGHT:
            kept = getattr(ctx, "pipeline_grad", None)
            assert kept is not None, "a weight pass crossed a placement its input pass did not"
            return kept  # dropped with the graph
        grad = _move_back(ctx, grad, self.transfers.lane(ctx.src.placement, ctx.dst.placement, 1))
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


def _move_back(ctx: Any, grad: GlobalTensor, back: Transport) -> GlobalTensor:
    """A crossing's gradient moved back to its input's layout through ``back`` (NOTE
    [gradients cross in the layout their tensor crossed in])."""
    crossed = grad if grad._layout == ctx.dst else Redistribute.apply(grad, ctx.dst)
    if torch.is_grad_enabled():  # create_graph: the move is part of the graph
        return Redistribute.apply(crossed, ctx.src, back)
    return box_below_autograd(crossed, ctx.src, back)


def microbatch_contexts(count: int) -> list[contextvars.Context]:
    """A ``contextvars.Context`` per micro-batch, each with its random stream (none for one;
    NOTE [micro-batch random streams])."""
    streams: list[_rng.RandomStream | None] = [None]
    if count > 1:
        seed, offset = _rng.state()
        base = _rng.stream_seed(seed, offset)
        streams = [_rng.RandomStream(_rng.stream_seed(base, k)) for k in range(count)]
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
