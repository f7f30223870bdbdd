"""The pipeline runtime: run one step's micro-batches through ``build`` in a schedule's order.

A schedule (sbpflow/nn/pipeline/) says, per rank, in which order the forwards
(F), backwards (B, or its halves I and W) and transfers of each (stage,
micro-batch) run. This module runs that order on this rank and records what
ran, with times (``StepRecord``).

# NOTE [deferred backward]
# ``build`` is the user's whole step on one micro-batch: forward through every
# stage, the loss, ``loss.backward()``. Inside a pipelined step the runtime
# sets ``sbpflow._global.deferred_backward``, so ``GlobalTensor.backward``
# (also ``scaler.scale(loss).backward()``) records its arguments instead of
# running. Running ``build`` on micro-batch k is then the forward of k, and
# running the recorded backward is its backward. On a rank holding one stage,
# the forward of ``build`` computes that stage only (ops of stages on other
# placements are skipped on their empty local tensors), receives the stage's
# input and sends its output: that is F(s, k). The recorded backward, run
# whole, receives the output's gradient, computes the stage's gradients and
# sends the input's gradient: B(s, k). No threads are needed.
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
# forward (NOTE [transfer hook] in sbpflow/boxing/_redistribute.py records
# them): the same call on every rank, so the same message order. Its graph is
# kept. W runs ``torch.autograd.backward`` of the loss with respect to this
# rank's parameters; the changes of placement it crosses again return the
# gradients I computed (kept on the autograd node) instead of receiving them a
# second time, so W sends and receives nothing. W recomputes the gradients
# inside the stage that lead to its weights (all of the stage's backward but
# the input gradient of its first op): the price of splitting B without
# changing the ops' backward formulas. Gradients and losses equal B's exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _global, _meta_check
from .._global import GlobalTensor
from .._layout import Layout
from ..boxing import _redistribute
from ..comm import collectives
from ..comm._world import get_rank
from ._microbatch import MicroBatch
from ._pipeline_threads import Baton, Task
from ._stages import Stage
from .pipeline import Action, ActionKind, ActionTiming, Message, Schedule, StepRecord

__all__ = ["current_action", "run_step"]

_current: Action | None = None


def current_action() -> Action | None:
    """The compute action this rank is running now in a pipelined step, else ``None``.

    For code that must know which half of a split backward runs (a benchmark's
    timed stage, say).
    """
    return _current


@dataclass
class _Backward:
    """One recorded ``backward`` call (NOTE [deferred backward])."""

    tensor: torch.Tensor
    gradient: torch.Tensor | None
    retain_graph: bool | None
    create_graph: bool
    inputs: Any


@dataclass
class _MicroBatch:
    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None
    backwards: list[_Backward] = field(default_factory=list)
    crossed: list[GlobalTensor] = field(default_factory=list)  # inputs of changes of placement

    def record_backward(
        self,
        tensor: torch.Tensor,
        gradient: Any,
        retain_graph: Any,
        create_graph: bool,
        inputs: Any,
    ) -> None:
        self.backwards.append(_Backward(tensor, gradient, retain_graph, create_graph, inputs))

    def release(self) -> None:
        self.backwards = []
        self.crossed = []


class _TransferHook:
    """Sees each change of placement (NOTE [transfer hook]): notes the tensors crossing for I,
    keeps I's gradients for W, and parks a worker that would receive too early (NOTE
    [several stages on a rank])."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.microbatch: _MicroBatch | None = None  # whose forward runs
        self.mode: str | None = None  # "input" (keep gradients) or "weight" (replay them)
        self.task: Task | None = None  # the worker running, with several stages on this rank
        self.baton: Baton | None = None
        self.held: tuple[int, ...] = ()  # this rank's stages

    def forward(self, ctx: Any, x: GlobalTensor, dst: Layout) -> None:
        if self.microbatch is not None and x.requires_grad:
            self.microbatch.crossed.append(x)
        task = self.task
        if task is None:
            return
        ctx.pipeline_stage = task.fwd_stage  # the held stage sending it (or -1)
        ctx.pipeline_receives_grad = self.rank in x.placement and self.rank not in dst.placement
        if self.rank in dst.placement and self.rank not in x.placement:
            later = [s for s in self.held if s > task.fwd_stage]
            if later:  # the input of this rank's next stage
                assert self.baton is not None
                self.baton.wait_for(task, Action(ActionKind.FORWARD, later[0], task.k))

    def backward(self, ctx: Any, compute: Callable[[], GlobalTensor]) -> GlobalTensor:
        task = self.task
        if task is not None and getattr(ctx, "pipeline_receives_grad", False):
            assert self.baton is not None
            stage = ctx.pipeline_stage
            self.baton.wait_for(task, Action(ActionKind.BACKWARD, stage, task.k))
        if self.mode == "weight":
            kept = getattr(ctx, "pipeline_grad", None)
            if kept is not None:
                ctx.pipeline_grad = None
                return kept
        grad = compute()
        if self.mode == "input":
            ctx.pipeline_grad = grad
        return grad


