"""Device moves of global tensors: ``g.to("cuda")``, ``g.cuda()``, ``g.cpu()``, ``g.to(other)``.

# NOTE [device moves]
# A global tensor's locals live on its placement's device: a cpu placement holds
# cpu locals, a cuda placement locals on this rank's ``cuda:LOCAL_RANK`` (ranks
# outside the placement hold empty tensors there too), so ``g.device`` agrees
# with ``g.placement.type`` on every rank.
# - A dtype move (``g.to(torch.bfloat16)``, ``.double()``, ``.half()``) is the
#   ``_to_copy`` pointwise rule: the layout is kept and every rank casts its
#   local tensor (a partial tensor is reduced first when the cast would round
#   or truncate each part).
# - A move to the other device type (``g.to("cuda")``, ``g.cuda()``,
#   ``g.cpu()`` of a cuda tensor) keeps the ranks and the SBP and changes the
#   placement's type: every rank copies its local tensor to its own device of
#   the new type. No collective is needed, since the same ranks keep the same
#   pieces. Autograd differentiates ``_to_copy`` itself: the gradient moves back
#   the same way.
# - A device this rank does not own (``cuda:1`` where the rank uses
#   ``cuda:0``), a device type no placement has (``meta``) and cuda on a
#   machine without CUDA are errors: the locals would disagree with the
#   placement. ``g.to`` and ``g.cuda`` check this before torch initialises CUDA,
#   so the error says what to do instead of torch's "not compiled with CUDA".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from . import _global
from ._layout import Layout
from .comm._mesh import MESHES
from .comm._world import device_for, get_local_rank, get_rank
from .placement import Placement

if TYPE_CHECKING:
    from ._global import GlobalTensor

__all__ = ["check_move", "cuda_method", "move_to_device", "own_device", "to_method"]

_PLACEMENT_TYPES = ("cpu", "cuda")


def own_device(requested: torch.device, x: GlobalTensor) -> torch.device:
    """The device this rank's local tensor of ``x`` goes to for a move to ``requested``."""
    if requested.type not in _PLACEMENT_TYPES:
        raise ValueError(
            f"cannot move a global tensor to device {str(requested)!r}: global tensors live on "
            f"{_PLACEMENT_TYPES} placements. Use g.to('cpu') or g.to('cuda'), or g.to_local() "
            "for this rank's piece as a plain tensor."
        )
    if requested.type == "cuda" and not torch.cuda.is_available():
        target = Placement("cuda", x.placement.ranks)
        raise RuntimeError(
            f"moving a global tensor to {str(requested)!r} would put it on {target}, but CUDA is "
            f"not available on this machine; keep it on {x.placement}, or run on a machine with "
            "CUDA, where g.to('cuda') and x.to_global(sbpflow.placement('cuda', ranks), sbp) "
            "both work."
        )
    own = device_for(requested.type)
    if requested.index is not None and requested != own:
        raise ValueError(
            f"cannot move a global tensor to {requested}: rank {get_rank()} (LOCAL_RANK "
            f"{get_local_rank()}) keeps the locals of {requested.type!r} placements on {own}. "
            f"Use g.to({requested.type!r}) without an index; to use another device, run one "
            "process per device (LOCAL_RANK picks it)."
        )
    return own


def move_to_device(func: Any, x: GlobalTensor, kwargs: dict[str, Any]) -> GlobalTensor:
    """``_to_copy(x, device=..., ...)`` (NOTE [device moves]): the same ranks and SBP on
    the requested device type, each rank's local tensor copied to its own device."""
    target = own_device(torch.device(kwargs["device"]), x)
    if target.type == x.placement.type:
        # The same device: the copy (and cast) the ``_to_copy`` rule makes.
        return func(x, **{k: v for k, v in kwargs.items() if k != "device"})
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != x.dtype:
        x = func(x, dtype=dtype)  # the cast first, through the ``_to_copy`` rule (partials)
    local = func(x._local, **{**kwargs, "device": target, "dtype": None})
    placement = Placement(target.type, x.placement.ranks)
    MESHES.of(placement, "a device move")  # its groups, made on every rank (NOTE [meshes])
    return _global.GlobalTensor(local, Layout(placement, x._layout.sbp), x.shape)


def check_move(x: GlobalTensor, device: torch.device | None) -> None:
    """Raise the error a move of ``x`` to ``device`` would meet, before torch touches CUDA."""
    if device is not None:
        own_device(device, x)


_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda


def to_method(self: GlobalTensor, *args: Any, **kwargs: Any) -> Any:
    """As ``torch.Tensor.to``; a device move keeps the ranks and SBP (NOTE [device moves])."""
    check_move(self, _requested_device(args, kwargs))
    return _TENSOR_TO(self, *args, **kwargs)


def _requested_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a ``Tensor.to`` call names (its first argument, ``device=`` or ``other=``);
    anything else (an int index) is left to torch's parser, and to dispatch to check."""
    for a in (*args[:1], kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
    return None


def cuda_method(
    self: GlobalTensor,
    device: Any = None,
    non_blocking: bool = False,
    memory_format: torch.memory_format = torch.preserve_format,
) -> GlobalTensor:
    """As ``torch.Tensor.cuda``; the locals go to this rank's own cuda device."""
    if device is None:
        requested = torch.device("cuda")
    elif isinstance(device, int):
        requested = torch.device("cuda", device)
    else:
        requested = torch.device(device)
    own = own_device(requested, self)
    return cast("GlobalTensor", _TENSOR_CUDA(self, own, non_blocking, memory_format=memory_format))
