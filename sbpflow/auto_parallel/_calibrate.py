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
# (tiny tensors: its bytes do not count). A partial sum of 16 floats boxed to broadcast,
# less a bare all_reduce of them, gives the eager work of a boxing step beside its
# collective (planning, layout checks, copies: several times an op's). The bare all_reduce
# itself, per latency round (``ceil(log2 p)`` on the placement's ``p`` ranks), gives
# ``collective_seconds``, the wait per round of a collective (NOTE [default prices]): the
# wait inside a step, for ranks that reach a collective apart, cannot be timed outside one,
# so a bare collective's time stands for it (on the busy 2-core test host of the same order
# as the CPU default). Where the placement is one rank or not the whole world (no bare group
# to time), the boxing step's eager work is left to ``op_seconds`` and the wait to the
# device's default (``ComputeModel.default``). Each rate is the
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

from ..comm._bench import broadcast_from_first
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


def calibrate_compute(placement: Placement, *, repeats: int = 5) -> ComputeModel:
    """Time this machine's compute on ``placement``'s device type; returns a ComputeModel.

    Pass the result as ``auto_parallel(..., compute_model=...)``. Call it on every rank of
    the job where the world is initialized (rank 0's numbers are broadcast: a collective),
    with the thread count the job trains with. ``repeats``: timings per rate, median kept.
    """
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be a sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}; e.g. sbpflow.placement('cpu', [0, 1])."
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}.")
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
    boxing = _boxing_op(placement, repeats, device) if joined else None
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
    placement: Placement, repeats: int, device: torch.device
) -> tuple[float, float] | None:
    """Eager seconds of one boxing step beside its collective, a partial sum of 16 floats
    boxed to broadcast (one all_reduce over the placement) less a bare all_reduce of them,
    and the wait per latency round of a collective: the bare all_reduce over its rounds
    (NOTE [calibrated compute]). ``None`` where the placement is one rank or not the whole
    world (no bare group to compare with)."""
    if placement.num_ranks == 1 or placement.num_ranks != dist.get_world_size():
        return None
    # partial on every axis: one all_reduce over the whole placement
    partial = torch.ones(16, device=device).to_global(placement, (partial_sum,) * placement.ndim)
    bare = torch.ones(16, device=device)
    whole = (broadcast,) * placement.ndim
    boxed = _median(lambda: partial.to_global(sbp=whole), repeats, device)
    raw = _median(lambda: dist.all_reduce(bare), repeats, device)
    rounds = (placement.num_ranks - 1).bit_length()
    return max(boxed - raw, 0.0), raw / rounds


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
