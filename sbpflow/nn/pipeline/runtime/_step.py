"""The pipeline runtime: run one step's micro-batches through ``build`` in a schedule's order.

A schedule (``..schedules``) says, per rank, in which order the forwards (F),
backwards (B, or its halves I and W) and transfers of each (stage,
micro-batch) run. ``run_step`` runs that order on this rank and records what
ran, with times (``StepRecord``). A rank holding one stage runs every action
on its own thread (this module); a rank holding several hands them to
micro-batch worker threads (NOTE [several stages on a rank] in _workers.py).
NOTE [deferred backward], [one program, one message order] and [split
backward] in _scope.py say how a micro-batch's work becomes those actions;
NOTE [stages held elsewhere] in _held_elsewhere.py how a rank leaves the other
ranks' stages alone; NOTE [next action's receives] in _early.py how a rank
holding one stage receives the next action's input while it computes.

# NOTE [no garbage collection inside a step]
# Python's cyclic garbage collector runs when enough objects were allocated,
# at a moment of its choosing: on one rank, in the middle of an action, while
# the other ranks wait for that rank's next message. With many objects alive
# (a model, earlier graphs) a full collection takes milliseconds, and in a
# pipeline every rank pays each rank's pauses. Measured on bench/pipeline part
# 1 (4 ranks, timed-wait stages), ZBV with 16 micro-batches ran at a bubble of
# 9.4% to 11.0% (formula 3.0%) in four runs of the whole part, 4.8% with the
# collector off. So a pipelined step runs with the collector paused, as
# training loops that pace collections across ranks do; reference counting
# still frees everything not in a cycle, and the cycles a step leaves are
# collected after it, at the step's end, where every rank is anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...._global import GlobalTensor
from ....comm._world import get_rank
from ....placement import Placement
from ..schedules import Action, ActionKind, Schedule, StepRecord
from ._carriers import Carriers
from ._early import EarlyReceives
from ._held_elsewhere import HeldElsewhere
from ._held_here import HeldHere
from ._microbatch import MicroBatchArgs
from ._passes import Build, run_backward, run_forward, run_input_gradients, run_weight_gradients
from ._recorder import Recorder
from ._scope import MicroBatch, Phase, Scope
from ._stages import Stage
from ._transfers import make_lanes, step_transfers
from ._workers import run_on_workers

__all__ = ["compute_order", "run_step"]

_W = ActionKind.BACKWARD_WEIGHT


def run_step(
    build: Build,
    microbatches: Sequence[MicroBatchArgs],
    contexts: Sequence[contextvars.Context],
    schedule: Schedule,
    stages: Sequence[Stage],
    held_elsewhere: HeldElsewhere,
    held_here: HeldHere,
    early_receives: EarlyReceives,
    carriers: Carriers | None = None,
) -> tuple[list[Any], StepRecord]:
    """Run ``build`` on each micro-batch in ``schedule``'s order on this rank.

    ``contexts`` holds each micro-batch's ``contextvars.Context``. Returns
    ``build``'s outputs in micro-batch order and the record of what this rank
    ran. A rank holding no stage runs the micro-batches one after another (the
    stages are all held elsewhere) and records nothing. ``carriers``: the worker
    threads of a rank holding several stages, kept by the caller across steps
    (NOTE [worker threads kept across steps] in _carriers.py); without them, the
    step starts its own and ends them.
    """
    rank = get_rank()
    holder = next(
        (s.placement.flat_ranks[0] for s in stages if rank in s.placement.flat_ranks), None
    )
    todo = compute_order(schedule, holder, len(microbatches))
    held = schedule.stages_of(holder) if holder is not None else ()
    # NOTE [weight pass] in _weight_pass.py: each micro-batch whose backward this rank
    # splits reuses what its input pass computed, on a rank holding several stages where it
    # can (NOTE [weight pass on several stages] in _workers.py), except on a rank holding
    # the first stage only. There I computes nothing inside the stage (its input needs no
    # gradient), so W runs the stage's whole backward either way; run from the loss again it
    # re-runs only the stand-ins and hand-offs after the stage, cheaper than finding where
    # the weights branch off, and it frees each saved tensor as it goes (measured in
    # bench/pipeline part 4: (I + W) / B 0.98 this way, 1.06-1.09 reusing).
    split = set() if held == (0,) else {a.microbatch for a in todo if a.kind is _W}
    mbs = [
        MicroBatch(k, args, kwargs, context, k in split)
        for k, ((args, kwargs), context) in enumerate(zip(microbatches, contexts, strict=True))
    ]
    for mb in mbs:
        mb.no_gradient = (held_elsewhere.anchor,)
    recorder = Recorder(rank, stages)
    # NOTE [lanes] in _transfers.py: every pair the step moves data between, before any
    # action, on every rank
    make_lanes(stages, _input_placements(microbatches))
    with (
        _released(mbs),
        held_elsewhere.installed(stages, rank),
        held_here.installed(stages, rank),
        _collector_paused(),  # NOTE [no garbage collection inside a step]
        step_transfers(recorder.observe) as sends,  # NOTE [deferred sends] in _transfers.py
        torch.autograd.set_multithreading_enabled(False),  # NOTE [pipeline step context]
    ):
        if len(held) > 1:
            threads = carriers if carriers is not None else Carriers()
            try:
                run_on_workers(todo, mbs, build, held, stages, recorder, sends, threads)
            finally:
                if carriers is None:
                    threads.close()
        else:
            scopes = [Scope(mb, sends) for mb in mbs]
            for mb, scope in zip(mbs, scopes, strict=True):
                scope.enter(mb.context)
            receives = early_receives.start(sends, schedule, microbatches, stages)
            for index, action in enumerate(todo):
                mb = mbs[action.microbatch]
                start = time.monotonic()
                receives.before(index)
                mb.context.run(run_action, action, scopes[action.microbatch], build)
                recorder.add(action, start, time.monotonic())
            receives.finish()
    ranks = (rank,) if holder is not None else ()
    timings = tuple(recorder.timings) if holder is not None else ()
    record = StepRecord(schedule, ranks, timings, tuple(recorder.messages))
    return [mb.output for mb in mbs], record


def _input_placements(microbatches: Sequence[MicroBatchArgs]) -> list[Placement]:
    """The placements of the global tensors in the step's arguments, in argument order."""
    leaves = torch.utils._pytree.tree_leaves([list(mb) for mb in microbatches[:1]])
    return list(dict.fromkeys(t.placement for t in leaves if isinstance(t, GlobalTensor)))


