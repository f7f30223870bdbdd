"""``calibrate_compute``: measure this machine's compute rates for a plan's prices.

# NOTE [calibrated compute]
# A plan is priced with ``ComputeModel.default`` unless a model is passed (NOTE [default
# prices]), so the same script plans the same everywhere. ``calibrate_compute(placement)``
# returns a model measured here, which the caller passes as ``compute_model=``: a matmul
# times floating-point operations per second, an add of large tensors bytes per second, and
# a chain of small ops on a global tensor of ``placement`` the eager work per op (sbpflow's
# dispatch and the autograd node, which the roofline does not see and which dominates small
# models). Each is the best of ``repeats`` timings. In a job, rank 0's numbers are broadcast
# so every rank plans with identical constants (ranks planning apart could run different
# collectives and hang). Nothing is stored: calling it again measures again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm._bench import broadcast_from_first
from ..placement import Placement
from ..sbp import broadcast
from ._costs import ComputeModel

__all__ = ["calibrate_compute"]

# CPU sizes keep a run under a second on a busy few-core host; the GPU ones fill the device.
_SIZES = {"cpu": (512, 1 << 22, 64), "cuda": (8192, 1 << 27, 64)}


def calibrate_compute(placement: Placement, *, repeats: int = 5) -> ComputeModel:
    """Time this machine's compute on ``placement``'s device type; returns a ComputeModel.

    Pass the result as ``auto_parallel(..., compute_model=...)``. Call it on every rank of
    the job where the world is initialized (rank 0's numbers are broadcast: a collective),
    with the thread count the job trains with. ``repeats``: timings per rate, best kept.
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
    n, numel, chain = _SIZES[device_type]
    device = _device(placement)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    mm = _best(lambda: torch.mm(a, b), repeats, device)
    x = torch.randn(numel, device=device)
    y = torch.randn(numel, device=device)
    add = _best(lambda: torch.add(x, y), repeats, device)
    small = torch.ones(8, device=device).to_global(placement, broadcast).requires_grad_()

    def ops() -> None:
        t = small
        for _ in range(chain):
            t = t * 1.0

    op = _best(ops, repeats, device) / chain
    values = [2.0 * n**3 / mm, 3.0 * numel * x.element_size() / add, op]
    if dist.is_available() and dist.is_initialized():
        values = broadcast_from_first(values, device_type)
    return ComputeModel(*values)


def _device(placement: Placement) -> torch.device:
    if placement.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _best(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
