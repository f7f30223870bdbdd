"""``BoundedDict`` (NOTE [bounded caches]): the bound holds, also while threads insert at once."""

from __future__ import annotations

import sys
import threading

import pytest

from sbpflow._bounded import BoundedDict


def test_an_insert_past_the_bound_drops_the_oldest_entry() -> None:
    cache: BoundedDict[str, int] = BoundedDict("test: oldest dropped", 2)
    cache["a"], cache["b"] = 1, 2
    cache["a"] = 10  # a key already held: nothing dropped, and it stays the oldest
    assert dict(cache) == {"a": 10, "b": 2}
    cache["c"] = 3
    assert dict(cache) == {"b": 2, "c": 3}


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BoundedDict("test: no room", 0)


def test_threads_inserting_at_once_neither_raise_nor_outgrow_the_bound() -> None:
    """Several dispatching threads evict from one cache: a thread whose oldest key another
    thread dropped first must not raise (KeyError, or a dict changing size while read)."""
    cache: BoundedDict[tuple[int, int], int] = BoundedDict("test: threads", 4)
    errors: list[BaseException] = []

    def insert(thread: int) -> None:
        try:
            for i in range(20_000):
                cache[(thread, i)] = i
        except BaseException as error:
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=insert, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    cache[(-1, -1)] = 0  # one insert alone brings a raced cache back to its bound
    assert len(cache) == 4
