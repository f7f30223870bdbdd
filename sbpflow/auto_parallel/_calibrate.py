"""``calibrate_compute``: measure this machine's compute rates for a plan's prices.

# NOTE [calibrated compute]
# A plan is priced with ``ComputeModel.default`` unless a model is passed (NOTE [default
# prices]), so the same script plans the same everywhere. ``calibrate_compute(placement)``
# returns a model measured here, which the caller passes as ``compute_model=``: a matmul
# times floating-point operations per second, an add of large tensors bytes per second, and
# the forward and backward of a tiny model on global tensors of ``placement`` (two residual
# blocks: layer norm, linear, GELU, linear, add; every tensor broadcast, so nothing is
# communicated) the eager work per op: sbpflow's dispatch and layout propagation, the
# autograd node and the backward's own ops, which the roofline does not see and which
# dominate small models on a CPU. That time is divided by the ops the model is priced for
# (NOTE [default prices]: each captured op once forward and once backward), so a plan priced
# with the result pays for a step what the tiny model paid per op. An AdamW step on the tiny
# model's parameters, divided by the ops it is priced for, gives the seconds per update op
# (tiny tensors: its bytes do not count).
#
# The collectives are timed where a plan runs them: on the groups along each mesh axis
# (every group at once, as a boxing step runs), not over the whole placement. Per axis, a
# tensor of 16 floats partial on that axis boxed to broadcast, less a bare all_reduce of
# them on the axis's group, gives the eager work of a boxing step beside its collective
# (planning, layout checks, copies: several times an op's); the bare all_reduce, less what
# ``cost_model`` (the collectives' prices the plan is priced with; default:
# ``CostModel.default``) prices it at, per latency round (``ceil(log2 p)`` on the axis's
# ``p`` ranks), gives ``collective_seconds``, the wait per round of a collective (NOTE
# [default prices]). Each is averaged over the axes. The wait inside a step, for ranks that
# reach a collective apart, cannot be timed outside one, so a bare collective's time beyond
# its price stands for it: its price is charged already, and an alpha-beta fit measured as
# ``sbpflow.boxing.calibrate`` does times the same bare collectives, so counting the whole
# bare time again doubled it. On the 2-core test host with 4 ranks (a 2x2 mesh), a bare
# all_reduce over all 4 took 7.3 ms, on an axis's 2 ranks 1.1-2.7 ms, and the calibrated
# fit priced the latter at 3.0 ms: the wait counted whole and over 4 ranks added 4.5 ms to
# each collective, and bench/auto_parallel's 2x2 predictions came out 1.3-2.5x the step.
# Where the placement is one rank or not the whole world (no bare group to time), the
# boxing step's eager work is left to ``op_seconds`` and the wait to the device's default
# (``ComputeModel.default``). Each rate is the
# median of ``repeats`` timings: the step it predicts is timed as a median too, and on a
# shared machine the best of a few runs catches moments the step never sees. In a job, rank
# 0's numbers are broadcast so every rank plans with identical constants (ranks planning
# apart could run different collectives and hang). Nothing is stored: calling it again
# measures again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..boxing.cost import CostModel, backend_for
from ..comm._bench import broadcast_from_first
from ..comm._groups import group_of
from ..placement import Placement
from ..sbp import broadcast, partial_sum
from ._capture import Node, capture
from ._costs import ComputeModel, optimizer_ops

__all__ = ["calibrate_compute"]

# CPU sizes keep a run under a second on a busy few-core host; the GPU ones fill the device.
_SIZES = {"cpu": (512, 1 << 22), "cuda": (8192, 1 << 27)}


class _Block(torch.nn.Module):
    """A residual MLP block: the op mix of a transformer's layers, at a size where only the
    eager work per op counts."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _tiny_model(device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    model = torch.nn.Sequential(_Block(8), _Block(8)).to(device)
    return model, torch.randn(4, 8, device=device)


def _ops(model: torch.nn.Module, batch: torch.Tensor) -> list[Node]:
    return [node for node in capture(model, (batch,)).nodes if node.kind == "op"]


