"""``torch.save`` and pickling of global tensors.

# NOTE [torch.save of global tensors]
# ``torch.save`` writes what one process holds into one file, with no collective, and
# usually only rank 0 calls it (the DDP habit ``if rank == 0: torch.save(model.state_dict(),
# path)``). What a rank can write is decided per tensor, from its layout alone:
# - A global tensor whose pieces are each the whole value (every placement axis broadcast
#   or of one rank), on a rank of its placement, pickles as that value: a plain tensor
#   (an ``nn.Parameter`` if it is one, ``requires_grad`` kept). The file is what plain torch
#   would write: default ``torch.load`` (``weights_only=True``) reads it in any process, and
#   ``model.load_state_dict(torch.load(path))`` on every rank fills a global model of any
#   layout on any ranks (copying a plain tensor into a global one takes it as the whole
#   value, and each rank keeps its piece).
# - Any other global tensor (split, partial, or on a rank outside its placement) is only a
#   piece here. Written as a plain tensor, rank 1's shard would load as if it were the whole
#   weight: a silent wrong value. Written with its layout, the file would load only where
#   sbpflow runs on the same ranks, and a file from one rank would still miss the others'
#   pieces. So pickling it raises, naming what does save it: ``sbpflow.save`` (every rank,
#   sharded, loads into any layout), ``sbpflow.export_safetensors`` (whole tensors in one
#   file) and ``x.to_local()`` (this rank's piece, said explicitly).
# This is the tensor's own pickling protocol (``__reduce_ex__``); ``torch.save`` stays
# torch's function. It opens (and truncates) the file before it pickles, so a refusal
# raised while pickling leaves at the path what torch's writer closes with: an archive
# without ``data.pkl``, which ``torch.load`` refuses ("failed locating file data.pkl"),
# never a piece that loads as the whole. The previous file at that path is gone, as with
# any object ``torch.save`` cannot pickle. ``sbpflow.save`` writes beside the previous
# checkpoint and swaps it in (NOTE [atomic checkpoints]); for ``torch.save``, writing to a
# temporary name and ``os.replace`` keeps the previous file (docs/checkpoints.md).
#
# NOTE [copies of global tensors]
# ``copy.copy`` and ``copy.deepcopy`` give global tensors (pickling, which ``copy`` would
# otherwise use, writes plain values). As for a plain ``nn.Parameter``, the copy keeps the
# attributes in its ``__dict__`` but not the gradient hooks: a leaf that requires grad gets
# hooks of its own (``keep_grad_layout``). What belongs to the original alone is not
# copied: the dict of its gradient hooks (a ``_NotCopied`` value) and the object its
# gradients were handed over to (the data-parallel buckets that reduce them, found by
# the original's identity, NOTE [gradient owners] in _global). The buckets keep their
# state on their own objects, not on the tensor; a copy's gradient is found by the
# gradient discovery as any new leaf's is.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from . import _global
from ._layout import Layout
from .comm._world import get_rank
from .sbp import Broadcast, Partial, sbp_str

if TYPE_CHECKING:
    from ._global import GlobalTensor

__all__ = ["copy_global", "deepcopy_global", "reduce_global"]


def _holds_whole_value(layout: Layout, rank: int) -> bool:
    return rank in layout.placement and all(
        isinstance(s, Broadcast) for s in layout.normalized().sbp
    )


def reduce_global(self: GlobalTensor, protocol: int) -> Any:
    """``GlobalTensor.__reduce_ex__``: the whole value as a plain tensor, or an error
    (NOTE [torch.save of global tensors])."""
    layout, rank = self._layout, get_rank()
    if not _holds_whole_value(layout, rank):
        raise TypeError(_refusal(self, layout, rank))
    plain = self._local.detach()
    if getattr(self, "_is_param", False):
        plain = torch.nn.Parameter(plain, requires_grad=self.requires_grad)
    elif self.requires_grad:
        plain.requires_grad_()
    return plain.__reduce_ex__(protocol)


def _refusal(x: GlobalTensor, layout: Layout, rank: int) -> str:
    if rank not in layout.placement:
        held = f"rank {rank} is outside its placement and holds none of it"
    elif any(isinstance(s, Partial) for s in layout.sbp):
        held = f"rank {rank} holds only its part of a partial {sbp_str(layout.sbp)} value"
    else:
        held = f"rank {rank} holds only its piece"
    return (
        f"torch.save (pickling) cannot write a global tensor of shape {list(x.shape)} laid out "
        f"{sbp_str(layout.sbp)} on {layout.placement} from one rank: {held}. Save it with "
        "sbpflow.save(state_dict, path) on every rank (a sharded checkpoint that loads into any "
        "layout and world size), or sbpflow.export_safetensors(state_dict, path) on every rank "
        "(one file of whole tensors, written by rank 0), or save x.to_local() to keep this "
        "rank's piece as a plain tensor. A tensor broadcast on every placement axis is saved "
        "as its whole value."
    )


_WRAPPED = frozenset({"_local", "_meta"})  # set by ``wrap``


def _copied_state(self: GlobalTensor) -> dict[str, Any]:
    """The ``__dict__`` entries a copy takes over (NOTE [copies of global tensors])."""
    return {
        k: v
        for k, v in self.__dict__.items()
        if k not in _WRAPPED and not isinstance(v, _global._NotCopied)
    }


def copy_global(self: GlobalTensor) -> GlobalTensor:
    """``copy.copy``: a new global tensor sharing the piece, as ``copy.copy`` of a plain tensor
    shares its storage, with gradient hooks of its own (NOTE [copies of global tensors])."""
    new = _global.wrap(self._local, self._meta, self.requires_grad)
    new.__dict__.update(_copied_state(self))
    if new.requires_grad:
        _global.keep_grad_layout(new)
    return new


def deepcopy_global(self: GlobalTensor, memo: dict[int, Any]) -> GlobalTensor:
    """``copy.deepcopy``: a new global tensor with a copy of the piece and of its gradient,
    with gradient hooks of its own (NOTE [copies of global tensors])."""
    if id(self) in memo:
        return memo[id(self)]
    if not self.is_leaf:
        raise RuntimeError(
            "copy.deepcopy of a global tensor that is not a leaf of autograd (it has a "
            f"grad_fn, {type(self.grad_fn).__name__}); as for plain tensors, only leaves can "
            "be deep-copied: copy x.detach(), or the leaf it was computed from."
        )
    with torch.no_grad():
        new = _global.wrap(copy.deepcopy(self._local, memo), self._meta, self.requires_grad)
    memo[id(self)] = new
    new.__dict__.update(copy.deepcopy(_copied_state(self), memo))
    if self.grad is not None:
        new.grad = copy.deepcopy(self.grad, memo)
    if new.requires_grad:
        _global.keep_grad_layout(new)
    return new
