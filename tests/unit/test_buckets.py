"""Gradient bucket assignment (pure): fixed from the order given, one kind per bucket."""

from __future__ import annotations

import pytest

from sbpflow.nn.parallel._buckets import assign_buckets


def test_a_bucket_closes_once_it_reaches_the_cap() -> None:
    entries = [("f32", 40), ("f32", 40), ("f32", 40), ("f32", 10), ("f32", 100)]
    assert assign_buckets(entries, cap_bytes=80) == [[0, 1], [2, 3, 4]]
    assert assign_buckets(entries, cap_bytes=10_000) == [[0, 1, 2, 3, 4]]
    assert assign_buckets(entries, cap_bytes=1) == [[0], [1], [2], [3], [4]]


def test_kinds_fill_their_own_buckets_ordered_by_first_entry() -> None:
    """Gradients of different dtypes or groups never share a flat buffer."""
    entries = [("a", 30), ("b", 30), ("a", 30), ("b", 30), ("a", 30)]
    # "a" closes [0, 2] at 60 bytes; "b" [1, 3]; [4] is left open and closed at the end.
    assert assign_buckets(entries, cap_bytes=60) == [[0, 2], [1, 3], [4]]
    assert assign_buckets([], cap_bytes=60) == []


def test_the_first_bucket_of_each_kind_has_its_own_cap() -> None:
    """A small first bucket puts the first gradients of backward on the wire early."""
    entries = [("a", 30), ("a", 30), ("b", 30), ("a", 30), ("a", 30), ("a", 30), ("b", 30)]
    assert assign_buckets(entries, cap_bytes=90, first_cap_bytes=30) == [
        [0],
        [1, 3, 4],
        [2],
        [5],
        [6],
    ]


def test_a_non_positive_cap_is_an_error() -> None:
    with pytest.raises(ValueError, match="must be positive, got 0 and 0"):
        assign_buckets([("a", 1)], cap_bytes=0)
    with pytest.raises(ValueError, match="must be positive, got 10 and 0"):
        assign_buckets([("a", 1)], cap_bytes=10, first_cap_bytes=0)