@contextlib.contextmanager
def _released(mbs: Sequence[MicroBatch]) -> Iterator[None]:
    """Release each micro-batch's graph when the block ends, also when it raises: a split
    micro-batch's saved tensors are held by the micro-batch (NOTE [saved tensors of a split
    micro-batch] in _weight_pass.py), in a cycle through its graph."""
    try:
        yield
    finally:
        for mb in mbs:
            mb.release()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the block runs (as it was before after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def compute_order(schedule: Schedule, holder: int | None, num_microbatches: int) -> list[Action]:
    """The compute actions this rank runs, in order (the schedule's list for its stages)."""
    if holder is None:
        forward, backward = ActionKind.FORWARD, ActionKind.BACKWARD
        return [Action(kind, 0, k) for k in range(num_microbatches) for kind in (forward, backward)]
    return [a for a in schedule.actions[holder] if a.is_compute]


def run_action(action: Action, scope: Scope, build: Build) -> None:
    """Run one compute action of ``scope``'s micro-batch on this thread (in its context)."""
    mb, kind = scope.mb, action.kind
    scope.action = action
    try:
        if kind is ActionKind.FORWARD:
            run_forward(scope, build)
        elif kind is ActionKind.BACKWARD:
            scope.phase = Phase.BACKWARD
            run_backward(mb)
            mb.release()
        elif kind is ActionKind.BACKWARD_INPUT:
            scope.phase = Phase.INPUT
            run_input_gradients(mb)
        elif kind is ActionKind.BACKWARD_WEIGHT:
            scope.phase = Phase.WEIGHT
            run_weight_gradients(mb)
            mb.release()
        else:  # pragma: no cover - transfers are not compute actions
            raise AssertionError(f"not a compute action: {action}")
    finally:
        scope.phase = Phase.IDLE
        scope.action = None
