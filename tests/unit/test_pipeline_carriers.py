"""``Carriers``: the worker threads a graph keeps across steps (NOTE [worker threads kept across
steps] in sbpflow/nn/pipeline/runtime/_carriers.py), checked from the threads themselves."""

from __future__ import annotations

import gc
import threading
import weakref

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