def calibrate_compute(
    placement: Placement, *, repeats: int = 5, cost_model: CostModel | None = None
) -> ComputeModel:
    """Time this machine's compute on ``placement``'s device type; returns a ComputeModel.

    Pass the result as ``auto_parallel(..., compute_model=...)``. Call it on every rank of
    the job where the world is initialized (rank 0's numbers are broadcast: a collective),
    with the thread count the job trains with. ``repeats``: timings per rate, median kept.
    ``cost_model``: the collectives' prices the plan is priced with (e.g.
    ``sbpflow.boxing.calibrate(...).model``; default ``CostModel.default``): the wait per
    collective is what a bare collective takes beyond its price there (NOTE [calibrated
    compute]).
    """
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be a sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}; e.g. sbpflow.placement('cpu', [0, 1])."
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}.")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(
            f"cost_model must be a sbpflow.boxing.cost.CostModel or None, got "
            f"{type(cost_model).__name__}: {cost_model!r}; e.g. "
            "sbpflow.boxing.calibrate(placement, save=False).model."
        )
    device_type = placement.type
    if device_type not in _SIZES:
        raise ValueError(
            f"calibrate_compute measures 'cpu' and 'cuda' placements, got {device_type!r}."
        )
    n, numel = _SIZES[device_type]
    device = _device(placement)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    mm = _median(lambda: torch.mm(a, b), repeats, device)
    x = torch.randn(numel, device=device)
    y = torch.randn(numel, device=device)
    add = _median(lambda: torch.add(x, y), repeats, device)
    model, batch = _tiny_model(device)
    num_ops = sum(2 if node.requires_grad else 1 for node in _ops(model, batch))
    whole = (broadcast,) * placement.ndim  # every mesh axis
    model = model.to_global(placement, whole)
    batch = batch.to_global(placement, whole)

    def step() -> None:
        model(batch).sum().backward()

    op = _median(step, repeats, device) / num_ops
    step()
    update = torch.optim.AdamW(model.parameters(), lr=1e-3)
    num_updates = optimizer_ops("adamw") * len(list(model.parameters()))
    update_op = _median(update.step, repeats, device) / num_updates
    values = [2.0 * n**3 / mm, 3.0 * numel * x.element_size() / add, op, update_op]
    joined = dist.is_available() and dist.is_initialized()
    if cost_model is None:
        cost_model = CostModel.default(backend_for(device_type))
    boxing = _boxing_op(placement, repeats, device, cost_model) if joined else None
    values += [-1.0, -1.0] if boxing is None else list(boxing)
    if joined:
        values = broadcast_from_first(values, device_type)
    measured = values[4] >= 0
    return ComputeModel(
        *values[:4],
        boxing_op_seconds=values[4] if measured else None,
        collective_seconds=values[5]
        if measured
        else ComputeModel.default(device_type).collective_seconds,
    )


def _boxing_op(
    placement: Placement, repeats: int, device: torch.device, cost_model: CostModel
) -> tuple[float, float] | None:
    """Eager seconds of one boxing step beside its collective and the wait per latency
    round of a collective, timed on each mesh axis's groups and averaged over the axes
    (NOTE [calibrated compute]). ``None`` where the placement is one rank or not the whole
    world (no bare group to compare with)."""
    if placement.num_ranks == 1 or placement.num_ranks != dist.get_world_size():
        return None
    whole = (broadcast,) * placement.ndim
    bare = torch.ones(16, device=device)
    eager, waits = [], []
    for axis, num_ranks in enumerate(placement.shape):
        if num_ranks == 1:
            continue
        found = group_of(placement.type, placement.groups_along([axis]), dist.get_rank())
        assert found is not None  # every rank of the world is in the placement
        group = found[1]
        layout = tuple(partial_sum if a == axis else broadcast for a in range(placement.ndim))
        partial = torch.ones(16, device=device).to_global(placement, layout)
        boxed = _median(lambda p=partial: p.to_global(sbp=whole), repeats, device)
        raw = _median(lambda g=group: dist.all_reduce(bare, group=g), repeats, device)
        eager.append(max(boxed - raw, 0.0))
        price = cost_model.all_reduce(num_ranks, bare.numel() * bare.element_size())
        waits.append(collective_wait(raw, price, num_ranks))
    return statistics.mean(eager), statistics.mean(waits)


def collective_wait(bare_seconds: float, price_seconds: float, num_ranks: int) -> float:
    """The wait per latency round of a collective on ``num_ranks`` ranks: what a bare one
    took beyond the price its cost model charges for it, over its ``ceil(log2 p)`` rounds
    (NOTE [calibrated compute])."""
    rounds = max((num_ranks - 1).bit_length(), 1)
    return max(bare_seconds - price_seconds, 0.0) / rounds


def _device(placement: Placement) -> torch.device:
    if placement.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _median(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)
