"""Creating global tensors directly: ``sbpflow.zeros(..., placement=, sbp=)`` and friends.

Each rank builds only its own piece. Random tensors depend only on the seed
(see NOTE [counter-based random]), never on the placement or SBP.

# NOTE [counter-based random]
# A random tensor of ``n`` elements takes positions ``offset .. offset + n - 1``
# of the logical random state (NOTE [logical random state] in _rng.py). Its
# element ``i`` (flat index in the logical tensor) is murmur3_32 of the words
# ``(seed, stream, offset + i)``: a full-avalanche hash, so neighbouring
# positions and seeds give independent bits (a bare finaliser maps 0 to 0 and
# leaves small inputs poorly mixed).
# A rank computes exactly its slice, split ranks get different slices of the
# same logical tensor, broadcast ranks identical data, and no rank ever holds
# more than its piece. Normal samples use Box-Muller on two such uniforms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _global, _rng
from ._layout import Layout, empty_local_shape, partial_piece
from .comm._mesh import MESHES
from .comm._world import device_for, get_rank
from .placement import Placement
from .sbp import normalize

if TYPE_CHECKING:
    from ._global import GlobalTensor

__all__ = [
    "arange",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "manual_seed",
    "ones",
    "ones_like",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "zeros",
    "zeros_like",
]

_MASK32 = 0xFFFFFFFF
manual_seed = _rng.manual_seed


def _shape_of(size: Sequence[Any], name: str) -> tuple[int, ...]:
    """torch's size forms: ints as separate arguments, or one tuple/list/``torch.Size``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for n in size:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(
                f"sbpflow.{name} takes the size as ints or one tuple of ints, as torch does, got "
                f"{tuple(size)!r}; e.g. sbpflow.{name}(4, 2, ...) or sbpflow.{name}((4, 2), ...)."
            )
        if n < 0:
            raise ValueError(f"sbpflow.{name}: sizes must be non-negative, got {tuple(size)!r}.")
    return tuple(size)


def _layout_for(placement: Any, sbp: Any, ndim: int, name: str) -> Layout:
    if not isinstance(placement, Placement):
        raise TypeError(
            f"sbpflow.{name} needs placement=sbpflow.placement(...), got {placement!r}."
        )
    if sbp is None:
        raise ValueError(f"sbpflow.{name} needs sbp=, e.g. sbp=sbpflow.sbp.broadcast.")
    layout = Layout(placement, normalize(sbp, placement.ndim, ndim))
    # The device first: a cuda placement without CUDA is to_global's clear error, raised before
    # any process group of the placement is made (which would fail inside torch.distributed).
    device_for(placement.type)
    return layout


def _build(
    shape: tuple[int, ...], layout: Layout, dtype: torch.dtype, make: Any, requires_grad: bool
) -> GlobalTensor:
    MESHES.of(layout.placement, "a factory")  # its groups, made on every rank (NOTE [meshes])
    rank = get_rank()
    device = device_for(layout.placement.type)
    if rank in layout.placement:
        box = layout.box(shape, rank)
        local = make(box, device).to(dtype)
        if layout.has_partial:
            local = partial_piece(local, layout, rank)
    else:
        local = torch.empty(empty_local_shape(len(shape)), dtype=dtype, device=device)
    out = _global.GlobalTensor(local.to(dtype), layout, shape)
    return out.requires_grad_(requires_grad) if requires_grad else out


def _flat_index(
    box: Sequence[tuple[int, int]], shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (start, stop) in enumerate(box):
        stride = math.prod(shape[d + 1 :])
        coords = torch.arange(start, stop, dtype=torch.int64, device=device) * stride
        index = index.unsqueeze(-1) + coords
    return index


# The mixing helpers take a Python int (the per-tensor words) or an int64
# tensor of 32-bit values, which they update *in place* (the callers own it):
# hashing a million elements allocates a few buffers instead of hundreds.
_Word = torch.Tensor | int


def _mul32(x: _Word, c: int) -> _Word:
    # (x * c) mod 2**32 in 16-bit halves, so int64 products never overflow.
    if isinstance(x, int):
        return (x * c) & _MASK32
    high = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_MASK32)


