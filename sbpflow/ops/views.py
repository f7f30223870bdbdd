"""View and shape ops: a split follows its dim to wherever the op moves it.

# NOTE [view rules]
# A view keeps the data and renames dims, so a split on dim ``d`` survives as a
# split on the output dim ``d`` becomes: transpose/permute remap it, unsqueeze
# and squeeze shift it, slicing/select/cat/split keep it when they act on
# another dim. Partial and broadcast pass through unchanged (views are linear).
# A split on the dim an op cuts into (slice, select, index_select) needs the
# whole dim, so those ops take it as broadcast.
#
# view/reshape keep a split on dim ``d`` when some output dim ``e`` starts at
# the same flat offset (equal products of the dims before) and the balanced
# pieces line up: each rank's range of ``d``, scaled by the elements after
# ``d``, is exactly its range of ``e`` scaled by the elements after ``e``.
# That covers merging ``d`` with the dims after it and splitting ``d`` into an
# outer dim and the rest, when the sizes divide as the balanced rule needs.
# Otherwise the input is gathered (B). The local size argument is the local
# output shape. On an N-D mesh two axes may split the same dim; the local
# function re-checks the nested pieces and, when they do not line up, gathers
# the split axes and cuts the output piece from the whole (rare, still correct).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from .._layout import Layout, balanced_sizes
from .._lazy_bits import resolved
from ..sbp import Partial, Split
from ._helpers import B, P, box_to, gather_splits, normalize_dim, strategy
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__ = ["view_split_target"]


def _passthrough(info: OpInfo) -> list[Strategy]:
    """B -> B and P -> P on every input: views only move elements."""
    n, k = len(info.inputs), len(info.outputs)
    return [Strategy((s,) * n, (s,) * k) for s in (B, P)]


def _with_splits(info: OpInfo, pairs: Sequence[tuple[int, int]]) -> list[Strategy]:
    """S(d) -> S(e) for each ``(d, e)`` (every input and output), then the passthroughs."""
    n, k = len(info.inputs), len(info.outputs)
    out = [Strategy((Split(d),) * n, (Split(e),) * k) for d, e in pairs]
    return out + _passthrough(info)


# -- view / reshape ------------------------------------------------------------------


def _boundaries(length: int, parts: int) -> list[int]:
    bounds = [0]
    for size in balanced_sizes(length, parts):
        bounds.append(bounds[-1] + size)
    return bounds


def view_split_target(
    in_shape: Sequence[int], out_shape: Sequence[int], dim: int, parts: int
) -> int | None:
    """The output dim that keeps a split of input ``dim`` over ``parts`` ranks, if any.

    See NOTE [view rules]: equal prefix products and matching balanced pieces.
    """
    if math.prod(in_shape) == 0:
        return None
    prefix = math.prod(in_shape[:dim])
    suffix_in = math.prod(in_shape[dim + 1 :])
    mine = [b * suffix_in for b in _boundaries(in_shape[dim], parts)]
    for e in range(len(out_shape)):
        if math.prod(out_shape[:e]) != prefix:
            continue
        suffix_out = math.prod(out_shape[e + 1 :])
        if [b * suffix_out for b in _boundaries(out_shape[e], parts)] == mine:
            return e
    return None


@functools.lru_cache(maxsize=1024)
def _pieces_line_up(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], src: Layout, dst: Layout
) -> bool:
    """Whether every rank's local view is its piece of the logical view (nested splits)."""
    for rank in src.placement.flat_ranks:
        in_box, out_box = src.box(in_shape, rank), dst.box(out_shape, rank)
        if math.prod(b - a for a, b in in_box) != math.prod(b - a for a, b in out_box):
            return False
        for s_in, s_out in zip(src.sbp, dst.sbp, strict=True):
            if not isinstance(s_in, Split):
                continue
            assert isinstance(s_out, Split)
            d, e = s_in.dim, s_out.dim
            suffix_in, suffix_out = math.prod(in_shape[d + 1 :]), math.prod(out_shape[e + 1 :])
            if (in_box[d][0] * suffix_in, in_box[d][1] * suffix_in) != (
                out_box[e][0] * suffix_out,
                out_box[e][1] * suffix_out,
            ):
                return False
    return True


