"""Threads that carry the micro-batch workers of a rank holding several stages, kept across steps.

# NOTE [worker threads kept across steps]
# A rank holding several stages runs each micro-batch's passes on a worker thread (NOTE
# [several stages on a rank] in _workers.py). Starting a fresh thread per micro-batch and
# step cost more than the thread itself: each new thread computed in memory the C allocator
# had handed back to the system, and faulted it in again. Measured on bench/pipeline part 5
# (interleaved_1f1b, 4 stages on 2 ranks, 4 micro-batches of 32 x 1024): 11,600 to 17,400
# minor page faults per step on the workers against 3,000 on torch's one thread, and a
# quarter more CPU time in the stages' compute; on threads kept from one step to the next,
# 4,100 to 5,100 faults and the compute's CPU time on par with torch's. So the graph keeps
# its carriers: a worker runs on an idle one, or on a new one when all are busy (as many as
# micro-batches are alive at once on the rank), and hands it back when its passes end. Each
# pass restores the thread's grad mode and autocast state on its way out, so a carrier starts
# every worker as a fresh thread would. The carriers end when the graph is collected or at
# exit, before the interpreter finalizes: ``close`` wakes each idle one to return, and waits.
# A process forked from one holding carriers has none of their threads (fork copies only the
# thread that forks, and maybe a lock another thread held): its first job starts afresh,
# with no carrier and a new lock.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Carriers"]

_STOP = None


class _Carrier:
    """One thread running the jobs put on its queue, one at a time."""

    def __init__(self, owner: Carriers) -> None:
        self._owner = owner
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._loop, name="sbpflow-pipeline-worker", daemon=True
        )
        self.thread.start()

    def put(self, job: Any) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, args, finished = job
            returned = False
            try:
                fn(*args)
                returned = True
            finally:
                # An idle carrier holds nothing of its last job (its micro-batch, the graph).
                del job, fn, args
                self._owner._idle(self, returned)
                finished.set()


class Carriers:
    """The worker threads of one graph's steps (NOTE [worker threads kept across steps])."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._free: list[_Carrier] = []
        self._all: list[_Carrier] = []
        self._closed = False

    def start(self, fn: Callable[..., Any], *args: Any) -> threading.Event:
        """Run ``fn(*args)`` on an idle carrier (a new one if none is idle); the event is set
        when it returns."""
        finished = threading.Event()
        if os.getpid() != self._pid:  # forked: the carriers' threads stayed in the parent
            self._pid, self._lock, self._free, self._all = os.getpid(), threading.Lock(), [], []
        with self._lock:
            if self._closed:
                raise RuntimeError("the pipeline's worker threads were closed with their graph.")
            carrier = self._free.pop() if self._free else None
            if carrier is None:
                carrier = _Carrier(self)
                self._all.append(carrier)
        carrier.put((fn, args, finished))
        return finished

    def _idle(self, carrier: _Carrier, returned: bool) -> None:
        """``carrier``'s job ended; one that raised ends its thread, so it is never handed a
        job again."""
        with self._lock:
            if not returned:
                self._all.remove(carrier)
            elif self._closed:
                carrier.put(_STOP)
            else:
                self._free.append(carrier)

    @property
    def num_threads(self) -> int:
        """How many carriers are alive (idle or busy)."""
        return len(self._all)

    def close(self) -> None:
        """End every carrier: the idle ones now (waited for, so that none is left when the
        interpreter finalizes), a busy one when its job returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free, self._free = self._free, []
        for carrier in free:
            carrier.put(_STOP)
        for carrier in free:
            if carrier.thread is not threading.current_thread():
                carrier.thread.join(timeout=5)
