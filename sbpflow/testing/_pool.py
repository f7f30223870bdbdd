"""A pool of long-lived worker processes, one per rank, that run test jobs together.

Spawning a rank and forming a gloo group costs seconds on a small CI machine,
so a pool starts its workers once and runs many jobs on them (DESIGN §7). The
price is that one bad job can leave workers stuck inside a collective; the
pool then kills them and starts fresh ones on the next job, so one failing
test never poisons the next.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from ._errors import Outcomes, RankFailure, RankTimeout, RemoteError, split_replies
from ._transport import environ, format_stacks, free_port, job_name, pickle_job
from ._worker import worker_main

_SPAWN = mp.get_context("spawn")
_STACK_DUMP_WAIT_S = 0.5  # time for faulthandler to write a stuck rank's stacks


@dataclass
class _Gathered:
    """What came back from one message per rank (or did not)."""

    replies: dict[int, tuple[str, Any]] = field(default_factory=dict)
    died: dict[int, int | None] = field(default_factory=dict)
    stuck: tuple[int, ...] = ()
    stacks: dict[int, str] = field(default_factory=dict)

    def open_ranks(self, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r not in self.replies and r not in self.died]

    @property
    def any_failed(self) -> bool:
        return bool(self.died) or any(
            k in ("raised", "init_error") for k, _ in self.replies.values()
        )


class DistributedPool:
    """``world_size`` spawned ranks on one machine, sharing a gloo process group.

    Each worker sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and OMP_NUM_THREADS=1, then joins the world through
    ``sbpflow.env.ensure_initialized()`` as a launched rank would. Jobs must be
    module-level functions of importable modules (e.g. ``tests.dist.test_x``).
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        grace: float = 10.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
        if timeout <= 0 or grace < 0:
            raise ValueError(f"timeout must be > 0 and grace >= 0, got {timeout!r} and {grace!r}.")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.grace = float(grace)
        self.env = dict(env or {})  # extra environment for the ranks (restarts keep it)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._stack_dir: str | None = None
        self._job_id = 0
        self.num_starts = 0
        self._start()

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return f"DistributedPool(world_size={self.world_size}, {state}, starts={self.num_starts})"

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises :class:`RankFailure` if any rank raised or died, with each one's
        traceback, and :class:`RankTimeout` if some rank did not answer within
        ``self.timeout`` seconds (the pool is then restarted on the next job).
        """
        __tracebackhide__ = True  # pytest: show the test's line and the ranks' tracebacks
        got = self._submit(fn, args, kwargs, self.timeout, self.grace)
        name = job_name(fn)
        results, failures = split_replies(got.replies, got.died)
        if failures:
            raise RankFailure(name, self.world_size, failures, got.stuck, self.grace)
        if got.stuck:
            message = (
                f"{name} did not finish within {self.timeout:g} s on rank(s) {list(got.stuck)} "
                f"of a world of {self.world_size} (rank(s) {sorted(results)} finished); the "
                "workers were killed and the next job starts a fresh pool."
            )
            raise RankTimeout(message + format_stacks(got.stacks), got.stuck)
        return [results[rank] for rank in range(self.world_size)]

    def run_expect_errors(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any
    ) -> Outcomes:
        """Run ``fn`` on every rank and return each rank's result or exception, never raising.

        Every rank gets the full ``timeout``; a rank still running then is
        reported as a ``RankTimeout`` :class:`RemoteError` and the pool restarts.
        """
        start = time.monotonic()
        got = self._submit(fn, args, kwargs, timeout, grace=timeout)
        elapsed = time.monotonic() - start
        results, failures = split_replies(got.replies, got.died)
        outcomes: list[Any] = []
        for rank in range(self.world_size):
            if rank in got.stuck:
                message = f"did not answer within {timeout:g} s"
                outcomes.append(RemoteError(rank, "RankTimeout", message, got.stacks.get(rank, "")))
            else:
                outcomes.append(failures[rank] if rank in failures else results[rank])
        return Outcomes(outcomes, elapsed, got.stuck)

    def close(self) -> None:
        """Stop the workers: ask them to exit (so they can flush, e.g. coverage), then kill."""
        self.request_stop()
        self.join_or_kill(time.monotonic() + 2.0)

    def request_stop(self) -> None:
        """Tell every worker to exit after its current job; returns at once."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)

    def join_or_kill(self, deadline: float) -> None:
        """Wait until ``deadline`` (a ``time.monotonic()``) for workers to exit, then kill the rest."""
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    # -- internals ---------------------------------------------------------------

    def _start(self) -> None:
        for attempt in range(2):
            try:
                self._spawn_and_join_world()
            except BaseException as exc:
                self._kill()
                # The port was free when chosen but another process may have
                # taken it before rank 0 bound it: one retry on a new port.
                if attempt == 0 and "address already in use" in str(exc).lower():
                    continue
                raise
            self.num_starts += 1
            return

    def _spawn_and_join_world(self) -> None:
        port = free_port()
        self._stack_dir = tempfile.mkdtemp(prefix="sbpflow-pool-")
        for rank in range(self.world_size):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                **self.env,
            }
            parent_conn, child_conn = _SPAWN.Pipe(duplex=True)
            stack_file = os.path.join(self._stack_dir, f"rank{rank}.txt")
            proc = _SPAWN.Process(
                target=worker_main,
                args=(env, stack_file, child_conn),
                name=f"sbpflow-rank{rank}-of-{self.world_size}",
                daemon=True,
            )
            with environ(env):  # set before the child's interpreter (and OpenMP) starts
                proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        got = self._gather(None, timeout=max(self.timeout, 60.0), grace=5.0)
        errors = {r: body for r, (kind, body) in got.replies.items() if kind == "init_error"}
        if errors or got.died or got.stuck:
            details = "".join(f"\n----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
            raise RuntimeError(
                f"could not start a pool of {self.world_size} ranks on port {port}: "
                f"init errors on {sorted(errors)}, died {sorted(got.died)}, "
                f"no answer from {list(got.stuck)}.{details}"
            )

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        grace: float,
    ) -> _Gathered:
        payload = pickle_job(fn, args, kwargs)
        if not self.alive:  # killed after a failure, or a worker died while idle
            self._kill()
            self._start()
        self._job_id += 1
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead worker is reported by _gather
                conn.send((self._job_id, payload))
        try:
            got = self._gather(self._job_id, timeout, grace)
        except BaseException:  # e.g. Ctrl-C: the ranks are mid-job, so start over
            self._kill()
            raise
        if got.stuck or got.died:
            self._kill()
        return got

    def _gather(self, job_id: int | None, timeout: float, grace: float) -> _Gathered:
        """Wait for one message per rank; after the first failure wait only ``grace`` more."""
        got = _Gathered()
        deadline = time.monotonic() + timeout
        while True:
            open_ranks = got.open_ranks(self.world_size)
            remaining = deadline - time.monotonic()
            if not open_ranks or remaining <= 0:
                break
            waitables: list[Any] = [self._conns[r] for r in open_ranks]
            waitables += [self._procs[r].sentinel for r in open_ranks]
            wait(waitables, remaining)
            for rank in open_ranks:
                self._poll_rank(rank, job_id, got)
            if got.any_failed:
                deadline = min(deadline, time.monotonic() + grace)
        got.stuck = tuple(open_ranks)
        if got.stuck and job_id is not None:
            got.stacks = self._dump_stacks(got.stuck)
        return got

    def _poll_rank(self, rank: int, job_id: int | None, got: _Gathered) -> None:
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            while conn.poll():
                kind, reply_id, body = conn.recv()
                if reply_id == job_id:
                    got.replies[rank] = (kind, body)
                    return
        except (EOFError, OSError):
            pass
        if not proc.is_alive():
            proc.join(0.1)
            got.died[rank] = proc.exitcode

    def _dump_stacks(self, ranks: tuple[int, ...]) -> dict[int, str]:
        """Ask stuck ranks for their Python stacks (see ``worker_main``)."""
        if self._stack_dir is None or not hasattr(signal, "SIGUSR1"):
            return {}
        for rank in ranks:
            pid = self._procs[rank].pid
            if pid is not None and self._procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(_STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in ranks:
            try:
                with open(os.path.join(self._stack_dir, f"rank{rank}.txt")) as f:
                    stacks[rank] = f.read()
            except OSError:
                pass
        return stacks

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)
            self._stack_dir = None
