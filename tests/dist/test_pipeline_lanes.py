"""The lanes of a pipelined step are made before its first action (NOTE [lanes] in
sbpflow/nn/pipeline/runtime/_transfers.py), not by the first transfer in the middle of it.

On 2 ranks, the 2-stage model of test_pipeline_early_receives through ``sbpflow.nn.Graph``
with 1F1B: no compute action of the first step (nor of the next) makes a process group, the
step's transfers run on the two lanes of the stages' pair of placements, and training
equals plain torch on one process.
"""

from __future__ import annotations

from typing import Any

import pytest

import sbpflow
from sbpflow.comm import _groups, _p2p
from sbpflow.nn.pipeline.runtime import _step
from sbpflow.testing import get_pool

from .test_pipeline_early_receives import (
    _M,
    _TOL,
    B,
    TrainGraph,
    _batches,
    _reference,
    _staged_model,
)


def lanes_job() -> dict[str, Any]:
    """Two steps; per compute action, how many groups it made; the transfer groups made."""
    model, placements = _staged_model()
    both = sbpflow.placement("cpu", [0, 1])
    graph = TrainGraph(model, placements, "1f1b")
    made: list[int] = []
    original = _step.run_action

    def counted(*args: Any) -> None:
        before = _groups._created[0]
        original(*args)
        made.append(_groups._created[0] - before)

    _step.run_action = counted  # type: ignore[assignment]
    try:
        losses = []
        for x, y in _batches(steps=2):
            loss = graph(x.to_global(placements[0], B), y.to_global(placements[1], B))
            losses.append(loss.to_global(both, B).to_local().item())
    finally:
        _step.run_action = original  # type: ignore[assignment]
    tags = sorted(repr(tag) for (_, members, tag) in _p2p._ready if members == (0, 1))
    ref_losses, _ = _reference(steps=2)
    return {"made": made, "tags": tags, "losses": losses, "ref_losses": ref_losses}


def test_the_lanes_are_made_before_the_first_action() -> None:
    for rank, got in enumerate(get_pool(2).run(lanes_job)):
        assert len(got["made"]) == 2 * 2 * _M, (rank, got["made"])  # F and B, 2 steps
        assert not any(got["made"]), (rank, got["made"])
        pair = (sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1]))
        assert {repr((pair, 0)), repr((pair, 1))} <= set(got["tags"]), (rank, got["tags"])
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=_TOL, rel=_TOL), rank
