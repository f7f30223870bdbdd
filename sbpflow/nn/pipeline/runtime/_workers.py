"""Several stages on one rank: each micro-batch's passes on worker threads, one running at a time.

# NOTE [several stages on a rank]
# On a rank holding stages 0 and 2, the forward of ``build`` on micro-batch k
# computes stage 0, sends its output, receives stage 1's output and computes
# stage 2; the schedule wants F(0, k) and F(2, k) at different times, with
# other micro-batches' work between them. So each micro-batch runs ``build``
# and then its recorded backward on a worker thread, and the runtime passes a
# baton: exactly one thread runs at a time (the runtime's or one worker), so
# the order of everything is as deterministic as on one thread. A worker runs
# while the action it needs is the one the runtime granted it, and parks
# (hands the baton back) where it needs another:
#   - entering a held stage's module in forward: F(stage, k);
#   - about to receive a tensor into this rank's placement in forward (the
#     input of the next held stage): F(next held stage, k);
#   - after ``build`` returns: the first backward action of k on this rank;
#   - in a backward pass, about to receive a gradient (B, I or W of the held
#     stage whose forward sent the tensor, noted on the autograd node in
#     forward), and where the gradient of a held stage's output is ready (the
#     stage's B, I or W: two held stages next to each other hand over without a
#     transfer).
# With a split backward (zero bubble, NOTE [split backward] in _scope.py) the
# worker runs the input pass I and parks in it as in a full backward; the weight
# pass usually needs none (NOTE [weight pass on several stages]), and a B in a
# micro-batch whose backward is split runs as its I then its W. The runtime
# grants the actions in the schedule's order; a worker parked on another action
# than the one granted means the model's stages do not follow the schedule
# (e.g. a stage called twice) and is an error. Each worker runs in its
# micro-batch's ``contextvars.Context`` (its scope and random stream) with the
# runtime's grad mode and CPU autocast, and runs its backward passes on its own
# thread (``torch.autograd.set_multithreading_enabled(False)``). The threads are
# kept from one step to the next (NOTE [worker threads kept across steps] in
# _carriers.py), and passing the baton wakes only the thread that runs next.
# Actions granted as they are (F, I, and B of a micro-batch not split) pass the
# baton from worker to worker: one that parks or finishes records its action
# and grants the next such action itself (to itself where it is its own: F then
# B of the last stage run on with no switch); the runtime's thread takes the
# baton back for a W, a split B, the end, or a grant that would fail (it raises
# there). Under load each wake-up waits for a core: measured on bench/pipeline
# part 5 (interleaved_1f1b, 4 stages on 2 ranks, load 4-6 on 2 cores), going
# through the runtime's thread between actions left 43-52 ms per step of gaps
# between them, in a step of about 210 ms.
#
# NOTE [weight pass on several stages]
# The weight pass reuses what the input pass computed here too (NOTE [weight
# pass] in _weight_pass.py), stage by stage. In forward, entering held stage s
# starts its window: the autograd nodes made and the tensors saved from then on
# (the stage and the hand-off after it) are s's, those before the first window
# the first's (``SavedTensors``, by autograd sequence number). I keeps the
# gradients at the intermediates as on one stage. W sends and receives nothing,
# so it needs no worker: W(s, k) runs on the runtime's thread, in a copy of the
# micro-batch's context with a scope of its own, while k's input pass may still
# be parked in its worker (ZBV runs W(3, k) before I(0, k) on the rank holding
# stages 0 and 3). It runs the groups of weights whose intermediates and
# branches lie in s's window, then frees the tensors saved in that window, as a
# whole backward stopping between the stages would. By then I has run every
# node of that window it runs: the engine runs the ready node with the highest
# sequence number first, and I parks only at a node of an earlier window. The
# micro-batch's last W on this rank (after all its I's) runs every group left
# (one whose gradients I's hooks did not see is filled in when I returns) and
# frees the rest. A group whose nodes span two windows (one leaf used on two of
# the rank's stages) would keep a stage's activations past its W: then the
# micro-batch does not reuse, and its W runs the loss's backward again on a
# second worker, parking between the stages as I does, each window freed after
# its W. I's keep hooks stay in place while it is parked and ignore a weight
# pass running through them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .... import _step_context
from ...._global import GlobalTensor
from ...._layout import Layout
from ....comm._world import get_rank
from ..schedules import Action, ActionKind
from ._carriers import Carriers
from ._passes import (
    Build,
    run_backward,
    run_forward,
    run_input_gradients,
    run_stage_weight_gradients,
    run_weight_gradients,
)
from ._recorder import Recorder
from ._scope import MicroBatch, Phase, Scope
from ._stages import Stage
from ._transfers import StepTransfers

__all__ = ["Baton", "Task", "run_on_workers"]

_F, _B, _I, _W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)
_KIND_OF_PHASE = {Phase.BACKWARD: _B, Phase.INPUT: _I, Phase.WEIGHT: _W}


class _Abort(BaseException):
    """Unwinds a parked worker when the step fails elsewhere."""


class Task:
    """One worker's passes over micro-batch k, run one granted action at a time."""

    def __init__(self, scope: TaskScope, body: Callable[[Task], None]) -> None:
        self.scope = scope
        self.k = scope.mb.index
        self.body = body
        self.granted: Action | None = None
        self.need: Action | None = None  # what it waits for while parked
        self.fwd_stage = -1  # the last held stage its forward entered
        self.done = False
        self.error: BaseException | None = None
        self.wake: threading.Condition | None = None  # where its worker waits for the baton
        self.finished: threading.Event | None = None  # set when its worker has returned