def _view_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext) -> Any:
    x = args[0]
    src, dst = ctx.input_layouts[0], ctx.output_layouts[0]
    in_shape, out_shape = ctx.input_metas[0].shape, ctx.output_metas[0].shape
    if _pieces_line_up(tuple(in_shape), tuple(out_shape), src, dst):
        shape = list(ctx.local_output_shape(0))
        if func is aten.view.default and not x.is_contiguous():
            # A global tensor always reports contiguous strides, but its local piece may be a
            # transposed view: reshape views it when it can and copies when it cannot.
            return x.reshape(shape)
        return func(x, shape)
    # Nested splits that do not line up: gather the split axes, view the whole,
    # cut this rank's output box (partial axes stay partial pieces throughout).
    whole = box_to(x, src, in_shape, gather_splits(src)).reshape(out_shape)
    return whole[tuple(slice(a, b) for a, b in dst.box(tuple(out_shape), ctx.rank))].clone()


@register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    family="views",
    local=_view_local,
)
def view_rule(info: OpInfo) -> list[Strategy]:
    in_shape, out_shape = info.inputs[0].shape, info.outputs[0].shape
    pairs = []
    for d in range(len(in_shape)):
        e = view_split_target(in_shape, out_shape, d, info.mesh_axis_size)
        if e is not None:
            pairs.append((d, e))
    return _with_splits(info, pairs)


# -- dims moved ---------------------------------------------------------------------


@register(aten.transpose.int, family="views")
def transpose_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    d0, d1 = (normalize_dim(d, ndim) for d in info.args[1:3])
    swap = {d0: d1, d1: d0}
    return _with_splits(info, [(d, swap.get(d, d)) for d in range(ndim)])


@register(aten.permute.default, family="views")
def permute_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dims = [normalize_dim(d, ndim) for d in info.args[1]]
    return _with_splits(info, [(d, i) for i, d in enumerate(dims)])


@register(aten.unsqueeze.default, family="views")
def unsqueeze_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1], ndim + 1)
    return _with_splits(info, [(d, d + (d >= dim)) for d in range(ndim)])


def _squeezed_dims(info_shape: Sequence[int], func: Any, args: Sequence[Any]) -> list[int]:
    ndim = len(info_shape)
    if func is aten.squeeze.default or len(args) < 2:
        dims = list(range(ndim))
    elif isinstance(args[1], int):
        dims = [args[1]]
    else:
        dims = list(args[1])
    return sorted(
        {normalize_dim(d, ndim) for d in dims if ndim and info_shape[normalize_dim(d, ndim)] == 1}
    )


def _squeeze_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    # A split size-1 dim is never squeezed here (the rule gathers it), but a split dim
    # that is 1 long locally must survive: squeeze exactly the logical size-1 dims.
    dims = _squeezed_dims(ctx.input_metas[0].shape, func, args)
    return aten.squeeze.dims(args[0], dims) if dims else aten.alias.default(args[0])


@register(
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, family="views", local=_squeeze_local
)
def squeeze_rule(info: OpInfo) -> list[Strategy]:
    shape = info.inputs[0].shape
    removed = _squeezed_dims(shape, info.func, info.args)
    pairs = [(d, d - sum(r < d for r in removed)) for d in range(len(shape)) if d not in removed]
    return _with_splits(info, pairs)


def _expand_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    return func(args[0], list(ctx.local_output_shape(0)), *args[2:], **kwargs)


@register(aten.expand.default, family="views", local=_expand_local)
def expand_rule(info: OpInfo) -> list[Strategy]:
    in_shape, out_shape = info.inputs[0].shape, info.outputs[0].shape
    offset = len(out_shape) - len(in_shape)
    pairs = [(d, d + offset) for d in range(len(in_shape)) if in_shape[d] == out_shape[d + offset]]
    return _with_splits(info, pairs)


