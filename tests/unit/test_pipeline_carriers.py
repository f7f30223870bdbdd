"""``Carriers``: the worker threads a graph keeps across steps (NOTE [worker threads kept across
steps] in sbpflow/nn/pipeline/runtime/_carriers.py), checked from the threads themselves."""

from __future__ import annotations

import contextvars
import gc
import os
import threading
import types
import weakref
from typing import Any

import pytest

from sbpflow.nn.pipeline.runtime import Carriers


def _ran_on(into: list[threading.Thread], *_: object) -> None:
    into.append(threading.current_thread())


def test_a_job_after_another_runs_on_the_same_thread() -> None:
    carriers = Carriers()
    seen: list[threading.Thread] = []
    try:
        for _ in range(3):
            assert carriers.start(_ran_on, seen).wait(10)
        assert len(seen) == 3 and seen[0] is seen[1] is seen[2]
        assert seen[0] is not threading.current_thread()
        assert carriers.num_threads == 1
    finally:
        carriers.close()


def test_jobs_alive_at_once_run_on_threads_of_their_own() -> None:
    carriers = Carriers()
    release = threading.Event()
    seen: list[threading.Thread] = []

    def held(*_: object) -> None:
        seen.append(threading.current_thread())
        release.wait(10)

    try:
        done = [carriers.start(held) for _ in range(3)]
        release.set()
        assert all(d.wait(10) for d in done)
        assert len({id(t) for t in seen}) == 3 and carriers.num_threads == 3
    finally:
        carriers.close()


def test_an_idle_thread_holds_nothing_of_its_last_job() -> None:
    class Payload:
        pass

    carriers = Carriers()
    payload = Payload()
    gone = weakref.ref(payload)
    try:
        assert carriers.start(_ran_on, [], payload).wait(10)
        del payload
        gc.collect()
        assert gone() is None
    finally:
        carriers.close()


def test_close_ends_every_thread_and_refuses_new_jobs() -> None:
    carriers = Carriers()
    seen: list[threading.Thread] = []
    assert carriers.start(_ran_on, seen).wait(10)
    carriers.close()
    seen[0].join(10)
    assert not seen[0].is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        carriers.start(_ran_on, seen)


def _raise() -> None:
    raise RuntimeError("a job whose own error handling failed")


def test_a_carrier_whose_job_raised_is_never_handed_another() -> None:
    """A job that raises ends its thread; the carrier leaves the pool, so the jobs after it
    run on live threads instead of waiting on a dead one's queue forever."""
    carriers = Carriers()
    caught: list[BaseException] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: caught.append(args.exc_value)  # expected, not printed
    try:
        assert carriers.start(_raise).wait(10)
        for carrier in list(carriers._all):
            carrier.thread.join(timeout=10)
        assert [type(e) for e in caught] == [RuntimeError]
        seen: list[threading.Thread] = []
        assert carriers.start(_ran_on, seen).wait(10)
        assert carriers.start(_ran_on, seen).wait(10)
        assert len(seen) == 2 and seen[0].is_alive()
        assert carriers.num_threads == 1
    finally:
        threading.excepthook = previous_hook
        carriers.close()


class _NoSecondThread(Carriers):
    """Carriers that cannot start a second worker (a thread or process limit reached)."""

    def __init__(self) -> None:
        super().__init__()
        self.starts = 0

    def start(self, fn: Any, *args: Any) -> threading.Event:
        self.starts += 1
        if self.starts == 2:
            raise RuntimeError("can't start new thread")
        return super().start(fn, *args)


def test_a_worker_that_cannot_start_is_an_error_not_a_hang() -> None:
    """Micro-batch 0's worker parks and hands the baton straight to micro-batch 1's, whose
    thread cannot start: the runtime's thread raises that error (before, it waited forever
    for a worker that never ran), and unwinding the parked worker waits for it alone."""
    from sbpflow.nn.pipeline.runtime._scope import Phase
    from sbpflow.nn.pipeline.runtime._workers import Baton, Task
    from sbpflow.nn.pipeline.schedules import Action, ActionKind

    forward = ActionKind.FORWARD

    def scope(k: int) -> Any:
        context = contextvars.Context()
        found = types.SimpleNamespace(
            mb=types.SimpleNamespace(index=k, context=context), phase=Phase.IDLE, action=None
        )
        found.enter = lambda _context: None
        return found

    carriers = _NoSecondThread()
    baton = Baton(carriers, [Action(forward, 0, 0), Action(forward, 0, 1)])

    def first(task: Task) -> None:
        task.fwd_stage = 0
        baton.wait_for(task, Action(forward, 2, 0))  # parks: the baton passes to micro-batch 1

    baton.plain(0, Task(scope(0), first))
    baton.plain(1, Task(scope(1), lambda _task: None))
    raised: list[BaseException] = []

    def runtime() -> None:
        try:
            baton.run_chain(0)
        except BaseException as error:  # reported below
            raised.append(error)

    thread = threading.Thread(target=runtime, daemon=True)
    thread.start()
    thread.join(timeout=20)
    try:
        assert not thread.is_alive(), "the runtime's thread still waits for the worker"
        assert [str(e) for e in raised] == ["can't start new thread"], raised
        baton.abort()  # the parked worker unwinds
    finally:
        carriers.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_forked_process_runs_its_jobs_on_threads_of_its_own() -> None:
    """The child of a fork has none of the parent's carrier threads: a job it starts must run
    (on a new thread of the child), not wait forever on a queue no thread reads."""
    carriers = Carriers()
    try:
        assert carriers.start(_ran_on, []).wait(10)  # the parent now holds an idle carrier
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report whether its job ran, then leave at once
            code = 1
            try:
                seen: list[threading.Thread] = []
                ran = carriers.start(_ran_on, seen).wait(10)
                code = 0 if ran and seen and seen[0] is not threading.current_thread() else 1
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
        os.close(write)
        answer = os.read(read, 1)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        assert answer == b"\x00" and os.waitstatus_to_exitcode(status) == 0, (answer, status)
    finally:
        carriers.close()
