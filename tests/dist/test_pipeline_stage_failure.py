"""A micro-batch that raises on a rank holding several stages ends the step on every rank.

On 2 ranks, 4 stages dealt round-robin (stages 0 and 2 on rank 0, 1 and 3 on rank 1) under
``interleaved_1f1b`` with 4 micro-batches, so each rank runs its micro-batches on worker
threads (NOTE [worker threads kept across steps] in
sbpflow/nn/pipeline/runtime/_carriers.py). In the second of four steps:

- ``build`` raises for the third micro-batch on every rank (the same program everywhere,
  as a bad batch the caller skips). The ranks stop at different points of the step (each
  runs its micro-batches in its own order), with messages sent and not taken; both ranks
  raise that error, and the steps after it train as plain torch does in one process on
  the batches that were not skipped (losses and parameters within 1e-5): the messages in
  flight were taken before the error was raised (NOTE [a failed step's messages] in
  sbpflow/nn/pipeline/runtime/_transfers.py);
- stage 2 raises in its forward of the third micro-batch. Only rank 0, which holds it, runs
  that forward (a rank calling a stage held elsewhere gets stand-ins, NOTE [stages held
  elsewhere]), so this is a failure of one rank: rank 0 raises the stage's error, and rank
  1's wait for the stage's output ends within the collective timeout in a
  ``CollectiveError`` that says what rank 0 was last doing, instead of hanging. Rank 0's
  error notes that the ranks' messages may be out of step, and the next step raises on
  rank 0 before moving any data.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.comm._errors import CollectiveError
from sbpflow.sbp import Broadcast
from sbpflow.testing import DistributedPool, RemoteError

B = Broadcast()
_STEPS, _M, _ROWS, _TOL = 4, 4, 2, 1e-5
_RANKS = [0, 1, 0, 1]
_FAILING_STAGE, _FAILED_STEP, _FAILED_MICRO_BATCH = 2, 1, 2
TIMEOUT_S = 10
WITHIN_S = 3 * TIMEOUT_S  # the timeout, plus process start and the harness's polling


_FAIL_AT = _FAILED_STEP * _M + _FAILED_MICRO_BATCH + 1  # the failing call, counted from 1


class Failing(nn.Module):
    """A stage whose forward raises on its ``fail_at``-th call where it runs."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.fail_at = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyError("a bad stage")
        return self.inner(x)


def _plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in _RANKS))


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        self.model = nn.Sequential(*(Failing(stage) for stage in model))
        for s, rank in enumerate(_RANKS):
            placement = sbpflow.placement("cpu", [rank])
            self.model[s].to_global(placement, B)
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule("interleaved_1f1b")
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9))

        self.calls = 0
        self.fail_at = -1

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyError("a bad micro-batch")
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(_M * _ROWS, 6, generator=gen), torch.randn(_M * _ROWS, 6, generator=gen))
        for _ in range(_STEPS)
    ]


def skipping_job() -> dict[str, Any]:
    """Train every batch, the caller skipping the one whose step raises; each step's loss
    error against plain torch (or the error's text), and the parameters' error."""
    plain = _plain_model()
    graph = TrainGraph(copy.deepcopy(plain))
    graph.fail_at = _FAIL_AT
    reference_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    first, last = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    everyone = sbpflow.placement("cpu", [0, 1])
    out: list[Any] = []
    for x, y in _batches():
        try:
            loss = graph(x.to_global(first, B), y.to_global(last, B))
        except KeyError as error:
            out.append(str(error))
            continue
        reference_opt.zero_grad()
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        reference_opt.step()
        got = loss.to_global(everyone, B).to_local()
        out.append((got - expected.detach()).abs().max().item())
    param_error = max(
        (mine.detach().to_global(everyone, B).to_local() - theirs.detach()).abs().max().item()
        for mine, theirs in zip(graph.model.parameters(), plain.parameters(), strict=True)
    )
    return {"out": out, "param error": param_error}


def holder_only_job() -> None:
    """Train until the step where stage 2 raises on its rank; that step raises everywhere.
    Rank 0 then tries the next batch, which must raise too (as a ``ValueError`` holding
    both errors' texts, so that the caller sees both)."""
    graph = TrainGraph(_plain_model())
    graph.model[_FAILING_STAGE].fail_at = _FAIL_AT
    first, last = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    batches = [(x.to_global(first, B), y.to_global(last, B)) for x, y in _batches()]
    for k, (x, y) in enumerate(batches):
        try:
            graph(x, y)
        except KeyError as error:
            notes = " ".join(getattr(error, "__notes__", []))
            try:
                graph(*batches[k + 1])
            except RuntimeError as later:
                raise ValueError(f"{error!r} {notes} || then: {later}") from None
            raise


@pytest.fixture
def private_pool() -> Iterator[DistributedPool]:
    """A pool of its own per test: a step that fails on one rank leaves its processes
    unable to run another pipelined step."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": str(TIMEOUT_S)}) as pool:
        yield pool


def test_a_stage_failing_on_every_rank_ends_the_step_and_training_goes_on(
    private_pool: DistributedPool,
) -> None:
    outcomes = private_pool.run(skipping_job)
    for rank, got in enumerate(outcomes):
        out = got["out"]
        assert out[_FAILED_STEP] == "'a bad micro-batch'", (rank, out)
        trained = out[:_FAILED_STEP] + out[_FAILED_STEP + 1 :]
        assert all(isinstance(e, float) and e < _TOL for e in trained), (rank, out)
        assert got["param error"] < _TOL, (rank, got)


def test_a_stage_failing_on_its_rank_raises_on_every_rank_within_the_timeout(
    private_pool: DistributedPool,
) -> None:
    outcomes = private_pool.run_expect_errors(holder_only_job, timeout=WITHIN_S)
    assert outcomes.elapsed < WITHIN_S, outcomes.elapsed
    holder, other = list(outcomes)  # stage 2 is on rank 0
    assert isinstance(holder, ValueError), holder
    failed, then = str(holder).split(" || then: ")
    assert "a bad stage" in failed, failed
    if sys.version_info >= (3, 11):  # exceptions carry notes from 3.11 on
        assert "may be out of step" in failed, failed
    assert "cannot run another pipelined step" in then, then
    assert isinstance(other, (CollectiveError, RemoteError)), other
    if isinstance(other, RemoteError):
        assert other.type_name == "CollectiveError", other
    message = str(other)
    assert "timed out" in message and "Rank 0 was last in" in message, message
