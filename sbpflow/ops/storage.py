"""Ops defined on storage or on a tensor's own metadata: in-place views, ``as_strided``
(``_copy``, ``_scatter``), ``resize_``, ``set_``.

# NOTE [storage ops]
# Ops that address storage are given torch's meaning on the logical tensor:
# - ``as_strided`` (and ``as_strided_``, ``as_strided_copy``, ``as_strided_scatter``, ``resize_``)
#   address the input's storage: elements in memory order from a storage
#   offset, which may lie outside the input's own elements when it is a view.
#   Only a broadcast tensor holds its elements in one place; on a split or
#   partial tensor the op has no local meaning and is an error naming the fix
#   (box to broadcast first). On a broadcast tensor the op runs on the local
#   piece as it is, and only when that piece is exactly the storage torch would
#   address: storage offset 0, no elements beyond its own, and the logical
#   strides (NOTE [logical strides]). Then the piece's storage holds the logical
#   tensor's elements in the logical tensor's memory order, and the op reads
#   what torch reads (a transposed tensor is read in its memory order, not
#   row-major). A piece that is a view into a larger storage (the tensor is a
#   view of another one, ``base[5:15]``, or was detached from one) would make
#   the op address elements outside the tensor, which no copy of the tensor
#   holds: an error naming the fix (``x.clone()`` first), never the copy's
#   elements. ``to_global`` gives a broadcast tensor's pieces storage of their
#   own (NOTE [own storage] in sbpflow/tensor.py), so every rank of a
#   broadcast tensor decides alike.
# - In-place views (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``,
#   ``as_strided_``) change the tensor's own shape: they run as the matching
#   out-of-place view (its rule may re-lay the tensor out) and the tensor takes
#   over the result's local piece, layout and logical shape; the wrapper's
#   sizes are updated below dispatch. (matmul of a vector with a matrix ends in
#   ``squeeze_``: without this the result kept a stale size-1 dim.)
# - ``resize_`` to the current shape is a no-op; to another shape it resizes
#   a broadcast tensor's contiguous piece (and is an error on split/partial).
# - ``set_(source)`` makes the tensor an alias of a global ``source``; the
#   overloads taking a storage are errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._mode_utils import no_dispatch

from .. import _global
from ..sbp import Broadcast, sbp_str
from ._helpers import B, bind
from ._registry import LocalContext, OpInfo, Strategy, register, register_decomposition

if TYPE_CHECKING:
    from .._global import GlobalTensor

aten = torch.ops.aten

__all__: list[str] = []


def _refuse(op: str, layout: str) -> ValueError:
    return ValueError(
        f"{op} addresses a tensor's storage, but this global tensor is laid out as {layout}: "
        "no rank holds its elements in one piece, so the op has no meaning there. Box it to "
        "broadcast first (x.to_global(sbp=sbpflow.sbp.broadcast), one per axis on an N-D "
        "placement), or use an op defined on the logical tensor (view, reshape, narrow, "
        "unfold, diagonal)."
    )


def _holds_everything(x: GlobalTensor) -> bool:
    """Every rank of the placement holds the whole tensor (broadcast, or one rank per axis)."""
    return all(isinstance(s, Broadcast) for s in x._layout.normalized().sbp)


def _require_broadcast(op: str, x: Any) -> None:
    """Storage has logical meaning only on a broadcast tensor (``x`` a global tensor)."""
    if not _holds_everything(x):
        raise _refuse(op, sbp_str(x.sbp))


def _require_broadcast_axis(op: str, info: OpInfo) -> None:
    """The rule's form of ``_require_broadcast``: one placement axis at a time."""
    s = info.current[0]
    if not isinstance(s, Broadcast):
        raise _refuse(op, f"{s} on a placement axis")


def _require_own_storage(op: str, x: GlobalTensor) -> None:
    """``x``'s piece must be exactly the storage torch would address (NOTE [storage ops])."""
    local = x._local  # on a rank outside the placement: empty, holding its (empty) storage
    if _holds_its_storage(local, x._meta.strides):
        return
    raise ValueError(
        f"{op} addresses the storage of its input, but this global tensor of shape "
        f"{list(x.shape)} does not own its storage: it is a view into a larger one (piece at "
        f"storage offset {local.storage_offset()}, strides {list(local.stride())}, over a "
        f"storage of {local.untyped_storage().nbytes() // max(local.element_size(), 1)} "
        f"elements for {local.numel()}). torch would read the elements of the tensor it is a "
        f"view of, which a global tensor cannot give. Call {op} on a tensor with storage of "
        "its own, x.clone(), or on the tensor this one is a view of, or use an op defined on "
        "the logical tensor (view, reshape, narrow, unfold, diagonal)."
    )


