"""How a failure on a worker rank travels back to the test process.

An exception raised on a worker is pickled there and unpickled in the parent
so a test can ``isinstance``-check it. Not every exception survives that trip
(unpicklable attributes, a class the parent cannot import), so the worker also
sends the type name, message and formatted traceback as plain text; the parent
falls back to a :class:`RemoteError` built from them. Either way the remote
traceback text is kept, because it is the only record of where the rank failed.
"""

from __future__ import annotations

import pickle
import re
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ErrorReport:
    """What a worker sends for a raised exception: the pickle if possible, always text."""

    exc_bytes: bytes | None
    type_name: str
    message: str
    traceback: str


class RemoteError(Exception):
    """Stands in for a rank's exception that could not be brought back as itself.

    Also used for a worker process that died (``type_name == "WorkerDied"``)
    and for a rank that never answered (``type_name == "RankTimeout"``).
    """

    def __init__(self, rank: int, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(rank, type_name, message, traceback)
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.remote_traceback = traceback

    def __str__(self) -> str:
        return f"[rank {self.rank}] {self.type_name}: {self.message}"


class RankFailure(AssertionError):
    """One or more ranks raised (or died) while running a job.

    An ``AssertionError`` so pytest reports it as a test failure, with every
    failing rank's remote traceback in the message.
    """

    def __init__(
        self,
        fn_name: str,
        world_size: int,
        failures: dict[int, BaseException],
        stuck_ranks: tuple[int, ...] = (),
        grace: float = 0.0,
    ) -> None:
        self.failures = failures
        self.stuck_ranks = stuck_ranks
        lines = [f"{fn_name} failed on rank(s) {sorted(failures)} of a world of {world_size}."]
        for rank in sorted(failures):
            exc = failures[rank]
            lines.append(f"----- rank {rank}: {describe(exc)} -----")
            lines.append(remote_traceback(exc).rstrip() or "(no traceback)")
        if stuck_ranks:
            lines.append(
                f"rank(s) {list(stuck_ranks)} were still running {grace:g} s after the first "
                "failure (probably waiting in a collective); the pool was restarted."
            )
        super().__init__("\n".join(lines))


class RankTimeout(TimeoutError):
    """Some ranks did not answer within the job's timeout; the pool was killed."""

    def __init__(self, message: str, stuck_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.stuck_ranks = stuck_ranks


def describe(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return f"{exc.type_name}: {exc.message}"
    return f"{type(exc).__qualname__}: {exc}"


def remote_traceback(exc: BaseException) -> str:
    return str(getattr(exc, "remote_traceback", ""))


def report_exception(exc: BaseException) -> ErrorReport:
    """Worker side: package ``exc`` (being handled now) for the parent."""
    text = "".join(traceback.format_exception(exc))
    try:
        exc_bytes: bytes | None = pickle.dumps(exc)
    except Exception:
        exc_bytes = None
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of {type(exc).__qualname__} failed>"
    return ErrorReport(exc_bytes, type(exc).__qualname__, message, text)


def rebuild_exception(report: ErrorReport, rank: int) -> BaseException:
    """Parent side: the rank's exception itself if it unpickles, else a RemoteError."""
    if report.exc_bytes is not None:
        try:
            exc = pickle.loads(report.exc_bytes)
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            try:
                exc.remote_traceback = report.traceback  # type: ignore[attr-defined]
            except AttributeError:  # e.g. a class with __slots__
                return RemoteError(rank, report.type_name, report.message, report.traceback)
            if hasattr(exc, "add_note"):  # Python >= 3.11: pytest then prints it too
                exc.add_note(f"[raised on rank {rank}; remote traceback]\n{report.traceback}")
            return exc
    return RemoteError(rank, report.type_name, report.message, report.traceback)


def split_replies(
    replies: dict[int, tuple[str, Any]], died: dict[int, int | None]
) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Parent side: unpickled results and rebuilt exceptions, by rank."""
    results: dict[int, Any] = {}
    failures: dict[int, BaseException] = {}
    for rank, code in died.items():
        message = f"worker process died with exit code {code} while running the job"
        failures[rank] = RemoteError(rank, "WorkerDied", message + "; the pool was restarted.")
    for rank, (kind, body) in replies.items():
        if kind == "raised":
            failures[rank] = rebuild_exception(body, rank)
            continue
        try:
            results[rank] = pickle.loads(body)
        except Exception as exc:
            message = f"could not unpickle the rank's result in the test process: {exc}"
            failures[rank] = RemoteError(rank, type(exc).__qualname__, message)
    return results, failures


@dataclass(frozen=True)
class Outcomes:
    """Per-rank results of :meth:`DistributedPool.run_expect_errors`, in rank order.

    Each entry is the rank's return value or the exception it raised (a
    :class:`RemoteError` when it could not be rebuilt, died or never answered).
    ``elapsed`` is the wall time until the last rank answered, so a test can
    check that a mistake became an error on every rank rather than a hang.
    """

    outcomes: list[Any]
    elapsed: float
    stuck_ranks: tuple[int, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.outcomes)

    def __getitem__(self, rank: int) -> Any:
        return self.outcomes[rank]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outcomes)

    @property
    def errors(self) -> dict[int, BaseException]:
        return {r: o for r, o in enumerate(self.outcomes) if isinstance(o, BaseException)}

    def assert_all_raised(
        self,
        exc_type: type[BaseException] = Exception,
        match: str | None = None,
        within: float | None = None,
    ) -> None:
        """Assert every rank raised ``exc_type`` whose message matches ``match`` (regex).

        A :class:`RemoteError` counts when its ``type_name`` is ``exc_type``'s name.
        """
        problems = []
        for rank, outcome in enumerate(self.outcomes):
            if not _is_instance(outcome, exc_type):
                kind = describe(outcome) if isinstance(outcome, BaseException) else repr(outcome)
                problems.append(f"rank {rank}: expected {exc_type.__qualname__}, got {kind}")
            elif match is not None and not re.search(match, str(outcome)):
                problems.append(f"rank {rank}: message {str(outcome)!r} does not match {match!r}")
        if within is not None and self.elapsed > within:
            problems.append(f"took {self.elapsed:.1f} s, more than the allowed {within:g} s")
        if problems:
            raise AssertionError("\n".join(problems))


def _is_instance(outcome: Any, exc_type: type[BaseException]) -> bool:
    if isinstance(outcome, exc_type):
        return True
    return isinstance(outcome, RemoteError) and outcome.type_name == exc_type.__qualname__
