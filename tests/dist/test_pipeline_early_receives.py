"""Receives posted one action early (NOTE [next action's receives] in
sbpflow/nn/pipeline/runtime/_early.py).

On 2 ranks, a 2-stage model through ``sbpflow.nn.Graph`` with GPipe and 1F1B:

- from the second step with inputs of the same shapes on, each rank posts receives early
  (rank 1 the next activation, rank 0 the next gradient), and training equals plain torch on
  one process within 1e-5, with early receives and without;
- with a weight tied between the stages and micro-batches as wide as it, every action moves
  two messages of one shape, so only taking the receives in the order they were posted gives
  plain torch's training;
- a step that fails on every rank (a bad micro-batch the caller skips) leaves a receive
  posted early (GPipe), or a gradient sent and not taken (1F1B: rank 1 sends the third
  micro-batch's gradient before it fails, rank 0 fails before taking it); before the error
  is raised the receive is filled and the gradient taken, both dropped, and the next steps
  train as plain torch does on the batches that were not skipped, with early receives and
  without (NOTE [a failed step's messages] in sbpflow/nn/pipeline/runtime/_failed_step.py);
- a build whose transfers change between steps with the same input shapes raises on the
  rank that receives (naming ``enable_early_receives(False)``), the other rank's wait ends
  in a ``CollectiveError`` within the collective timeout, and with
  ``enable_early_receives(False)`` the same build trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.comm._errors import CollectiveError
from sbpflow.nn.pipeline.runtime import _transfers
from sbpflow.sbp import Broadcast
from sbpflow.testing import DistributedPool, RemoteError, get_pool

B = Broadcast()
_M, _STEPS, _TOL = 4, 3, 1e-5
TIMEOUT_S = 10
WITHIN_S = 3 * TIMEOUT_S  # the timeout, plus process start and the harness's polling


class Tied(nn.Sequential):
    """Two stages; with ``tied_to`` set, the output is multiplied by stage 0's weight,
    moved to that placement (a weight tied between the first and the last stage)."""

    tied_to: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        if self.tied_to is None:
            return h
        weight = self[0][0].weight
        if isinstance(weight, sbpflow.GlobalTensor):
            weight = weight.to_global(self.tied_to, B)
        return h @ weight


def _model() -> Tied:
    torch.manual_seed(0)
    return Tied(
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    )


def _staged_model() -> tuple[Tied, list[Any]]:
    """``_model()`` with its two stages on ranks 0 and 1, and their placements."""
    placements = [sbpflow.placement("cpu", [r]) for r in (0, 1)]
    model = _model()
    for stage, placement in zip(model, placements, strict=True):
        stage.to_global(placement, B)
    return model, placements


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: nn.Sequential, placements: list[Any], schedule: str) -> None:
        super().__init__()
        self.model = model
        self.placements = placements
        self.extra_transfer = False
        for s, placement in enumerate(placements):
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.extra_transfer:  # a transfer the previous step did not make, first
            sbpflow.ones(3, placement=self.placements[0], sbp=B).to_global(self.placements[1], B)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _batches(rows: int = 8, steps: int = _STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(rows, 8, generator=gen), torch.randn(rows, 8, generator=gen))
        for _ in range(steps)
    ]


def _reference(
    tied: bool = False, rows: int = 8, skipped: int | None = None, steps: int = _STEPS
) -> tuple[list[float], list[torch.Tensor]]:
    """The same training in plain torch on this process: each micro-batch's loss / M.
    ``skipped``: the batch a failed step did not train on."""
    model = _model()
    model.tied_to = "here" if tied else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    batches = _batches(rows, steps)
    for x, y in (b for k, b in enumerate(batches) if k != skipped):
        total = 0.0
        for xm, ym in zip(x.chunk(_M), y.chunk(_M), strict=True):
            loss = F.mse_loss(model(xm), ym)
            (loss / _M).backward()
            total += loss.item() / _M
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, [p.detach().clone() for p in model.parameters()]


def train_job(schedule: str, early: bool, tied: bool = False) -> dict[str, Any]:
    """Train _STEPS steps; the losses, the weights, the receives posted early per step, and
    plain torch's losses and weights. ``tied``: stage 0's weight also used on stage 1, and
    micro-batches of 8 rows (the weight's shape)."""
    model, placements = _staged_model()
    rows = 4 * _M if tied else 8
    model.tied_to = placements[1] if tied else None
    graph = TrainGraph(model, placements, schedule)
    graph.config.enable_early_receives(early)
    both = sbpflow.placement("cpu", [0, 1])
    posted = [0]
    original = _transfers.StepTransfers.post_early

    def post_early(self: Any, receives: Any) -> None:
        posted[0] += len(receives)
        original(self, receives)

    _transfers.StepTransfers.post_early = post_early  # type: ignore[method-assign]
    try:
        losses, per_step = [], []
        for x, y in _batches(rows):
            posted[0] = 0
            loss = graph(x.to_global(placements[0], B), y.to_global(placements[1], B))
            losses.append(loss.to_global(both, B).to_local().item())
            per_step.append(posted[0])
    finally:
        _transfers.StepTransfers.post_early = original  # type: ignore[method-assign]
    weights = [p.detach().to_global(both, B).to_local() for p in model.parameters()]
    ref_losses, ref_weights = _reference(tied, rows)
    return {
        "losses": losses,
        "weights": weights,
        "posted": per_step,
        "ref_losses": ref_losses,
        "ref_weights": ref_weights,
    }


@pytest.mark.parametrize("early", [True, False], ids=["early", "not early"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_equals_one_process_and_posts_receives_early(schedule: str, early: bool) -> None:
    """Step 1 learns each action's receives; steps 2 and 3 post the next action's while the
    current one computes (on both ranks: activations on rank 1, gradients on rank 0), and
    nothing when turned off; the losses and weights are plain torch's either way."""
    for rank, got in enumerate(get_pool(2).run(train_job, schedule, early)):
        first, *later = got["posted"]
        assert first == 0, (rank, got["posted"])
        # Rank 0 receives a gradient in each backward, all after its first action (a
        # forward); rank 1 an activation in each forward, the first one where the step starts.
        expected = (_M if rank == 0 else _M - 1) if early else 0
        assert later == [expected] * (_STEPS - 1), (rank, got["posted"])
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=_TOL, rel=_TOL), rank
        for a, b in zip(got["weights"], got["ref_weights"], strict=True):
            assert (a - b).abs().max().item() <= _TOL, rank


def test_a_tied_weight_as_wide_as_the_micro_batches_trains_exactly() -> None:
    """Each forward moves the activation and the tied weight, both 8 x 8, from rank 0 to
    rank 1 (and their gradients back): 2 receives per action, posted early two at a time."""
    for rank, got in enumerate(get_pool(2).run(train_job, "1f1b", True, True)):
        assert got["posted"] == [0] + [2 * (_M if rank == 0 else _M - 1)] * (_STEPS - 1), rank
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=_TOL, rel=_TOL), rank
        for a, b in zip(got["weights"], got["ref_weights"], strict=True):
            assert (a - b).abs().max().item() <= _TOL, rank


class FailingGraph(TrainGraph):
    """Raises in build on its ``fail_at``-th call (on every rank: the same program)."""

    fail_at = -1
    calls = 0

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyError("a bad micro-batch")
        return super().build(x, y)


_FAILED_STEP = 1  # of 4


def recovering_job(early: bool, schedule: str = "gpipe") -> dict[str, Any]:
    """GPipe steps whose second fails at its last micro-batch (rank 1 has posted that
    micro-batch's receive early); the caller skips the batch and goes on. Each step's loss
    or error, the receives posted early in each step, the weights, and plain torch's
    losses and weights trained on the other batches."""
    model, placements = _staged_model()
    both = sbpflow.placement("cpu", [0, 1])
    graph = FailingGraph(model, placements, schedule)
    graph.config.enable_early_receives(early)
    graph.fail_at = (_FAILED_STEP + 1) * _M
    posted = [0]
    original = _transfers.StepTransfers.post_early

    def post_early(self: Any, receives: Any) -> None:
        posted[0] += len(receives)
        original(self, receives)

    out: list[Any] = []
    per_step: list[int] = []
    _transfers.StepTransfers.post_early = post_early  # type: ignore[method-assign]
    try:
        for x, y in _batches(steps=4):
            posted[0] = 0
            try:
                loss = graph(x.to_global(placements[0], B), y.to_global(placements[1], B))
                out.append(loss.to_global(both, B).to_local().item())
            except KeyError as error:
                out.append(str(error))
            per_step.append(posted[0])
    finally:
        _transfers.StepTransfers.post_early = original  # type: ignore[method-assign]
    ref_losses, ref_weights = _reference(skipped=_FAILED_STEP, steps=4)
    return {
        "out": out,
        "posted": per_step,
        "weights": [p.detach().to_global(both, B).to_local() for p in model.parameters()],
        "ref_losses": ref_losses,
        "ref_weights": ref_weights,
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "not early"])
def test_steps_after_a_failed_step_train_as_one_process_does(
    private_pool: DistributedPool, early: bool, schedule: str
) -> None:
    """GPipe: the receive rank 1 posted early for the failed step's last micro-batch is
    filled by rank 0 and dropped. 1F1B: the gradient rank 1 sent in the failed step is
    taken by rank 0 and dropped. Either way the losses of the steps that ran and the final
    weights are plain torch's on the batches not skipped."""
    for rank, got in enumerate(private_pool.run(recovering_job, early, schedule)):
        out = got["out"]
        assert out[_FAILED_STEP] == "'a bad micro-batch'", (rank, out)
        if early and rank == 1 and schedule == "gpipe":  # a receive posted in the failed step
            assert got["posted"][_FAILED_STEP] > 0, got["posted"]
        trained = out[:_FAILED_STEP] + out[_FAILED_STEP + 1 :]
        assert trained == pytest.approx(got["ref_losses"], abs=_TOL, rel=_TOL), (rank, got)
        for a, b in zip(got["weights"], got["ref_weights"], strict=True):
            assert (a - b).abs().max().item() <= _TOL, rank