# -- lazy conjugate / negative views ------------------------------------------------


def _resolved_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    """The piece with its flag applied: kernels below ``__torch_dispatch__`` would ignore it
    (NOTE [lazy bits] in ``sbpflow/_lazy_bits.py``)."""
    return resolved(func(*args, **kwargs))


@register(aten._conj.default, aten._neg_view.default, family="views", local=_resolved_local)
def lazy_bit_rule(info: OpInfo) -> list[Strategy]:
    """Elementwise and linear: any layout stays as it is, but negation turns a max into a min,
    so a max-partial input is gathered first."""
    s = info.current[0]
    if isinstance(s, Partial) and s.reduce_op == "max":
        return [Strategy((B,), (B,))]
    return [Strategy((s,), (s,)), Strategy((B,), (B,))]


# -- cutting along one dim ------------------------------------------------------------


def _sized_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    """Backward ops whose second argument is the (logical) input size: pass the local one."""
    return func(args[0], list(ctx.local_output_shape(0)), *args[2:], **kwargs)


def _slice_is_whole(info: OpInfo, dim: int) -> bool:
    length = info.inputs[0].shape[dim]
    return info.outputs[0].shape[dim] == length


@register(aten.slice.Tensor, family="views")
def slice_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0), ndim)
    pairs = [(d, d) for d in range(ndim) if d != dim or _slice_is_whole(info, dim)]
    return _with_splits(info, pairs)


@register(aten.slice_backward.default, family="views", local=_sized_local)
def slice_backward_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[2], ndim)
    same = info.inputs[0].shape[dim] == info.outputs[0].shape[dim]
    return _with_splits(info, [(d, d) for d in range(ndim) if d != dim or same])


@register(aten.select.int, family="views")
def select_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1], ndim)
    return _with_splits(info, [(d, d - (d > dim)) for d in range(ndim) if d != dim])


@register(aten.select_backward.default, family="views", local=_sized_local)
def select_backward_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.outputs[0].ndim
    dim = normalize_dim(info.args[2], ndim)
    return _with_splits(info, [(d, d + (d >= dim)) for d in range(ndim - 1)])


@register(aten.index_select.default, family="views")
def index_select_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1], ndim)
    out = [strategy(info, {"self": Split(d)}, (Split(d),)) for d in range(ndim) if d != dim]
    if info.inputs[1].ndim == 1 and info.outputs[0].ndim > dim:  # a 0-dim self gives 0 dims
        out.append(strategy(info, {"index": Split(0)}, (Split(dim),)))
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"self": P}, (P,)))
    return out


@register(aten.index_add.default, aten.index_add_.default, family="views")
def index_add_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1], ndim)
    out = [
        strategy(info, {"self": Split(d), "source": Split(d)}, (Split(d),))
        for d in range(ndim)
        if d != dim and info.inputs[0].shape[d] == _source_shape(info)[d]
    ]
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"self": P, "source": P}, (P,)))
    return out


def _source_shape(info: OpInfo) -> tuple[int, ...]:
    return info.inputs[-1].shape if len(info.inputs) == 3 else info.inputs[0].shape


# -- many tensors <-> one --------------------------------------------------------------


@register(aten.cat.default, family="views")
def cat_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.outputs[0].ndim
    dim = normalize_dim(info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0), ndim)
    # legacy empty 1-D pieces (a fresh key/value cache): cat skips them, so they stay
    # broadcast while the other pieces keep their split or partial sum
    full = [meta.ndim == ndim for meta in info.inputs]
    if any(not f and meta.shape != (0,) for f, meta in zip(full, info.inputs, strict=True)):
        return _passthrough(info)
    strategies = _with_splits(info, [(d, d) for d in range(ndim) if d != dim])
    if all(full):
        return strategies
    return [
        Strategy(tuple(s if f else B for s, f in zip(st.inputs, full, strict=True)), st.outputs)
        for st in strategies
    ]


@register(aten.stack.default, family="views")
def stack_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    dim = normalize_dim(info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0), ndim + 1)
    return _with_splits(info, [(d, d + (d >= dim)) for d in range(ndim)])