class TaskScope(Scope):
    """The scope of a worker's pass: also knows its task."""

    task: Task


class Baton:
    """Exactly one of the runtime's thread and the workers runs at a time.

    Each waits on a condition of its own (over one lock), so passing the baton wakes the one
    thread that runs next, not every parked worker; the workers run on ``carriers`` (NOTE
    [worker threads kept across steps] in _carriers.py). Through a run of plain grants
    (``run_chain``) a worker that stops passes the baton straight to the next action's
    worker, and keeps it when that action is its own.
    """

    def __init__(
        self, carriers: Carriers, todo: Sequence[Action], recorder: Recorder | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._runtime = threading.Condition(self._lock)  # the runtime's thread waits here
        self._running: Task | None = None
        self._aborted = False
        self._tasks: list[Task] = []
        self._carriers = carriers
        self._todo = todo
        self._recorder = recorder
        self._chain: dict[int, Task] = {}  # index in todo: the task of a plain grant
        self._cursor = -1  # in a chain: the index of the action running
        self._start = 0.0  # and when it started
        self._chaining = False
        # Workers start with the runtime thread's modes, also when a worker (in a backward,
        # where grad mode is off) passes the baton to one not started yet.
        self._state = _thread_state()

    def plain(self, index: int, task: Task) -> None:
        """``todo[index]`` is granted to ``task`` as it is: a worker may pass the baton on to it."""
        self._chain[index] = task

    def is_plain(self, index: int) -> bool:
        """Whether ``todo[index]`` is a plain grant (``plain``)."""
        return index in self._chain

    def grant(self, task: Task, action: Action) -> None:
        """Let ``task`` run ``action``; return when it parks or finishes (runtime's thread)."""
        with self._lock:
            self._grant(task, action)
            self._runtime.wait_for(lambda: self._running is None)
        if task.error is not None:
            error, task.error = task.error, None
            raise error

    def run_chain(self, index: int) -> int:
        """Run ``todo[index]`` (a plain grant) and the plain grants after it that the workers
        pass the baton on to; return the index of the next action (runtime's thread)."""
        task, action = self._chain[index], self._todo[index]
        with self._lock:
            self._cursor, self._start, self._chaining = index, time.monotonic(), True
            try:
                self._grant(task, action)
                self._runtime.wait_for(lambda: self._running is None)
            finally:
                self._chaining = False
            index = self._cursor
        task, action = self._chain[index], self._todo[index]
        if task.error is not None:
            error, task.error = task.error, None
            raise error
        if _missed_stage(task, action):
            raise RuntimeError(
                f"the schedule ran {action}, but micro-batch {task.k}'s build did not enter stage "
                f"{action.stage} on this rank (it last entered stage {task.fwd_stage}): the "
                "model's stages do not run in the schedule's order (each stage once per "
                "micro-batch, in stage-id order)."
            )
        return index + 1

    def wait_for(self, task: Task, action: Action) -> None:
        """Park ``task`` until ``action`` is granted to it (its worker thread)."""
        if task.granted == action:
            return
        assert task.wake is not None
        with self._lock:
            task.need = action
            self._stop(task)
            task.wake.wait_for(
                lambda: self._aborted or (self._running is task and task.granted == action)
            )
            if self._aborted:
                raise _Abort

    def _grant(self, task: Task, action: Action) -> None:
        """Hand the baton to ``task`` for ``action`` (the lock held)."""
        if task.done:
            raise RuntimeError(
                f"the schedule runs {action}, but micro-batch {task.k}'s forward and backward "
                "have already finished on this rank: the model's stages do not match the "
                "schedule's (is a stage skipped or called twice in build?)."
            )
        if task.need is not None and task.need != action:
            raise RuntimeError(
                f"the schedule runs {action}, but micro-batch {task.k}'s step waits for "
                f"{task.need} on this rank: the model's stages do not run in the "
                "schedule's order (each stage once per micro-batch, in stage-id order)."
            )
        task.granted, task.need = action, None
        task.scope.action = action
        self._running = task
        if task.wake is None:
            context = task.scope.mb.context
            if task.scope.phase is Phase.WEIGHT:  # the micro-batch's second worker
                context = context.copy()
            task.scope.enter(context)
            task.wake = threading.Condition(self._lock)
            try:
                task.finished = self._carriers.start(context.run, self._work, task, self._state)
            except BaseException:  # no thread runs it: nothing to wake or wait for
                task.wake = None
                raise
            self._tasks.append(task)
        else:
            task.wake.notify()

    def _stop(self, task: Task) -> None:
        """``task`` stops running (the lock held): in a chain, it records its action and passes
        the baton to the next plain grant; else, or where that grant would fail, the runtime's
        thread takes the baton (and raises)."""
        if self._chaining and self._chain.get(self._cursor) is task:
            action, end = self._todo[self._cursor], time.monotonic()
            if self._recorder is not None:
                self._recorder.add(action, self._start, end)
            after = self._chain.get(self._cursor + 1)
            ok = task.error is None and not _missed_stage(task, action)
            if ok and after is not None:
                following = self._todo[self._cursor + 1]
                if not after.done and after.need in (None, following):
                    self._cursor, self._start = self._cursor + 1, end
                    try:
                        self._grant(after, following)
                        return
                    except BaseException as error:  # no worker could start: the runtime raises
                        after.error = error
        self._running = None
        self._runtime.notify()

    def abort(self) -> None:
        """Unwind every parked worker and wait for them (after a failure, or at the end)."""
        with self._lock:
            self._aborted = True
            for task in self._tasks:
                assert task.wake is not None
                task.wake.notify()
        for task in self._tasks:
            assert task.finished is not None
            task.finished.wait(timeout=60)

    def _work(self, task: Task, state: tuple[bool, bool, torch.dtype]) -> None:
        grad, autocast, dtype = state
        try:
            with (
                torch.set_grad_enabled(grad),
                torch.autocast("cpu", dtype, enabled=autocast),
                torch.autograd.set_multithreading_enabled(False),
            ):
                task.body(task)
        except _Abort:
            pass
        except BaseException as error:  # handed to the runtime's thread, which raises it
            task.error = error
        finally:
            with self._lock:
                task.done = True
                task.need = None
                if self._running is task:
                    self._stop(task)
                else:
                    self._runtime.notify()


class _Workers:
    """Parks workers where their micro-batch needs another action (NOTE [several stages on a rank])."""

    def __init__(self, baton: Baton, held: tuple[int, ...]) -> None:
        self.baton = baton
        self.held = held
        self.rank = get_rank()

    def crossing_forward(self, scope: Scope, ctx: Any, x: GlobalTensor, dst: Layout) -> None:
        assert isinstance(scope, TaskScope)
        task = scope.task
        ctx.pipeline_stage = task.fwd_stage if task.fwd_stage >= 0 else min(self.held)
        ctx.pipeline_receives_grad = self.rank in x.placement and self.rank not in dst.placement
        if self.rank in dst.placement and self.rank not in x.placement:
            later = [s for s in self.held if s > task.fwd_stage]
            if later:  # the input of this rank's next stage
                self.baton.wait_for(task, Action(_F, later[0], task.k))

    def before_gradient(self, scope: Scope, ctx: Any) -> None:
        if getattr(ctx, "pipeline_receives_grad", False):
            self.park(scope, ctx.pipeline_stage)

    def park(self, scope: Scope, stage: int) -> None:
        """In a backward pass: wait for this pass's action on ``stage``."""
        kind = _KIND_OF_PHASE.get(scope.phase)
        if kind is not None and isinstance(scope, TaskScope):
            self.baton.wait_for(scope.task, Action(kind, stage, scope.task.k))


def run_on_workers(
    todo: Sequence[Action],
    mbs: Sequence[MicroBatch],
    build: Build,
    held: tuple[int, ...],
    stages: Sequence[Stage],
    recorder: Recorder,
    transfers: StepTransfers,
    carriers: Carriers,
) -> None:
    """Several stages on this rank: grant each worker its actions in order (NOTE [several stages on a rank])."""
    baton = Baton(carriers, todo, recorder)
    workers = _Workers(baton, held)
    split = {a.microbatch for a in todo if a.kind in (_I, _W)}
    first_backward: dict[int, Action] = {}
    last_weight: dict[int, int] = {}  # k: the index in todo of its last W on this rank
    for index, a in enumerate(todo):
        if a.microbatch in split and a.kind in (_B, _W):
            last_weight[a.microbatch] = index
        if a.kind in (_B, _I):
            first_backward.setdefault(
                a.microbatch, Action(_I, a.stage, a.microbatch) if a.microbatch in split else a
            )

    def main_pass(task: Task) -> None:
        scope, mb = task.scope, task.scope.mb
        run_forward(scope, build)
        baton.wait_for(task, first_backward[task.k])
        if task.k in split:
            scope.phase = Phase.INPUT
            run_input_gradients(mb)
        else:
            scope.phase = Phase.BACKWARD
            run_backward(mb)
            mb.release()
        scope.phase = Phase.IDLE

    def rerun_backward(task: Task) -> None:  # the whole backward again
        run_weight_gradients(task.scope.mb)
        task.scope.mb.release()

    def task_for(mb: MicroBatch, body: Callable[[Task], None], phase: Phase) -> Task:
        scope = TaskScope(mb, transfers, workers)
        scope.phase = phase
        scope.task = task = Task(scope, body)
        return task

    mains = [task_for(mb, main_pass, Phase.IDLE) for mb in mbs]
    weights = [task_for(mb, rerun_backward, Phase.WEIGHT) for mb in mbs]
    # granted as they are: F, I, and B of a micro-batch whose backward is not split
    for index, a in enumerate(todo):
        if not (a.kind is _W or (a.kind is _B and a.microbatch in split)):
            baton.plain(index, mains[a.microbatch])
    hooks = _stage_hooks(stages, held, workers)
    try:
        index = 0
        while index < len(todo):
            if baton.is_plain(index):  # it and the plain grants after it, passed on by workers
                index = baton.run_chain(index)
                continue
            action = todo[index]
            k, kind = action.microbatch, action.kind
            start = time.monotonic()
            if kind is _B:  # B runs as its two halves
                baton.grant(mains[k], Action(_I, action.stage, k))
            mb, last = mbs[k], last_weight[k] == index
            if mb.weight_pass is None:  # W runs the backward again, on its worker
                baton.grant(weights[k], Action(_W, action.stage, k))
                if not last and mb.saved is not None:
                    mb.saved.release(action.stage)
            else:
                if last and not mains[k].done:
                    raise RuntimeError(
                        f"the schedule runs {action}, micro-batch {k}'s last weight pass on "
                        "this rank, but its input pass has not finished: the model's stages "
                        "do not match the schedule's."
                    )
                _reused_weight_pass(Action(_W, action.stage, k), mb, transfers, last)
            recorder.add(action, start, time.monotonic())
            index += 1
        unfinished = sorted(
            {t.k for t in mains if not t.done}
            | {t.k for t in weights if t.k in split and not t.done and t.wake is not None}
        )
        if unfinished:
            raise RuntimeError(
                f"micro-batches {unfinished} did not finish their backward by the end of the "
                "schedule on this rank: the model's stages do not match the schedule's."
            )
    finally:
        for handle in hooks:
            handle.remove()
        baton.abort()
        for task in (*mains, *weights):  # a step's leftovers keep neither build nor its graph
            task.body = _finished


def _missed_stage(task: Task, action: Action) -> bool:
    """Whether ``action``, a forward just run, did not enter its stage (``build`` did not
    follow the schedule)."""
    return action.kind is _F and task.fwd_stage != action.stage


def _finished(task: Task) -> None:
    raise AssertionError(f"micro-batch {task.k}'s worker ran after its step")


def _reused_weight_pass(
    action: Action, mb: MicroBatch, transfers: StepTransfers, last: bool
) -> None:
    """W reusing what I computed, on the runtime's thread (NOTE [weight pass on several
    stages])."""
    scope = Scope(mb, transfers)
    scope.phase, scope.action = Phase.WEIGHT, action
    context = mb.context.copy()  # the input pass's worker may be inside mb.context
    scope.enter(context)
    if last:
        context.run(run_weight_gradients, mb)
        mb.release()
    else:
        context.run(run_stage_weight_gradients, mb, action.stage)


def _stage_hooks(stages: Sequence[Stage], held: tuple[int, ...], workers: _Workers) -> list[Any]:
    """Hooks on the held stages' modules: park on entry in forward, and where each output's
    gradient is ready in backward (NOTE [several stages on a rank])."""
    handles = []
    for stage in stages:
        if stage.stage_id not in held:
            continue

        def enter(module: Any, args: Any, stage_id: int = stage.stage_id) -> None:
            scope = _worker_scope()
            if scope is not None and scope.phase is Phase.FORWARD:
                workers.baton.wait_for(scope.task, Action(_F, stage_id, scope.task.k))
                scope.task.fwd_stage = stage_id
                if scope.mb.saved is not None:  # NOTE [weight pass on several stages]
                    scope.mb.saved.enter(stage_id)

        def leave(module: Any, args: Any, output: Any, stage_id: int = stage.stage_id) -> None:
            if _worker_scope() is None:
                return

            def ready(grad: torch.Tensor) -> None:
                scope = _worker_scope()
                if scope is not None:
                    workers.park(scope, stage_id)

            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(ready)

        # After the graph's hook moving the stage's inputs: that receive is still before the stage.
        handles.append(stage.module.register_forward_pre_hook(enter))
        handles.append(stage.module.register_forward_hook(leave))
    return handles


def _worker_scope() -> TaskScope | None:
    scope = _step_context.current.get()
    return scope if isinstance(scope, TaskScope) else None


def _thread_state() -> tuple[bool, bool, Any]:
    """The runtime thread's grad mode and CPU autocast, for a worker to start with."""
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )
