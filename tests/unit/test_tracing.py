"""``sbpflow.boxing.trace``: what a record without a plan (a gradient bucket's all_reduce)
shows, by op and by the placement axes it ran over."""

from __future__ import annotations

import collections

import pytest

from sbpflow.boxing import tracing


def test_collectives_by_axes_counts_each_collective_with_its_axes() -> None:
    with tracing.trace() as t:
        tracing.record(None, ["all_reduce"], [(0,)])
        tracing.record(None, ["all_reduce", "slice"], [(1,), (1,)])
        tracing.record(None, ["all_reduce"], [(0,)])
        tracing.record(None, ["all_gather"])  # axes not said
    tracing.record(None, ["all_reduce"], [(0,)])  # outside the block: not recorded
    assert t.collectives() == collections.Counter({"all_reduce": 3, "all_gather": 1})
    assert t.collectives_by_axes() == collections.Counter(
        {("all_reduce", (0,)): 2, ("all_reduce", (1,)): 1, ("all_gather", None): 1}
    )
    assert t.ops()["slice"] == 1


def test_record_rejects_axes_that_do_not_match_the_ops() -> None:
    with pytest.raises(ValueError, match="2 ops but 1 axes"):
        tracing.record(None, ["all_reduce", "slice"], [(0,)])