def _split_dim(info: OpInfo, position: int) -> int:
    ndim = info.inputs[0].ndim
    dim = info.args[position] if len(info.args) > position else info.kwargs.get("dim", 0)
    return normalize_dim(dim, ndim)


@register(aten.split.Tensor, aten.split_with_sizes.default, family="views")
def split_rule(info: OpInfo) -> list[Strategy]:
    dim = _split_dim(info, 2)
    return _with_splits(info, [(d, d) for d in range(info.inputs[0].ndim) if d != dim])


@register(aten.unbind.int, family="views")
def unbind_rule(info: OpInfo) -> list[Strategy]:
    dim = _split_dim(info, 1)
    return _with_splits(info, [(d, d - (d > dim)) for d in range(info.inputs[0].ndim) if d != dim])


# -- advanced indexing ----------------------------------------------------------------


def _index_map(
    self_shape: Sequence[int], indices: Sequence[Any]
) -> tuple[dict[int, int], tuple[int, ...]] | None:
    """For ``self[indices]`` with integer index tensors: where each non-indexed dim of
    ``self`` lands in the output, and the output shape. None for boolean masks."""
    shapes, positions = [], []
    for i, ix in enumerate(indices):
        if ix is None:
            continue
        if ix.dtype in (torch.bool, torch.uint8):
            return None  # a mask consumes several dims and has a data-dependent length
        shapes.append(tuple(ix.shape))
        positions.append(i)
    if not positions:
        return None
    bshape = tuple(torch.broadcast_shapes(*shapes))
    m = len(bshape)
    free = [d for d in range(len(self_shape)) if d not in positions]
    if positions == list(range(positions[0], positions[-1] + 1)):
        # Consecutive index tensors: their broadcast dims replace them in place.
        where = {d: d if d < positions[0] else d - len(positions) + m for d in free}
        before = [self_shape[d] for d in free if d < positions[0]]
        after = [self_shape[d] for d in free if d > positions[0]]
        return where, (*before, *bshape, *after)
    # Separated index tensors: the broadcast dims go first (numpy rule).
    return {d: m + k for k, d in enumerate(free)}, (*bshape, *(self_shape[d] for d in free))


@register(aten.index.Tensor, family="views")
def index_rule(info: OpInfo) -> list[Strategy]:
    self_meta, indices = info.inputs[0], info.args[1]
    found = _index_map(self_meta.shape, indices)
    out: list[Strategy] = []
    if found is not None:
        where, _ = found
        out += [strategy(info, {"self": Split(d)}, (Split(e),)) for d, e in where.items()]
        tensors = [i for i, ix in enumerate(indices) if ix is not None]
        global_ = [ix for ix in indices if ix is not None and not isinstance(ix, torch.Tensor)]
        first = tensors[0]
        consecutive = tensors == list(range(first, tensors[-1] + 1))
        if len(tensors) == 1 and len(global_) == 1:  # one index tensor: split its dims
            start = first if consecutive else 0
            for k in range(global_[0].ndim):
                out.append(strategy(info, {"indices": Split(k)}, (Split(start + k),)))
    out.append(strategy(info, {}, (B,)))
    out.append(strategy(info, {"self": P}, (P,)))
    return out


@register(aten.index_put.default, aten.index_put_.default, family="views")
def index_put_rule(info: OpInfo) -> list[Strategy]:
    self_meta, indices = info.inputs[0], info.args[1]
    values = info.inputs[-1]
    found = _index_map(self_meta.shape, indices)
    out: list[Strategy] = []
    if found is not None and values is not self_meta and tuple(values.shape) == found[1]:
        where, _ = found
        out += [
            strategy(info, {"self": Split(d), "values": Split(e)}, (Split(d),))
            for d, e in where.items()
        ]
    out.append(strategy(info, {}, (B,)))
    # Each rank writes (or adds) its part of the values at the same positions: the sum is kept.
    out.append(strategy(info, {"self": P, "values": P}, (P,)))
    return out
