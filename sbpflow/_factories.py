"""Creating global tensors directly: ``sbpflow.zeros(..., placement=, sbp=)`` and friends.

Each rank builds only its own piece. Random tensors depend only on the seed
(see NOTE [counter-based random]), never on the placement or SBP.

# NOTE [counter-based random]
# Element ``i`` (flat index in the logical tensor) of the ``k``-th random
# tensor created since ``sbpflow.manual_seed(s)`` is a hash of ``(s, k, i)``.
# A rank computes exactly its slice, split ranks get different slices of the
# same logical tensor, broadcast ranks identical data, and no rank ever holds
# more than its piece. Normal samples use Box-Muller on two such uniforms.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ._layout import Layout, empty_local_shape
from .comm._world import device_for, get_rank
from .placement import Placement
from .sbp import normalize
from .tensor import GlobalTensor

__all__ = ["manual_seed", "randn", "rand", "zeros", "ones", "empty", "full", "arange"]

_seed = 0
_counter = 0
_MASK32 = 0xFFFFFFFF


def manual_seed(seed: int) -> None:
    """Seed sbpflow's global random tensors (and torch's own generator)."""
    global _seed, _counter
    if not isinstance(seed, int):
        raise TypeError(f"manual_seed takes an int, got {type(seed).__name__}.")
    _seed, _counter = seed & 0xFFFFFFFFFFFF, 0
    torch.manual_seed(seed)


def _shape_of(size: Sequence[Any]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for n in size:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"sizes must be non-negative ints, got {tuple(size)!r}.")
    return tuple(size)


def _layout_for(placement: Any, sbp: Any, ndim: int, name: str) -> Layout:
    if not isinstance(placement, Placement):
        raise TypeError(
            f"sbpflow.{name} needs placement=sbpflow.placement(...), got {placement!r}."
        )
    if sbp is None:
        raise ValueError(f"sbpflow.{name} needs sbp=, e.g. sbp=sbpflow.sbp.broadcast.")
    return Layout(placement, normalize(sbp, placement.ndim, ndim))


def _build(
    shape: tuple[int, ...], layout: Layout, dtype: torch.dtype, make: Any, requires_grad: bool
) -> GlobalTensor:
    rank = get_rank()
    device = device_for(layout.placement.type)
    if rank in layout.placement:
        box = layout.box(shape, rank)
        local = make(box, device)
        if any(isinstance(s, type(layout.sbp[0])) and s.is_partial for s in layout.sbp):
            local = _partial_piece(local, layout, rank)
    else:
        local = torch.empty(empty_local_shape(len(shape)), dtype=dtype, device=device)
    out = GlobalTensor(local.to(dtype), layout, shape)
    return out.requires_grad_(requires_grad) if requires_grad else out


def _partial_piece(local: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    # A partial axis holds the value on the group's first rank and zeros elsewhere.
    coords = layout.placement.coords_of(rank)
    for c, s in zip(coords, layout.sbp):
        if s.is_partial and c != 0:
            return torch.zeros_like(local)
    return local


def _flat_index(box: Sequence[tuple[int, int]], shape: Sequence[int], device: torch.device) -> torch.Tensor:
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (start, stop) in enumerate(box):
        stride = math.prod(shape[d + 1 :])
        coords = torch.arange(start, stop, dtype=torch.int64, device=device) * stride
        index = index.unsqueeze(-1) + coords
    return index


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's 32-bit finaliser, on int64 holding 32-bit values.
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _uniform(index: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform floats in (0, 1) from the counter ``(seed, tensor number, stream, index)``."""
    key = _hash32(torch.tensor(_seed ^ (_counter * 0x9E3779B9) ^ (stream << 20)) + (_seed >> 32))
    mixed = _hash32(_hash32((index & _MASK32) ^ key) ^ (index >> 32) ^ _hash32(key + 1))
    return ((mixed >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def rand(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """Uniform [0, 1) global tensor; the logical value depends only on the seed."""
    return _random(size, placement, sbp, dtype, requires_grad, "rand")


def randn(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """Standard normal global tensor; the logical value depends only on the seed."""
    return _random(size, placement, sbp, dtype, requires_grad, "randn")


def _random(size: Sequence[Any], placement: Any, sbp: Any, dtype: torch.dtype | None,
            requires_grad: bool, name: str) -> GlobalTensor:  # fmt: skip
    global _counter
    shape = _shape_of(size)
    layout = _layout_for(placement, sbp, len(shape), name)
    dtype = dtype or torch.get_default_dtype()

    def make(box: Any, device: torch.device) -> torch.Tensor:
        index = _flat_index(box, shape, device)
        u1 = _uniform(index, 0)
        if name == "rand":
            return u1
        u2 = _uniform(index, 1)
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)

    out = _build(shape, layout, dtype, make, requires_grad)
    _counter += 1
    return out


def full(*size: Any, fill_value: Any, placement: Placement, sbp: Any,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    shape = _shape_of(size)
    layout = _layout_for(placement, sbp, len(shape), "full")
    if dtype is None:
        dtype = torch.full((), fill_value).dtype

    def make(box: Any, device: torch.device) -> torch.Tensor:
        return torch.full(tuple(b - a for a, b in box), fill_value, dtype=dtype, device=device)

    return _build(shape, layout, dtype, make, requires_grad)


def zeros(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    return full(*size, fill_value=0, placement=placement, sbp=sbp,
                dtype=dtype or torch.get_default_dtype(), requires_grad=requires_grad)  # fmt: skip


def ones(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    return full(*size, fill_value=1, placement=placement, sbp=sbp,
                dtype=dtype or torch.get_default_dtype(), requires_grad=requires_grad)  # fmt: skip


def empty(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    shape = _shape_of(size)
    layout = _layout_for(placement, sbp, len(shape), "empty")
    dtype = dtype or torch.get_default_dtype()

    def make(box: Any, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(b - a for a, b in box), dtype=dtype, device=device)

    return _build(shape, layout, dtype, make, requires_grad)


def arange(start: Any, end: Any = None, step: Any = 1, *, placement: Placement, sbp: Any,
           dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """1-D ``torch.arange`` as a global tensor; each rank computes only its piece."""
    if end is None:
        start, end = 0, start
    reference = torch.arange(start, end, step, device="meta", dtype=dtype)
    shape = tuple(reference.shape)
    layout = _layout_for(placement, sbp, 1, "arange")

    def make(box: Any, device: torch.device) -> torch.Tensor:
        (lo, hi), = box
        return torch.arange(lo, hi, dtype=torch.float64, device=device) * step + start

    return _build(shape, layout, reference.dtype, make, requires_grad)