class _Recorder:
    """The actions this rank ran, each with the messages it sent and received."""

    def __init__(self, rank: int, stages: Sequence[Stage]) -> None:
        self.rank = rank
        self.timings: list[ActionTiming] = []
        self.messages: list[Message] = []
        self._pending: list[collectives.Message] = []
        # A peer as the schedule names it: the first rank of its stage's placement.
        self._holder = {
            r: stage.placement.flat_ranks[0] for stage in stages for r in stage.placement.flat_ranks
        }

    def observe(self, message: collectives.Message) -> None:
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


def run_step(
    build: Callable[..., Any],
    microbatches: Sequence[MicroBatch],
    schedule: Schedule,
    stages: Sequence[Stage],
    params: Sequence[torch.Tensor],
) -> tuple[list[Any], StepRecord]:
    """Run ``build`` on each micro-batch in ``schedule``'s order on this rank.

    Returns ``build``'s outputs in micro-batch order and the record of what
    this rank ran. A rank holding no stage runs the micro-batches one after
    another (it only takes part in creating groups) and records nothing.
    """
    rank = get_rank()
    holder = next(
        (s.placement.flat_ranks[0] for s in stages if rank in s.placement.flat_ranks), None
    )
    mbs = [_MicroBatch(k, args, kwargs) for k, (args, kwargs) in enumerate(microbatches)]
    recorder = _Recorder(rank, stages)
    if holder is None:
        todo = [a for k in range(len(mbs)) for a in (_forward(k), _backward(k))]
    else:
        todo = [a for a in schedule.actions[holder] if a.is_compute]
    held = schedule.stages_of(holder) if holder is not None else ()
    mine = [p for p in params if isinstance(p, GlobalTensor) and rank in p.placement]
    hook = _TransferHook(rank)
    global _current
    _redistribute.transfer_hook = hook
    _meta_check.boxing_agreement = False  # NOTE [no agreement in a pipelined step]
    try:
        with collectives.deferred_sends(recorder.observe):
            if len(held) > 1:
                _run_on_workers(todo, mbs, build, hook, held, stages, recorder)
            else:
                for action in todo:
                    _current = action
                    start = time.monotonic()
                    _run(action, mbs[action.microbatch], build, hook, mine)
                    recorder.add(action, start, time.monotonic())
    finally:
        _current = None
        _redistribute.transfer_hook = None
        _meta_check.boxing_agreement = True
        _global.deferred_backward = None
    for mb in mbs:
        mb.release()
    ranks = (rank,) if holder is not None else ()
    timings = tuple(recorder.timings) if holder is not None else ()
    record = StepRecord(schedule, ranks, timings, tuple(recorder.messages))
    return [mb.output for mb in mbs], record


