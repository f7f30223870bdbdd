"""Prices: compute from FLOPs and bytes, boxing from the boxing planner, memory per rank. Pure.

# NOTE [default prices]
# Every rank and machine must plan the same, so nothing here is measured: boxing is priced by
# the boxing planner with ``CostModel.default(backend)`` (not the job's calibrated model)
# unless a cost model is passed explicitly, and compute by the roofline of ``ComputeModel``:
# ``max(flops / flops_per_second, bytes / bytes_per_second)`` times the share of the op one
# rank does, plus ``op_seconds`` for running the op at all (eager dispatch: Python, layout
# propagation, the autograd node), which every rank pays whatever its share. The backward
# of an op costs twice its forward's roofline and one more ``op_seconds``. Each boxing step
# costs its collective (the boxing planner's price) plus ``op_seconds`` (or
# ``boxing_op_seconds`` where given, as ``calibrate_compute`` measures it): issuing it is eager
# work too, so of two boxings moving the same bytes (an all_reduce, or a reduce_scatter
# then an all_gather) the one with fewer steps is cheaper. The boxing planner chooses the path
# with these extras in its prices (``_WithExtras``). A step that communicates costs
# ``collective_seconds * ceil(log2 p)`` more (``p`` the ranks of its group), once per step
# whatever its collective: an all_reduce, which the cost model counts as twice the latency
# rounds of an all_gather, waits as long as one. Each collective is a point where every
# rank of its group waits for the slowest, which an alpha-beta fit of collectives timed
# back to back does not see, and a larger group has more ranks to wait for
# (``ceil(log2 p)`` stands for how that grows). On the busy 2-core host the tests run on,
# a boxing step of a few floats on 2 ranks took 0.57-0.99 ms inside a step against its
# 0.13 ms alpha-beta price and 0.05 ms of eager work: the CPU default is 0.6 ms (times one
# on 2 ranks). The optimizer's update of each parameter costs ``optimizer_ops(states)`` elementwise ops on the parameter's local
# piece (AdamW: 9, plain SGD: 1), each ``update_op_seconds`` (an op outside autograd: a few
# times cheaper than ``op_seconds``) plus its bytes (two read, one written) at
# ``bytes_per_second``. The search weighs it (NOTE [the update in the search] in
# _solve.py). ``calibrate_compute`` measures the rates on this machine; plans use them only
# when they are passed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..boxing import plan as boxing_plan
from ..boxing.cost import CostModel, backend_for
from ..boxing.plan import BoxingStep
from ..nn.parallel._reducer import DEFAULT_BUCKET_CAP_MB
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Split, broadcast
from ._capture import Node
from ._strategies import Strategy, op_flops

__all__ = ["ComputeModel", "Prices", "optimizer_ops", "optimizer_states"]

BUCKET_CAP_BYTES = DEFAULT_BUCKET_CAP_MB * 2**20  # a data-parallel bucket (nn/parallel/_reducer.py)

BACKWARD_FACTOR = 2.0  # a backward costs about twice its forward (two matmuls per matmul)
# AdamW's update of one parameter runs 9 elementwise ops (torch's single-tensor loop: two
# lerp/mul_ for the moments, sqrt, div, addcdiv_, the weight decay, the step): one for the
# update itself and about four per state tensor; plain SGD runs one (add_).
OPS_PER_STATE = 4
# the CPU default of ``ComputeModel.collective_seconds`` (NOTE [default prices])
COLLECTIVE_SECONDS = 0.6e-3


@dataclass(frozen=True)
class ComputeModel:
    """Roofline of one device: floating-point operations and memory bytes per second, the
    fixed seconds of running one op of the step (or one boxing step) eagerly, those of one
    elementwise op of the optimizer's update, outside autograd, and what each collective
    costs beyond its cost model's price (NOTE [default prices])."""

    flops_per_second: float
    bytes_per_second: float
    op_seconds: float = 0.0
    update_op_seconds: float = 0.0
    # eager work of one boxing step beside its collective (None: ``op_seconds``)
    boxing_op_seconds: float | None = None
    # waiting for the slowest rank of the group: a collective on ``p`` ranks costs this
    # times ``ceil(log2 p)`` (NOTE [default prices])
    collective_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.boxing_op_seconds is not None:
            value = self.boxing_op_seconds
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"ComputeModel.boxing_op_seconds must be None or a non-negative finite "
                    f"number, got {value!r}."
                )
        rates = ("flops_per_second", "bytes_per_second")
        fixed = ("op_seconds", "update_op_seconds", "collective_seconds")
        for name in rates + fixed:
            value = getattr(self, name)
            positive = name in rates
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                want = "a positive" if positive else "a non-negative"
                raise ValueError(
                    f"ComputeModel.{name} must be {want} finite number, got {value!r}; "
                    "e.g. ComputeModel(100e9, 20e9, 50e-6), or sbpflow.auto_parallel."
                    "calibrate_compute() to measure this machine."
                )

    @staticmethod
    def default(device_type: str) -> ComputeModel:
        # Round numbers, not measurements: a few-core CPU (~100 GFLOP/s, ~20 GB/s, ~50 us of
        # eager work per op on a global tensor, forward and backward each, ~15 us per op of
        # the optimizer's update) and a data-centre GPU (~400 TFLOP/s dense bf16/tf32,
        # ~2 TB/s HBM, ~20 us per op: the kernel launch hides behind Python; ~10 us per
        # update op); ~0.6 ms (CPU, gloo: NOTE [default prices]) and ~10 us (GPU, NCCL) of
        # waiting per collective, times ceil(log2 p) on p ranks.
        if device_type == "cuda":
            return ComputeModel(400e12, 2e12, 20e-6, 10e-6, collective_seconds=10e-6)
        return ComputeModel(100e9, 20e9, 50e-6, 15e-6, collective_seconds=COLLECTIVE_SECONDS)


_OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


def optimizer_states(optimizer: object) -> int:
    """Tensors of optimizer state per parameter, each the parameter's size and layout."""
    if optimizer is not None and (
        isinstance(optimizer, bool) or not isinstance(optimizer, (str, int))
    ):
        raise TypeError(
            f"optimizer must be a name in {sorted(_OPTIMIZERS)}, a number of state tensors per "
            f"parameter, or None; got {type(optimizer).__name__} {optimizer!r}."
        )
    if optimizer is None:
        return 0
    if isinstance(optimizer, int):
        if optimizer < 0:
            raise ValueError(f"optimizer states per parameter must be >= 0, got {optimizer}.")
        return optimizer
    if optimizer.lower() not in _OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {sorted(_OPTIMIZERS)} or the "
            "number of state tensors it keeps per parameter (adamw: 2, sgd with momentum: 1)."
        )
    return _OPTIMIZERS[optimizer.lower()]


def optimizer_ops(optimizer: object) -> int:
    """Eager elementwise ops the optimizer runs per parameter tensor and step (none: 0)."""
    if optimizer is None or (isinstance(optimizer, str) and optimizer.lower() == "none"):
        return 0
    return 1 + OPS_PER_STATE * optimizer_states(optimizer)


def local_bytes(
    shape: Sequence[int], dtype: torch.dtype, layout: NdSbp, mesh: Sequence[int]
) -> float:
    """Bytes one rank holds of a tensor (even splits, NOTE [balanced split] aside)."""
    shards = math.prod(n for s, n in zip(layout, mesh, strict=True) if isinstance(s, Split))
    return math.prod(shape) * dtype.itemsize / shards


@dataclass(frozen=True)
class _WithExtras(CostModel):
    """A cost model's prices plus what every boxing step costs beside them (``step``: its
    eager work) and every collective on ``p`` ranks (``wait * ceil(log2 p)``), so the
    boxing planner chooses its path with them counted (NOTE [default prices]): under a
    calibrated fit where a reduce_scatter then an all_gather price just under one
    all_reduce, the extras of the second step make the all_reduce the cheaper, as it is at
    run time. Priced after the planner's choice, an all_reduce boxing was priced as two
    steps' extras on the 2x2 mesh: 2 x 11 ms where the step runs one all_reduce."""

    step: float = 0.0
    wait: float = 0.0

    def _collective(self, p: int) -> float:
        return self.step + self.wait * (p - 1).bit_length()

    def all_gather(self, p: int, block_bytes: float) -> float:
        return super().all_gather(p, block_bytes) + self._collective(p)

    def reduce_scatter(self, p: int, block_bytes: float) -> float:
        return super().reduce_scatter(p, block_bytes) + self._collective(p)

    def all_reduce(self, p: int, block_bytes: float) -> float:
        return super().all_reduce(p, block_bytes) + self._collective(p)

    def all_to_all(self, p: int, block_bytes: float) -> float:
        return super().all_to_all(p, block_bytes) + self._collective(p)

    def send_recv(self, num_messages: int, max_bytes_per_rank: float) -> float:
        return super().send_recv(num_messages, max_bytes_per_rank) + self.step

    def local(self, num_bytes: float) -> float:
        return super().local(num_bytes) + self.step


