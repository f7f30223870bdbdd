"""The shared-memory table of the metadata check, driven by threads (no process group).

Each thread plays one rank with its own mapping of the same file, as the ranks
of one host do (NOTE [shared-memory meta check]).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sbpflow.comm import _futex, _shared_memory, _shared_table
from sbpflow.comm._shared_table import SharedTable

WIDTH = 5


def _tables(tmp_path: Path, world: int, pids: list[int] | None = None) -> list[SharedTable]:
    path = str(tmp_path / "table")
    _shared_table.create_file(path, world, WIDTH)
    pids = pids or [os.getpid()] * world
    return [_shared_table.map_table(path, r, world, WIDTH, pids) for r in range(world)]


def _in_threads(world: int, job: Callable[[int], object]) -> list[object]:
    results: list[object] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = job(rank)
        except BaseException as error:  # returned to the test, which checks it
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_gets_every_rank_row_over_many_rounds(tmp_path: Path, world: int) -> None:
    tables = _tables(tmp_path, world)

    def rounds(rank: int) -> list[list[list[int]]]:
        seen = []
        for call in range(50):  # both slots, many times; ranks drift apart within a call
            if (rank + call) % 7 == 0:
                time.sleep(0.001)
            values = [rank, call, -rank * call, 2**62 + rank, call * 1000 + rank]
            seen.append(tables[rank].gather(values, timeout_s=30))
        return seen

    results = _in_threads(world, rounds)
    for seen in results:
        assert not isinstance(seen, BaseException), seen
        for call, rows in enumerate(seen):  # type: ignore[arg-type]
            assert rows == [[r, call, -r * call, 2**62 + r, call * 1000 + r] for r in range(world)]


def test_a_rank_that_never_arrives_times_out_and_the_table_stays_failed(tmp_path: Path) -> None:
    tables = _tables(tmp_path, 2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 1 s .*ranks \[1\] never arrived"):
        tables[0].gather([1, 2, 3, 4, 5], timeout_s=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="out of step; restart the job"):
        tables[0].gather([1, 2, 3, 4, 5], timeout_s=1.0)


def test_a_peer_process_that_exited_is_noticed_before_the_timeout(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: the pid no longer exists
    tables = _tables(tmp_path, 2, pids=[os.getpid(), gone.pid])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {gone.pid}\) exited"):
        tables[0].gather([1, 2, 3, 4, 5], timeout_s=60.0)
    assert time.monotonic() - start < 5


def test_an_unreaped_exited_peer_counts_as_exited(tmp_path: Path) -> None:
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _shared_memory.is_alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exits, and stays a zombie until wait() below
    try:
        assert not _shared_memory.is_alive(zombie.pid)
        assert _shared_memory.is_alive(os.getpid())
    finally:
        zombie.wait()


def test_wrong_width_is_refused(tmp_path: Path) -> None:
    (table,) = _tables(tmp_path, 1)
    with pytest.raises(ValueError, match="expected 5 values, got 2"):
        table.gather([1, 2], timeout_s=1.0)


def test_the_probe_sees_only_ranks_that_wrote(tmp_path: Path) -> None:
    tables = _tables(tmp_path, 3)
    tables[0].write_probe()
    tables[2].write_probe()
    assert not tables[0].probe_sees_everyone()
    tables[1].write_probe()
    assert all(t.probe_sees_everyone() for t in tables)


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SBPFLOW_SHARED_MEMORY", "0")
    assert not _shared_memory.enabled_by_environment()
    monkeypatch.setenv("SBPFLOW_SHARED_MEMORY", "1")
    assert _shared_memory.enabled_by_environment()
    monkeypatch.delenv("SBPFLOW_SHARED_MEMORY")
    assert _shared_memory.enabled_by_environment()


needs_futex = pytest.mark.skipif(not _futex.AVAILABLE, reason="needs the Linux futex call")


@needs_futex
def test_futex_wait_returns_when_the_word_differs_and_times_out_when_it_does_not() -> None:
    word = ctypes.c_int(5)
    start = time.monotonic()
    _futex.wait(ctypes.addressof(word), 6, timeout_s=5.0)  # differs: at once
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    _futex.wait(ctypes.addressof(word), 5, timeout_s=0.2)  # equal: sleeps out the timeout
    assert 0.15 <= time.monotonic() - start < 2.0


@needs_futex
def test_futex_wake_all_wakes_a_sleeper_at_once() -> None:
    word = ctypes.c_int(0)
    woke_after: list[float] = []

    def sleeper() -> None:
        start = time.monotonic()
        _futex.wait(ctypes.addressof(word), 0, timeout_s=20.0)
        woke_after.append(time.monotonic() - start)

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.2)  # let it fall asleep
    word.value = 1
    _futex.wake_all(ctypes.addressof(word))
    thread.join(timeout=20)
    assert woke_after and woke_after[0] < 5.0, woke_after


def test_without_futexes_the_table_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_futex, "AVAILABLE", False)
    tables = _tables(tmp_path, 2)
    assert all(t._waiter._address == 0 for t in tables)
    results = _in_threads(
        2, lambda rank: [tables[rank].gather([rank] * WIDTH, 30) for _ in range(20)]
    )
    assert results == [[[[0] * WIDTH, [1] * WIDTH]] * 20] * 2


def test_the_table_file_is_private_and_never_reused(tmp_path: Path) -> None:
    path = str(tmp_path / "table")
    _shared_table.create_file(path, 2, WIDTH)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.path.getsize(path) == SharedTable.size_in_bytes(2, WIDTH)
    with pytest.raises(FileExistsError):
        _shared_table.create_file(path, 2, WIDTH)