def _rotl32(x: _Word, r: int) -> _Word:
    if isinstance(x, int):
        return ((x << r) & _MASK32) | (x >> (32 - r))
    low = x >> (32 - r)
    return x.bitwise_left_shift_(r).bitwise_and_(_MASK32).bitwise_or_(low)


def _xor_shift(x: _Word, r: int) -> _Word:
    if isinstance(x, int):
        return x ^ (x >> r)
    return x.bitwise_xor_(x >> r)


def _fmix32(h: _Word) -> _Word:
    # murmur3's finaliser: full avalanche of a 32-bit state.
    h = _mul32(_xor_shift(h, 16), 0x85EBCA6B)
    h = _mul32(_xor_shift(h, 13), 0xC2B2AE35)
    return _xor_shift(h, 16)


def _absorb(h: _Word, word: _Word) -> _Word:
    # One 32-bit block of murmur3_32 (constants from the reference implementation).
    k = _mul32(_rotl32(_mul32(word, 0xCC9E2D51), 15), 0x1B873593)
    if isinstance(k, torch.Tensor):
        mixed: _Word = k.bitwise_xor_(h)
    else:
        mixed = h ^ k if isinstance(h, int) else h.bitwise_xor_(k)
    mixed = _mul32(_rotl32(mixed, 13), 5)
    if isinstance(mixed, int):
        return (mixed + 0xE6546B64) & _MASK32
    return mixed.add_(0xE6546B64).bitwise_and_(_MASK32)


