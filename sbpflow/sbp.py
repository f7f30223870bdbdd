"""SBP: how a logical tensor is laid out along one placement axis.

``split(d)`` cuts tensor dim ``d`` across the axis (balanced uneven rule),
``broadcast`` gives every rank the whole (sub)tensor, ``partial_sum`` and
``partial_max`` make the logical tensor the reduction of the ranks' local ones.

# NOTE [one printed form]
# An SBP prints one way everywhere, as ``str`` and as ``repr``: ``S(0)``, ``B``,
# ``P``, ``P(max)``; an N-D SBP ``(S(0), B)`` (``sbp_str``), and a tensor's
# ``.sbp`` tuple as Python prints a tuple of them: ``(S(0),)``. Placements do
# the same: ``placement('cpu', [0, 1])`` (sbpflow/placement.py). Messages,
# plans, tensor reprs and the docs use these forms; code a message suggests
# typing is written with the API's names (``sbpflow.sbp.split(0)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Broadcast",
    "NdSbp",
    "Partial",
    "SbpParallel",
    "Split",
    "broadcast",
    "partial_max",
    "partial_sum",
    "sbp_str",
    "split",
]


class SbpParallel:
    """Base class of the one-axis SBP values."""

    __slots__ = ()

    @property
    def is_split(self) -> bool:
        return isinstance(self, Split)

    @property
    def is_broadcast(self) -> bool:
        return isinstance(self, Broadcast)

    @property
    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Split(SbpParallel):
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"split(dim) takes an int tensor dim, got {self.dim!r}.")

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__  # NOTE [one printed form]


@dataclass(frozen=True)
class Broadcast(SbpParallel):
    def __str__(self) -> str:
        return "B"

    __repr__ = __str__


@dataclass(frozen=True)
class Partial(SbpParallel):
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in ("sum", "max"):
            raise ValueError(f"partial reduce_op must be 'sum' or 'max', got {self.reduce_op!r}.")

    def identity(self, dtype: Any) -> float | int | bool:
        """The value a rank holding no part contributes: 0 for sum, the lowest value for max."""
        if self.reduce_op == "sum":
            return False if dtype == torch.bool else 0
        if dtype == torch.bool:
            return False
        if dtype.is_floating_point:
            return float("-inf")
        return int(torch.iinfo(dtype).min)

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else "P(max)"

    __repr__ = __str__


def split(dim: int) -> Split:
    """The logical tensor is cut along tensor dim ``dim`` across the placement axis."""
    return Split(dim)


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")

NdSbp = tuple[SbpParallel, ...]
SbpLike = SbpParallel | Sequence[SbpParallel]


def sbp_str(nd_sbp: Sequence[SbpParallel]) -> str:
    """``S(0)`` for one axis, ``(S(0), B)`` for several."""
    if len(nd_sbp) == 1:
        return str(nd_sbp[0])
    return "(" + ", ".join(str(s) for s in nd_sbp) + ")"


def _describe(sbp: Any) -> str:
    return f"{type(sbp).__name__} {sbp!r}"


def normalize(sbp: Any, placement_ndim: int, tensor_ndim: int | None = None) -> NdSbp:
    """Turn a user SBP (one value or a tuple) into an N-D tuple, validating it.

    ``tensor_ndim``, when given, checks that split dims are in range and wraps
    negative dims.
    """
    if isinstance(sbp, SbpParallel):
        items: tuple[Any, ...] = (sbp,)
    elif isinstance(sbp, (list, tuple)):
        items = tuple(sbp)
    elif isinstance(sbp, type) and issubclass(sbp, SbpParallel):
        raise TypeError(
            f"got the class {sbp.__name__} as an SBP; use the values sbpflow.sbp.broadcast, "
            "sbpflow.sbp.partial_sum or sbpflow.sbp.split(d)."
        )
    else:
        raise TypeError(
            f"sbp must be an SBP value or a tuple of them, got {_describe(sbp)}. "
            "Use sbpflow.sbp.split(d), sbpflow.sbp.broadcast or sbpflow.sbp.partial_sum."
        )
    for item in items:
        if not isinstance(item, SbpParallel):
            raise TypeError(
                f"every SBP entry must be split(d), broadcast or partial_sum, got {_describe(item)} "
                f"in {sbp!r}."
            )
    if len(items) != placement_ndim:
        raise ValueError(
            f"the SBP {sbp_str(items)} has {len(items)} entr{'y' if len(items) == 1 else 'ies'} but "
            f"the placement has {placement_ndim} axes; give one SBP per placement axis, e.g. "
            f"{sbp_str(tuple([broadcast] * placement_ndim))}."
        )
    if tensor_ndim is not None:
        fixed = []
        for item in items:
            if isinstance(item, Split):
                dim = item.dim
                if not -max(tensor_ndim, 1) <= dim < max(tensor_ndim, 1) or tensor_ndim == 0:
                    raise ValueError(
                        f"split({dim}) is out of range for a tensor with {tensor_ndim} dims "
                        f"(valid dims are {-tensor_ndim}..{tensor_ndim - 1}); "
                        "pick a dim the tensor has, or use broadcast."
                    )
                item = Split(dim % tensor_ndim)
            fixed.append(item)
        items = tuple(fixed)
    return items