def _run_on_workers(
    todo: Sequence[Action],
    mbs: Sequence[_MicroBatch],
    build: Callable[..., Any],
    hook: _TransferHook,
    held: tuple[int, ...],
    stages: Sequence[Stage],
    recorder: _Recorder,
) -> None:
    """Several stages on this rank: grant each worker its actions in order (NOTE [several stages on a rank])."""
    global _current
    baton = Baton()
    hook.baton, hook.held = baton, held
    first_backward: dict[int, Action] = {}
    for a in todo:
        if a.kind is not ActionKind.FORWARD:
            first_backward.setdefault(a.microbatch, a)
    for a in todo:
        if a.kind not in (ActionKind.FORWARD, ActionKind.BACKWARD):
            raise ValueError(
                f"with several stages on one rank the runtime runs forwards and full backwards, "
                f"got {a}; use 'interleaved_1f1b'."
            )

    def body(task: Task) -> None:
        mb = mbs[task.k]
        mb.output = build(*mb.args, **mb.kwargs)
        baton.wait_for(task, first_backward[task.k])
        for bw in mb.backwards:
            torch.Tensor.backward(
                bw.tensor, bw.gradient, bw.retain_graph, bw.create_graph, bw.inputs
            )
        mb.release()

    tasks = [Task(k, body) for k in range(len(mbs))]
    entries = []
    for stage in stages:
        if stage.stage_id in held:

            def enter(module: Any, args: Any, stage_id: int = stage.stage_id) -> None:
                task = hook.task
                if task is not None:
                    baton.wait_for(task, Action(ActionKind.FORWARD, stage_id, task.k))
                    task.fwd_stage = stage_id

            # After the graph's hook moving the stage's inputs: that receive is still before the stage.
            entries.append(stage.module.register_forward_pre_hook(enter))
    try:
        for action in todo:
            mb, task = mbs[action.microbatch], tasks[action.microbatch]
            forward = action.kind is ActionKind.FORWARD
            hook.task, hook.microbatch = task, (mb if forward else None)
            _global.deferred_backward = mb.record_backward if forward else None
            _current = action
            start = time.monotonic()
            baton.grant(task, action)
            recorder.add(action, start, time.monotonic())
            if forward and task.fwd_stage != action.stage:
                raise RuntimeError(
                    f"the schedule ran {action}, but micro-batch {action.microbatch}'s build did "
                    f"not enter stage {action.stage} on this rank (it last entered stage "
                    f"{task.fwd_stage}): the model's stages do not run in the schedule's order "
                    "(each stage once per micro-batch, in stage-id order)."
                )
        unfinished = [t.k for t in tasks if not t.done]
        if unfinished:
            raise RuntimeError(
                f"micro-batches {unfinished} did not finish their backward by the end of the "
                "schedule on this rank: the model's stages do not match the schedule's."
            )
    finally:
        hook.task = hook.microbatch = None
        for handle in entries:
            handle.remove()
        baton.abort()


def _forward(k: int) -> Action:
    return Action(ActionKind.FORWARD, 0, k)


def _backward(k: int) -> Action:
    return Action(ActionKind.BACKWARD, 0, k)


def _run(
    action: Action,
    mb: _MicroBatch,
    build: Callable[..., Any],
    hook: _TransferHook,
    mine: Sequence[torch.Tensor],
) -> None:
    kind = action.kind
    if kind is ActionKind.FORWARD:
        hook.microbatch = mb
        _global.deferred_backward = mb.record_backward
        try:
            mb.output = build(*mb.args, **mb.kwargs)
        finally:
            _global.deferred_backward = None
            hook.microbatch = None
    elif kind is ActionKind.BACKWARD:
        for bw in mb.backwards:
            torch.Tensor.backward(
                bw.tensor, bw.gradient, bw.retain_graph, bw.create_graph, bw.inputs
            )
        mb.release()
    elif kind is ActionKind.BACKWARD_INPUT:
        crossed = [x for x in mb.crossed if x.requires_grad]
        hook.mode = "input"
        try:
            for bw in mb.backwards:
                _check_splittable(bw)
                if crossed:
                    torch.autograd.grad(
                        [bw.tensor],
                        crossed,
                        [bw.gradient],
                        retain_graph=True,
                        allow_unused=True,
                    )
        finally:
            hook.mode = None
    elif kind is ActionKind.BACKWARD_WEIGHT:
        hook.mode = "weight"
        try:
            for bw in mb.backwards:
                if mine:
                    torch.autograd.backward([bw.tensor], [bw.gradient], inputs=mine)
        finally:
            hook.mode = None
        mb.release()
    else:  # pragma: no cover - transfers are not compute actions
        raise AssertionError(f"not a compute action: {action}")


def _check_splittable(bw: _Backward) -> None:
    if bw.create_graph or bw.inputs is not None:
        raise ValueError(
            "the zero_bubble schedule splits loss.backward() into its input- and weight-gradient "
            f"halves, so it runs it without options; got create_graph={bw.create_graph}, "
            f"inputs={bw.inputs!r}. Call loss.backward() with no options, or use '1f1b'."
        )
