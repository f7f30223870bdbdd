"""``to_global_batch``: each rank's loader batch -> one logical batch, split on dim 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, overload

import torch

from ...placement import Placement
from ...sbp import SbpParallel, broadcast, split
from ...tensor import GlobalTensor, to_global
from ._sampler import normalize_axis

__all__ = ["batch_sbp", "to_global_batch"]

_Batch = TypeVar("_Batch")


def batch_sbp(placement: Placement, axis: int = 0) -> tuple[SbpParallel, ...]:
    """The batch's layout: split along dim 0 on the data ``axis``, broadcast on the others."""
    axis = normalize_axis(axis, placement)
    return tuple(split(0) if a == axis else broadcast for a in range(placement.ndim))


@overload
def to_global_batch(
    local_batch: torch.Tensor, placement: Placement, axis: int = 0, *, check_meta: bool = True
) -> GlobalTensor: ...


@overload
def to_global_batch(
    local_batch: _Batch, placement: Placement, axis: int = 0, *, check_meta: bool = True
) -> _Batch: ...


def to_global_batch(
    local_batch: Any, placement: Placement, axis: int = 0, *, check_meta: bool = True
) -> Any:
    """Turn this rank's loader batch into the global batch, split along dim 0 on ``axis``.

    ``local_batch`` is a tensor or a (nested) tuple, list or dict of tensors, as a
    ``DataLoader`` yields it; the result has the same structure with every tensor made
    global with SBP ``split(0)`` on the placement's data axis ``axis`` and ``broadcast`` on
    the others. The logical batch is the ranks' batches concatenated in mesh order along the
    data axis. Along the other axes the first rank's batch is broadcast, so those ranks must
    read the same samples (``DistributedSampler`` with the same placement and axis does so)::

        x, y = to_global_batch((x, y), placement)

    Every rank of the job makes the call (as for ``to_global``); the ranks' local batch sizes
    may differ only as the balanced split rule allows (the first ranks one more).
    """
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}. Pass the placement the model lives on, e.g. "
            "sbpflow.placement('cpu', [0, 1])."
        )
    sbp = batch_sbp(placement, axis)
    return _convert(local_batch, placement, sbp, check_meta, "batch")


def _convert(
    item: Any, placement: Placement, sbp: tuple[SbpParallel, ...], check_meta: bool, path: str
) -> Any:
    if isinstance(item, GlobalTensor):
        raise TypeError(
            f"{path} is already a global tensor ({item.placement}, {item.sbp}); "
            "to_global_batch takes the local batch a DataLoader yields. Box a global tensor "
            "with .to_global(placement, sbp) instead."
        )
    if isinstance(item, torch.Tensor):
        if item.dim() == 0:
            raise ValueError(
                f"{path} is a 0-dim tensor ({item!r}), but a batch is split along dim 0. "
                "Give every tensor of the batch a leading batch dim, or take this one out."
            )
        return to_global(item, placement, sbp, check_meta=check_meta)
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # namedtuple
        return type(item)(
            *(
                _convert(value, placement, sbp, check_meta, f"{path}.{name}")
                for name, value in zip(item._fields, item, strict=True)
            )
        )
    if isinstance(item, (tuple, list)):
        return type(item)(
            _convert(value, placement, sbp, check_meta, f"{path}[{i}]")
            for i, value in enumerate(item)
        )
    if isinstance(item, Mapping):
        return {
            key: _convert(value, placement, sbp, check_meta, f"{path}[{key!r}]")
            for key, value in item.items()
        }
    raise TypeError(
        f"{path} is a {type(item).__name__} ({item!r:.60}), but to_global_batch takes tensors "
        "in tuples, lists and dicts. Make it a tensor (the default collate_fn does so for "
        "numbers) or take it out of the batch before the call."
    )