def changing_job(early: bool) -> list[float]:
    """Step 1 as usual; step 2 moves one more tensor from stage 0's rank to stage 1's."""
    model, placements = _staged_model()
    graph = TrainGraph(model, placements, "1f1b")
    graph.config.enable_early_receives(early)
    both = sbpflow.placement("cpu", [0, 1])
    losses = []
    for step, (x, y) in enumerate(_batches()[:2]):
        graph.extra_transfer = step == 1
        loss = graph(x.to_global(placements[0], B), y.to_global(placements[1], B))
        losses.append(loss.to_global(both, B).to_local().item())
    return losses


@pytest.fixture(scope="module")
def private_pool() -> Iterator[DistributedPool]:
    """A pool of its own: a failed step leaves a receive posted that no later job may meet."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": str(TIMEOUT_S)}) as pool:
        yield pool


def test_transfers_that_change_between_steps_raise_on_every_rank(
    private_pool: DistributedPool,
) -> None:
    """The receiving rank names the mismatch and the way out; the other rank's wait ends in
    a CollectiveError within the timeout; with early receives off the same build trains."""
    outcomes = private_pool.run_expect_errors(changing_job, True, timeout=WITHIN_S)
    assert outcomes.elapsed < WITHIN_S, outcomes.elapsed
    zero, one = list(outcomes)
    assert isinstance(one, (RuntimeError, RemoteError)), one
    message = str(one)
    assert "receive posted early" in message and "(3,)" in message, message
    assert "enable_early_receives(False)" in message, message
    if isinstance(zero, RemoteError):
        assert zero.type_name == "CollectiveError", zero
    else:
        assert isinstance(zero, CollectiveError), zero


def test_transfers_that_change_between_steps_train_with_early_receives_off() -> None:
    ref_losses, _ = _reference()
    for rank, losses in enumerate(get_pool(2).run(changing_job, False)):
        assert losses == pytest.approx(ref_losses[:2], abs=_TOL, rel=_TOL), rank


def test_the_config_takes_only_a_bool() -> None:
    config = sbpflow.nn.GraphConfig()
    with pytest.raises(TypeError, match="enable_early_receives takes True or False, got 'no'"):
        config.enable_early_receives("no")  # type: ignore[arg-type]
    assert config.early_receives_enabled
    config.enable_early_receives(False)
    assert not config.early_receives_enabled
