"""The parts of ``sbpflow.testing`` that need no worker processes.

Error transport, job pickling, the worker's job runner and the outcome
assertions are plain functions, so they are tested here in one process; the
pool on real ranks is tested in ``tests/dist/test_harness.py``.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading

import pytest

from sbpflow.testing import DistributedPool, Outcomes, RankFailure, RemoteError, free_port
from sbpflow.testing._errors import rebuild_exception, report_exception
from sbpflow.testing._transport import environ, pickle_job
from sbpflow.testing._worker import _run_job


class _NeedsTwoArgs(Exception):
    """Pickles, but cannot be rebuilt: unpickling calls ``cls(*self.args)`` with one arg."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


class _HoldsALock(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def _report_of(exc: BaseException) -> object:
    try:
        raise exc
    except BaseException as raised:
        return report_exception(raised)


def _add(a: int, b: int = 0) -> int:
    return a + b


def _fail() -> None:
    raise KeyError("missing")


def _unpicklable_result() -> threading.Lock:
    return threading.Lock()


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_bad_pool_arguments_fail_before_spawning() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        DistributedPool(0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        DistributedPool(2, timeout=0)


def test_a_lambda_job_is_rejected_with_advice() -> None:
    with pytest.raises(TypeError, match="module-level functions"):
        pickle_job(lambda: 1, (), {})


def test_an_exception_comes_back_as_itself_with_the_remote_traceback() -> None:
    exc = rebuild_exception(_report_of(ValueError("bad shape")), rank=3)  # type: ignore[arg-type]
    assert isinstance(exc, ValueError) and str(exc) == "bad shape"
    assert "ValueError: bad shape" in exc.remote_traceback  # type: ignore[attr-defined]
    if sys.version_info >= (3, 11):
        assert any("raised on rank 3" in note for note in exc.__notes__)


@pytest.mark.parametrize("exc", [_HoldsALock(), _NeedsTwoArgs("a", "b")])
def test_an_exception_that_cannot_travel_becomes_remote_error(exc: Exception) -> None:
    rebuilt = rebuild_exception(_report_of(exc), rank=1)  # type: ignore[arg-type]
    assert isinstance(rebuilt, RemoteError)
    assert rebuilt.rank == 1 and rebuilt.type_name == type(exc).__qualname__
    assert rebuilt.message == str(exc)
    assert str(exc) in rebuilt.remote_traceback
    assert str(rebuilt) == f"[rank 1] {type(exc).__qualname__}: {exc}"


def test_rank_failure_lists_every_failing_rank_and_the_stuck_ones() -> None:
    failures = {
        2: rebuild_exception(_report_of(KeyError("k")), rank=2),  # type: ignore[arg-type]
        0: RemoteError(0, "WorkerDied", "exit code -9"),
    }
    failure = RankFailure("tests.x._job", 4, failures, stuck_ranks=(1,), grace=10)
    assert isinstance(failure, AssertionError)
    text = str(failure)
    assert text.startswith("tests.x._job failed on rank(s) [0, 2] of a world of 4.")
    assert "----- rank 0: WorkerDied: exit code -9 -----" in text
    assert "----- rank 2: KeyError: 'k' -----" in text and "in _report_of" in text
    assert "rank(s) [1] were still running 10 s after the first failure" in text


def test_the_worker_job_runner_reports_results_and_errors() -> None:
    kind, body = _run_job(pickle.dumps((_add, (2,), {"b": 3})))
    assert kind == "done" and pickle.loads(body) == 5
    kind, body = _run_job(pickle.dumps((_fail, (), {})))
    assert kind == "raised" and body.type_name == "KeyError" and "in _fail" in body.traceback
    kind, body = _run_job(pickle.dumps((_unpicklable_result, (), {})))
    assert kind == "raised" and "could not be pickled" in body.message


def test_outcomes_assertions() -> None:
    remote = RemoteError(1, "ValueError", "bad dim 3")
    outcomes = Outcomes([ValueError("bad dim 2"), remote], elapsed=1.5)
    outcomes.assert_all_raised(ValueError, match=r"bad dim \d", within=2)
    assert outcomes.errors == {0: outcomes[0], 1: remote} and len(outcomes) == 2
    with pytest.raises(AssertionError, match=r"took 1\.5 s, more than the allowed 1 s"):
        outcomes.assert_all_raised(ValueError, within=1)
    with pytest.raises(AssertionError, match="does not match 'dim 9'"):
        outcomes.assert_all_raised(ValueError, match="dim 9")
    with pytest.raises(AssertionError, match="rank 1: expected TypeError, got ValueError"):
        Outcomes([TypeError(), remote], elapsed=0).assert_all_raised(TypeError)


def test_environ_sets_then_restores() -> None:
    os.environ.pop("SBPFLOW_TEST_UNSET", None)
    os.environ["SBPFLOW_TEST_SET"] = "old"
    try:
        with environ({"SBPFLOW_TEST_UNSET": "1", "SBPFLOW_TEST_SET": "new"}):
            assert os.environ["SBPFLOW_TEST_UNSET"] == "1"
            assert os.environ["SBPFLOW_TEST_SET"] == "new"
        assert "SBPFLOW_TEST_UNSET" not in os.environ
        assert os.environ["SBPFLOW_TEST_SET"] == "old"
    finally:
        os.environ.pop("SBPFLOW_TEST_SET", None)