def _holds_its_storage(local: torch.Tensor, logical_strides: tuple[int, ...]) -> bool:
    """Storage offset 0, no elements beyond its own, laid out by the logical strides."""
    if local.storage_offset() != 0:
        return False
    if local.untyped_storage().nbytes() != local.numel() * local.element_size():
        return False
    sizes, strides = local.shape, local.stride()
    return all(strides[d] == logical_strides[d] for d in range(local.dim()) if sizes[d] > 1)


@register_decomposition(
    aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default
)
def check_storage(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Refuse a broadcast input that does not own its storage; the rules below do the rest."""
    x = args[0] if args else kwargs["self"]
    if isinstance(x, _global.GlobalTensor) and _holds_everything(x):
        _require_own_storage(func.overloadpacket.__name__, x)
    return NotImplemented


# -- as_strided ---------------------------------------------------------------------


def _as_strided_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    offset = bound.get("storage_offset")
    return func(bound["self"], bound["size"], bound["stride"], offset or 0)


@register(
    aten.as_strided.default, aten.as_strided_copy.default, family="storage",
    local=_as_strided_local,
)  # fmt: skip
def as_strided_rule(info: OpInfo) -> list[Strategy]:
    _require_broadcast_axis("as_strided", info)
    return [Strategy((B,), (B,))]


def _as_strided_scatter_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    offset = bound.get("storage_offset")
    return func(bound["self"], bound["src"], bound["size"], bound["stride"], offset or 0)


@register(aten.as_strided_scatter.default, family="storage", local=_as_strided_scatter_local)
def as_strided_scatter_rule(info: OpInfo) -> list[Strategy]:
    _require_broadcast_axis("as_strided_scatter", info)
    return [Strategy((B,) * len(info.inputs), (B,))]


# -- in-place views -------------------------------------------------------------------


_OUT_OF_PLACE: dict[Any, Any] = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.as_strided_.default: aten.as_strided.default,
}


def _set_wrapper_meta(x: torch.Tensor, change: Callable[[torch.Tensor], Any]) -> None:
    """Run ``change`` on the wrapper ``x`` itself below dispatch, as on a meta tensor:
    it updates ``x``'s own sizes and strides and touches no data."""
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            change(x)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def _take_over(x: Any, y: Any) -> None:
    """Global ``x`` becomes ``y`` (same number of elements): piece, layout, logical shape."""
    x._local, x._meta = y._local, y._meta
    shape, strides = list(y.shape), list(y._meta.strides)  # NOTE [logical strides]
    _set_wrapper_meta(x, lambda w: aten.as_strided_.default(w, shape, strides))


@register_decomposition(*_OUT_OF_PLACE)
def inplace_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.squeeze_(d)`` and friends: the out-of-place view, taken over by ``x``."""
    x = args[0]
    if func is aten.as_strided_.default:
        _require_broadcast("as_strided_", x)
    _take_over(x, _OUT_OF_PLACE[func](*args, **kwargs))
    return x


# -- resize_ / set_ -----------------------------------------------------------------


@register_decomposition(aten.resize_.default, aten.resize_as_.default)
def resize(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    size = list(args[1].shape) if func is aten.resize_as_.default else list(args[1])
    if size == list(x.shape):
        return x
    op = str(func.overloadpacket.__name__)
    _require_broadcast(op, x)
    _require_own_storage(op, x)
    x._local = x._local.resize_(size)  # keeps the first elements in memory order, as torch
    x._meta = _global.meta_of(x._layout, tuple(size), x.dtype)
    _set_wrapper_meta(x, lambda w: aten.resize_.default(w, size))
    return x


@register_decomposition(
    aten.set_.source_Tensor,
    aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor_storage_offset,
    aten.set_.default,
)
def set_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    source = args[1] if len(args) > 1 else kwargs.get("source")
    if func is not aten.set_.source_Tensor or not isinstance(source, _global.GlobalTensor):
        raise ValueError(
            f"{func} on a global tensor: a global tensor has no storage of its own to point "
            "elsewhere (got source "
            f"{type(source).__name__ if source is not None else 'none'}). Only x.set_(source) "
            "with a global source is supported (x becomes an alias of source); otherwise "
            "assign the new tensor to the name instead."
        )
    if x.dtype != source.dtype:
        raise TypeError(f"set_ needs one dtype, got {x.dtype} and {source.dtype}.")
    x._local, x._meta = source._local, source._meta
    _set_wrapper_meta(x, lambda w: aten.set_.source_Tensor(w, source))
    return x