def _random_bits(position: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """32 random bits per element: murmur3_32 of ``(seed, stream, position)``.

    The five 32-bit words are ``seed_lo, seed_hi, stream, position_hi,
    position_lo``. Words that are the same for every element (all but
    ``position_lo``, and ``position_hi`` while it does not change across the
    tensor) are absorbed once in Python, so a typical tensor costs one block
    and the finaliser in tensor ops.
    """
    h: _Word = 0
    for word in (seed & _MASK32, (seed >> 32) & _MASK32, stream):
        h = _absorb(h, word)
    high = position >> 32
    if position.numel() == 0 or int(high.min()) == int(high.max()):
        h = _absorb(h, int(high.min()) if position.numel() else 0)
    else:
        h = _absorb(h, high)
    mixed = _absorb(h, position & _MASK32)
    assert isinstance(mixed, torch.Tensor)
    return _fmix32(mixed.bitwise_xor_(20))  # type: ignore[return-value]  # 20 = bytes hashed


def _uniform(position: torch.Tensor, seed: int, stream: int, bits: int = 32) -> torch.Tensor:
    """Uniform float64 in [0, 1) on a grid of ``2**-bits`` (``bits`` <= 32).

    Using no more bits than the target dtype's mantissa keeps the value below 1
    after the cast (1 - 2**-32 rounds to 1.0 in float32).
    """
    return (_random_bits(position, seed, stream) >> (32 - bits)).to(torch.float64) * (2.0**-bits)


def _mantissa_bits(dtype: torch.dtype) -> int:
    if not dtype.is_floating_point:
        return 32
    return min(32, 1 - round(math.log2(torch.finfo(dtype).eps)))  # float32: 24, float16: 11


def rand(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.rand``: uniform [0, 1) global tensor; the logical value depends only on the seed."""
    return _random(_shape_of(size, "rand"), placement, sbp, dtype, requires_grad, "rand")


def randn(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.randn``: standard normal global tensor; the logical value depends only on the seed."""
    return _random(_shape_of(size, "randn"), placement, sbp, dtype, requires_grad, "randn")


def _random(shape: tuple[int, ...], placement: Any, sbp: Any, dtype: torch.dtype | None,
            requires_grad: bool, name: str) -> GlobalTensor:  # fmt: skip
    layout = _layout_for(placement, sbp, len(shape), name)
    dtype = dtype or torch.get_default_dtype()
    seed, offset = _rng.take(math.prod(shape))  # on every rank, in the placement or not

    def make(box: Any, device: torch.device) -> torch.Tensor:
        position = _flat_index(box, shape, device).add_(offset)
        if name == "rand":
            return _uniform(position, seed, 0, _mantissa_bits(dtype))
        # Box-Muller; 1 - u is in (0, 1], so the log is finite (|z| < 6.7 at 32 bits).
        radius = torch.sqrt(-2.0 * torch.log1p(-_uniform(position, seed, 0)))
        return radius * torch.cos(2 * math.pi * _uniform(position, seed, 1))

    return _build(shape, layout, dtype, make, requires_grad)


def full(size: Sequence[int], fill_value: Any, *, placement: Placement, sbp: Any,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.full``: every element ``fill_value``; the dtype follows it unless given."""
    if not isinstance(size, (tuple, list, torch.Size)):
        raise TypeError(
            f"sbpflow.full takes the size as one tuple, as torch.full does, got "
            f"{type(size).__name__} {size!r}; write sbpflow.full((4, 2), 3.0, placement=..., sbp=...)."
        )
    return _full(_shape_of((size,), "full"), fill_value, placement, sbp, dtype, requires_grad)


def _full(shape: tuple[int, ...], fill_value: Any, placement: Any, sbp: Any,
          dtype: torch.dtype | None, requires_grad: bool, name: str = "full") -> GlobalTensor:  # fmt: skip
    layout = _layout_for(placement, sbp, len(shape), name)
    if dtype is None:
        dtype = torch.full((), fill_value).dtype

    def make(box: Any, device: torch.device) -> torch.Tensor:
        return torch.full(tuple(b - a for a, b in box), fill_value, dtype=dtype, device=device)

    return _build(shape, layout, dtype, make, requires_grad)


def zeros(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.zeros`` as a global tensor."""
    return _full(_shape_of(size, "zeros"), 0, placement, sbp,
                 dtype or torch.get_default_dtype(), requires_grad, "zeros")  # fmt: skip


def ones(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.ones`` as a global tensor (on a partial axis: ones, not the number of ranks)."""
    return _full(_shape_of(size, "ones"), 1, placement, sbp,
                 dtype or torch.get_default_dtype(), requires_grad, "ones")  # fmt: skip


def empty(*size: Any, placement: Placement, sbp: Any, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.empty`` as a global tensor: uninitialised pieces."""
    return _empty(_shape_of(size, "empty"), placement, sbp, dtype, requires_grad)


def _empty(shape: tuple[int, ...], placement: Any, sbp: Any, dtype: torch.dtype | None,
           requires_grad: bool, name: str = "empty") -> GlobalTensor:  # fmt: skip
    layout = _layout_for(placement, sbp, len(shape), name)
    dtype = dtype or torch.get_default_dtype()

    def make(box: Any, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(b - a for a, b in box), dtype=dtype, device=device)

    return _build(shape, layout, dtype, make, requires_grad)


def arange(start: Any = 0, end: Any = None, step: Any = 1, *, placement: Placement, sbp: Any,
           dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.arange(end)`` or ``torch.arange(start, end, step)`` as a 1-D global tensor;
    each rank computes only its piece."""
    if end is None:
        start, end = 0, start
    start, end, step = (v.item() if isinstance(v, torch.Tensor) else v for v in (start, end, step))
    length, dtype = _arange_meta(start, end, step, dtype)
    layout = _layout_for(placement, sbp, 1, "arange")

    def make(box: Any, device: torch.device) -> torch.Tensor:
        ((lo, hi),) = box
        return torch.arange(lo, hi, dtype=torch.float64, device=device) * step + start

    return _build((length,), layout, dtype, make, requires_grad)


# -- *_like: torch's forms, keeping a global input's placement and SBP -------------------


def _like_layout(input: Any, placement: Any, sbp: Any, name: str) -> tuple[Any, Any]:
    """The placement and SBP for ``name(input, ...)``: the given ones, else ``input``'s own."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"sbpflow.{name} takes a tensor, got {type(input).__name__} {input!r}.")
    if not isinstance(input, _global.GlobalTensor):
        if placement is None or sbp is None:
            raise ValueError(
                f"sbpflow.{name} of a plain tensor needs placement= and sbp= (a global input "
                "lends its own); e.g. sbpflow.zeros_like(x, placement=sbpflow.placement('cpu', "
                "[0, 1]), sbp=sbpflow.sbp.broadcast)."
            )
        return placement, sbp
    placement = input.placement if placement is None else placement
    if sbp is None:
        if not isinstance(placement, Placement) or placement.ndim != input.placement.ndim:
            raise ValueError(
                f"sbpflow.{name}(placement={placement}) has a different number of mesh axes "
                f"than the input's {input.placement}, so its SBP cannot be kept; pass sbp= too."
            )
        sbp = input.sbp
    return placement, sbp


def zeros_like(input: torch.Tensor, *, placement: Placement | None = None, sbp: Any = None,
               dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.zeros_like``; a global ``input``'s placement and SBP unless given."""
    placement, sbp = _like_layout(input, placement, sbp, "zeros_like")
    return _full(tuple(input.shape), 0, placement, sbp, dtype or input.dtype, requires_grad,
                 "zeros_like")  # fmt: skip


def ones_like(input: torch.Tensor, *, placement: Placement | None = None, sbp: Any = None,
              dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.ones_like``; a global ``input``'s placement and SBP unless given."""
    placement, sbp = _like_layout(input, placement, sbp, "ones_like")
    return _full(tuple(input.shape), 1, placement, sbp, dtype or input.dtype, requires_grad,
                 "ones_like")  # fmt: skip


def full_like(input: torch.Tensor, fill_value: Any, *, placement: Placement | None = None,
              sbp: Any = None, dtype: torch.dtype | None = None,
              requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.full_like`` (the input's dtype unless given); a global ``input``'s placement
    and SBP unless given."""
    placement, sbp = _like_layout(input, placement, sbp, "full_like")
    return _full(tuple(input.shape), fill_value, placement, sbp, dtype or input.dtype,
                 requires_grad, "full_like")  # fmt: skip


def empty_like(input: torch.Tensor, *, placement: Placement | None = None, sbp: Any = None,
               dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.empty_like``; a global ``input``'s placement and SBP unless given."""
    placement, sbp = _like_layout(input, placement, sbp, "empty_like")
    return _empty(tuple(input.shape), placement, sbp, dtype or input.dtype, requires_grad,
                  "empty_like")  # fmt: skip


def rand_like(input: torch.Tensor, *, placement: Placement | None = None, sbp: Any = None,
              dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.rand_like``, seeded as ``sbpflow.rand``; a global ``input``'s placement and
    SBP unless given."""
    placement, sbp = _like_layout(input, placement, sbp, "rand_like")
    return _random(tuple(input.shape), placement, sbp, dtype or input.dtype, requires_grad,
                   "rand")  # fmt: skip


def randn_like(input: torch.Tensor, *, placement: Placement | None = None, sbp: Any = None,
               dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:  # fmt: skip
    """``torch.randn_like``, seeded as ``sbpflow.randn``; a global ``input``'s placement and
    SBP unless given."""
    placement, sbp = _like_layout(input, placement, sbp, "randn_like")
    return _random(tuple(input.shape), placement, sbp, dtype or input.dtype, requires_grad,
                   "randn")  # fmt: skip


def _arange_meta(
    start: Any, end: Any, step: Any, dtype: torch.dtype | None
) -> tuple[int, torch.dtype]:
    """Length and dtype of ``torch.arange(start, end, step)``, as torch computes them.

    Worked out here rather than with a meta-device ``torch.arange``: the first
    meta call imports torch's reference ops, which costs seconds per process.
    """
    for name, value in (("start", start), ("end", end), ("step", step)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"arange {name} must be an int or float, got {value!r}.")
    if step == 0:
        raise ValueError("arange step must be non-zero, got 0.")
    if (end - start) * step < 0:
        raise ValueError(
            f"arange(start={start}, end={end}, step={step}): the step points away from end; "
            "use a step with the sign of end - start."
        )
    if dtype is None:
        any_float = any(isinstance(v, float) for v in (start, end, step))
        dtype = torch.get_default_dtype() if any_float else torch.int64
    return math.ceil((end - start) / step), dtype
