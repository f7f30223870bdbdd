"""Several stages on one rank (interleaved 1F1B): each micro-batch's step on a thread of its own.

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
#   - about to receive a gradient in backward: B(the held stage whose forward
#     sent the tensor, k), noted on the autograd node in forward.
# The runtime grants the actions in the schedule's order; a worker parked on
# another action than the one granted means the model's stages do not follow
# the schedule (e.g. a stage called twice) and is an error. Grad mode and
# autocast are thread-local, so each worker starts with the runtime's. On CPU
# the autograd engine runs the backward on the calling thread, the worker; on
# CUDA it runs on the device's thread, which parks the same way (the baton
# belongs to the micro-batch, not to a thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .pipeline import Action

__all__ = ["Baton", "Task"]


class _Abort(BaseException):
    """Unwinds a parked worker when the step fails elsewhere."""


class Task:
    """Micro-batch k's forward and backward, run on a worker thread one granted action at a time."""

    def __init__(self, k: int, body: Callable[[Task], None]) -> None:
        self.k = k
        self.body = body
        self.granted: Action | None = None
        self.need: Action | None = None  # what it waits for while parked
        self.fwd_stage = -1  # the last held stage its forward entered
        self.done = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


class Baton:
    """Exactly one of the runtime's thread and the workers runs at a time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._running: Task | None = None
        self._aborted = False
        self._tasks: list[Task] = []

    def grant(self, task: Task, action: Action) -> None:
        """Let ``task`` run ``action``; return when it parks or finishes (runtime's thread)."""
        with self._cv:
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
            self._running = task
            if task.thread is None:
                task.thread = threading.Thread(
                    target=self._work, args=(task, _thread_state()), daemon=True
                )
                self._tasks.append(task)
                task.thread.start()
            else:
                self._cv.notify_all()
            self._cv.wait_for(lambda: self._running is None)
        if task.error is not None:
            error, task.error = task.error, None
            raise error

    def wait_for(self, task: Task, action: Action) -> None:
        """Park ``task`` until ``action`` is granted to it (a worker, or the autograd engine)."""
        if task.granted == action:
            return
        with self._cv:
            task.need = action
            self._running = None
            self._cv.notify_all()
            self._cv.wait_for(
                lambda: self._aborted or (self._running is task and task.granted == action)
            )
            if self._aborted:
                raise _Abort

    def abort(self) -> None:
        """Unwind every parked worker and wait for them (after a failure, or at the end)."""
        with self._cv:
            self._aborted = True
            self._cv.notify_all()
        for task in self._tasks:
            assert task.thread is not None
            task.thread.join(timeout=60)

    def _work(self, task: Task, state: tuple[bool, bool, torch.dtype]) -> None:
        grad, autocast, dtype = state
        try:
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype, enabled=autocast):
                task.body(task)
        except _Abort:
            pass
        except BaseException as error:  # handed to the runtime's thread, which raises it
            task.error = error
        finally:
            with self._cv:
                task.done = True
                task.need = None
                if self._running is task:
                    self._running = None
                self._cv.notify_all()


def _thread_state() -> tuple[bool, bool, Any]:
    """The runtime thread's grad mode and CPU autocast, for a worker to start with."""
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )
