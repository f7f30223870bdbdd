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
# then an all_gather) the one with fewer steps is cheaper. The optimizer's update of each
# parameter costs ``optimizer_ops(states)`` elementwise ops on the parameter's local piece
# (AdamW: 9, plain SGD: 1), each ``update_op_seconds`` (an op outside autograd: a few times
# cheaper than ``op_seconds``) plus its bytes (two read, one written) at
# ``bytes_per_second``. The update is part of the predicted step but not of the search: it
# does not depend on the layouts but through its bytes, and a sharded update is cheaper, so
# priced in the search it would shard weights over every axis (ZeRO) to save a few percent of
# the optimizer's memory traffic. ``calibrate_compute`` measures the three rates on this
# machine; plans use them only when they are passed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..boxing import plan as boxing_plan
from ..boxing.cost import CostModel, backend_for
from ..boxing.plan import BoxingStep
from ..nn.parallel._reducer import DEFAULT_BUCKET_CAP_MB
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Split
from ._capture import Node
from ._strategies import Strategy, op_flops

__all__ = ["ComputeModel", "Prices", "optimizer_ops", "optimizer_states"]

BUCKET_CAP_BYTES = DEFAULT_BUCKET_CAP_MB * 2**20  # a data-parallel bucket (nn/parallel/_reducer.py)

BACKWARD_FACTOR = 2.0  # a backward costs about twice its forward (two matmuls per matmul)
# AdamW's update of one parameter runs 9 elementwise ops (torch's single-tensor loop: two
# lerp/mul_ for the moments, sqrt, div, addcdiv_, the weight decay, the step): one for the
# update itself and about four per state tensor; plain SGD runs one (add_).
OPS_PER_STATE = 4


@dataclass(frozen=True)
class ComputeModel:
    """Roofline of one device: floating-point operations and memory bytes per second, the
    fixed seconds of running one op of the step (or one boxing step) eagerly, and those of
    one elementwise op of the optimizer's update, outside autograd (NOTE [default prices])."""

    flops_per_second: float
    bytes_per_second: float
    op_seconds: float = 0.0
    update_op_seconds: float = 0.0
    # eager work of one boxing step beside its collective (None: ``op_seconds``)
    boxing_op_seconds: float | None = None

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
        for name in ("flops_per_second", "bytes_per_second", "op_seconds", "update_op_seconds"):
            value = getattr(self, name)
            positive = name not in ("op_seconds", "update_op_seconds")
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
        # update op).
        if device_type == "cuda":
            return ComputeModel(400e12, 2e12, 20e-6, 10e-6)
        return ComputeModel(100e9, 20e9, 50e-6, 15e-6)


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
            result = boxing_plan(
                shape, dtype, (self.placement, src), (self.placement, dst), self.cost_model
            )
            extra = self.compute.boxing_op_seconds  # issuing each step eagerly
            if extra is None:
                extra = self.compute.op_seconds
            steps = tuple(dataclasses.replace(s, cost=s.cost + extra) for s in result.steps)
            found = (result.cost + extra * len(steps), steps)
            self._boxing[key] = found
        return found

    def bucket_fixed_seconds(self, axes: tuple[int, ...]) -> float:
        """What one all_reduce over ``axes`` costs whatever its bytes: its latency rounds,
        step overhead and the eager work of a boxing step (paid once per bucket)."""
        ranks = math.prod(self.mesh[a] for a in axes)
        extra = self.compute.boxing_op_seconds
        if extra is None:
            extra = self.compute.op_seconds
        return self.cost_model.all_reduce(ranks, 0.0) + extra

    def bucket_discount(self, step: BoxingStep, dst: NdSbp) -> float:
        """What a parameter gradient's boxing step costs less in a bucket than alone.

        NOTE [bucketed gradients in the search]: at run time data-parallel buckets
        all-reduce together the gradients of parameters broadcast on the all_reduce's
        axes (nn/parallel/_reducer.py), so such an all_reduce is priced with its bytes and
        only its share ``bytes / BUCKET_CAP_BYTES`` of a bucket's fixed cost; the program
        adds the fixed cost of one bucket once per set of axes any such all_reduce runs
        over (the first bucket). Linear, and within one bucket's fixed cost of the
        runtime's count. Other steps (a reduce_scatter into a sharded parameter) run alone:
        no discount; nor does a gradient of a bucket's size or more, which fills a bucket
        of its own (its share would be negative: priced above running alone, and unlike
        the plan's account of the buckets, which counts only discounted all_reduces).
        """
        if step.op != "all_reduce" or not all(isinstance(dst[a], Broadcast) for a in step.axes):
            return 0.0
        share = max(0.0, 1.0 - step.bytes_per_rank / BUCKET_CAP_BYTES)
        return self.bucket_fixed_seconds(step.axes) * share

    def gradient_boxing(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: NdSbp, dst: NdSbp
    ) -> tuple[float, tuple[tuple[int, ...], ...]]:
        """Search price of boxing a parameter's gradient ``src`` to the parameter's layout
        ``dst``, and the axes of its bucketed all_reduces."""
        seconds, steps = self.boxing(shape, dtype, src, dst)
        axes = []
        for step in steps:
            discount = self.bucket_discount(step, dst)
            if discount:
                seconds -= discount
                axes.append(step.axes)
        return seconds, tuple(axes)

    def collectives(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        src: NdSbp,
        dst: NdSbp,
        parameter: bool = False,
    ) -> int:
        """Collectives of the boxing ``src -> dst`` (local steps aside); with ``parameter``,
        a gradient boxed into a parameter laid out ``dst``, whose all_reduces the buckets run
        count none of their own (the search counts each set of bucket axes once: NOTE
        [near-equal plans] in _solve.py)."""
        return sum(
            1
            for step in self.boxing(shape, dtype, src, dst)[1]
            if step.is_collective and not (parameter and self.bucket_discount(step, dst))
        )

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
        if node.kind != "param" or not node.requires_grad:
            return 0.0
        size = local_bytes(node.out_shapes[0], node.out_dtypes[0], strategy.outputs[0], self.mesh)
        per_op = self.compute.update_op_seconds + 3.0 * size / self.compute.bytes_per_second
        return self.optimizer_ops * per_op