class Prices:
    """Prices of one planning problem, with the boxing plans cached by layout pair."""

    def __init__(
        self,
        placement: Placement,
        cost_model: CostModel | None,
        compute: ComputeModel | None,
        optimizer_ops: int = 0,
    ) -> None:
        self.placement = placement
        self.mesh = placement.shape
        self.cost_model = cost_model or CostModel.default(backend_for(placement.type))
        self.compute = compute or ComputeModel.default(placement.type)
        self.optimizer_ops = optimizer_ops  # per trained parameter and step
        step = self.compute.boxing_op_seconds
        self._planned = _WithExtras(
            self.cost_model.link,
            self.cost_model.per_op,
            step=self.compute.op_seconds if step is None else step,
            wait=self.compute.collective_seconds,
        )
        self._boxing: dict[tuple[object, ...], tuple[float, tuple[BoxingStep, ...]]] = {}

    def boxing(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: NdSbp, dst: NdSbp
    ) -> tuple[float, tuple[BoxingStep, ...]]:
        """Seconds and steps of the cheapest boxing ``src -> dst`` (the boxing planner's)."""
        if src == dst:
            return 0.0, ()
        key = (shape, dtype, src, dst)
        found = self._boxing.get(key)
        if found is None:
            # the steps' prices include their extras (``_WithExtras``)
            result = boxing_plan(
                shape, dtype, (self.placement, src), (self.placement, dst), self._planned
            )
            found = (result.cost, tuple(result.steps))
            self._boxing[key] = found
        return found

    def collectives(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: NdSbp, dst: NdSbp
    ) -> int:
        """Collectives the cheapest boxing ``src -> dst`` runs (its communicating steps)."""
        return sum(1 for step in self.boxing(shape, dtype, src, dst)[1] if step.is_collective)

    def bucket_fixed_seconds(self, axes: tuple[int, ...]) -> float:
        """What one all_reduce over ``axes`` costs whatever its bytes: its latency rounds,
        step overhead, the eager work of a boxing step and the wait of a collective (paid
        once per bucket)."""
        return self._planned.all_reduce(math.prod(self.mesh[a] for a in axes), 0.0)

    def bucket_discount(self, step: BoxingStep, dst: NdSbp, num_bytes: float) -> float:
        """What a parameter gradient's boxing step costs less in a bucket than alone, for a
        gradient of ``num_bytes`` per rank (in the parameter's layout ``dst``).

        NOTE [bucketed gradients in the search]: at run time data-parallel buckets
        all-reduce together the gradients of parameters broadcast on the all_reduce's
        axes (nn/parallel/_reducer.py, filled by ``assign_buckets``), so such an all_reduce
        is priced with its bytes and only its share ``num_bytes / BUCKET_CAP_BYTES`` of a
        bucket's fixed cost, counting the gradient tensor's bytes as the buckets do (not the
        collective's ``bytes_per_rank``). The program adds the fixed cost of one bucket once
        per set of axes any such all_reduce runs over (the first bucket), and of a second
        where a gradient is left once the small first bucket (``FIRST_BUCKET_BYTES``) is
        closed: as the runtime closes a bucket once it holds at least its cap, counting the
        gradient that crosses it, that is where the gradients other than the last one the
        backward hands over hold at least the first bucket's bytes. The program takes that
        last one to be the first registered parameter that can be bucketed over those axes,
        which matches the runtime where that parameter is bucketed (the common case: all
        weights data parallel over those axes), and counts a bucket less otherwise. Buckets
        beyond the second are priced by their shares only. Other steps (a reduce_scatter
        into a sharded parameter) run alone: no discount; nor does a gradient of a bucket's
        size or more, which fills a bucket of its own (its share would be negative: priced
        above running alone, and unlike the plan's account of the buckets, which counts only
        discounted all_reduces).
        """
        if step.op != "all_reduce" or not all(isinstance(dst[a], Broadcast) for a in step.axes):
            return 0.0
        share = max(0.0, 1.0 - num_bytes / BUCKET_CAP_BYTES)
        return self.bucket_fixed_seconds(step.axes) * share

    def gradient_bytes(self, shape: tuple[int, ...], dtype: torch.dtype, dst: NdSbp) -> float:
        """Bytes per rank of a parameter's gradient in the parameter's layout ``dst``: what
        the data-parallel buckets count it as."""
        return local_bytes(shape, dtype, dst, self.mesh)

    def gradient_boxing(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: NdSbp, dst: NdSbp
    ) -> tuple[float, tuple[tuple[int, ...], ...]]:
        """Search price of boxing a parameter's gradient ``src`` to the parameter's layout
        ``dst``, and the axes of its bucketed all_reduces."""
        seconds, steps = self.boxing(shape, dtype, src, dst)
        num_bytes = self.gradient_bytes(shape, dtype, dst)
        axes = []
        for step in steps:
            discount = self.bucket_discount(step, dst, num_bytes)
            if discount:
                seconds -= discount
                axes.append(step.axes)
        return seconds, tuple(axes)

    def compute_seconds(self, node: Node, strategy: Strategy) -> float:
        """Forward and (when the op needs gradients) backward compute of one rank."""
        if node.kind != "op":
            return 0.0
        flops, num_bytes = op_flops(node)
        forward = strategy.fraction * max(
            flops / self.compute.flops_per_second, num_bytes / self.compute.bytes_per_second
        )
        if not node.requires_grad:
            return forward + self.compute.op_seconds
        return forward * (1.0 + BACKWARD_FACTOR) + 2.0 * self.compute.op_seconds

    def optimizer_seconds(self, node: Node, strategy: Strategy) -> float:
        """The optimizer's update of a trained parameter, on one rank's piece."""
        return self.update_seconds(node, strategy.outputs[0])

    def update_seconds(self, node: Node, layout: NdSbp) -> float:
        """The optimizer's update of a trained parameter stored in ``layout``, one rank."""
        if node.kind != "param" or not node.requires_grad:
            return 0.0
        size = local_bytes(node.out_shapes[0], node.out_dtypes[0], layout, self.mesh)
        per_op = self.compute.update_op_seconds + 3.0 * size / self.compute.bytes_per_second
        return self.optimizer_ops * per_op

    def stored_split_seconds(self, node: Node, stored: NdSbp, read: NdSbp) -> float:
        """What the update of a parameter stored in ``stored`` but read in ``read`` saves by
        being split on the axes where it is read whole (gathered to be used, its gradient
        reduce-scattered: ZeRO), against being stored as it is read there.

        The search gives this back (NOTE [the update in the search] in _solve.py), so a
        split parameter's smaller update counts where its compute is split too (tensor
        parallel), not where only its storage is (the memory budget's business).
        """
        if node.kind != "param" or not node.requires_grad:
            return 0.0
        whole = tuple(
            broadcast if isinstance(s, Split) and not isinstance(r, Split) else s
            for s, r in zip(stored, read, strict=True)
        )
        if whole == stored:
            return 0.0
        return self.update_seconds(node, whole) - self.update_seconds(node, stored)
