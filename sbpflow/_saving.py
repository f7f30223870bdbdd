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
# ``torch.save`` opens (and truncates) the file before it pickles, so an error raised while
# pickling would leave a broken file where the user's previous checkpoint was. ``import
# sbpflow`` therefore wraps ``torch.save``: it first pickles the object into nothing (storages
# are referenced, not copied: the cost of pickling the Python objects once more) and calls
# torch's save only if that succeeds. Any pickling error, sbpflow's or another unpicklable
# object's, is raised before the file is touched.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _global
from ._layout import Layout
from .comm._world import get_rank
from .sbp import Broadcast, Partial, sbp_str

if TYPE_CHECKING:
    from ._global import GlobalTensor

__all__ = ["copy_global", "pickling_first", "reduce_global"]


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


def copy_global(self: GlobalTensor) -> GlobalTensor:
    """``copy.copy``: a new global tensor sharing the piece, as ``copy.copy`` of a plain tensor
    shares its storage (pickling, which ``copy`` would use, writes plain values)."""
    new = _global.wrap(self._local, self._meta, self.requires_grad)
    extra = {k: v for k, v in self.__dict__.items() if k not in ("_grad_layout_hook",)}
    new.__dict__.update(extra)
    if new.requires_grad and new.is_leaf:
        _global.keep_grad_layout(new)
    return new


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickles_or_raises(obj: Any, pickle_module: Any, protocol: int) -> None:
    """Pickle ``obj`` as ``torch.save`` does, into nothing; raise what that raises."""

    class DryRun(pickle_module.Pickler):
        def persistent_id(self, item: Any) -> Any:
            if isinstance(item, torch.storage.TypedStorage) or torch.is_storage(item):
                return "storage"  # torch.save writes storages beside the pickle
            return None

    DryRun(_Discard(), protocol=protocol).dump(obj)


def pickling_first(torch_save: Callable[..., Any]) -> Callable[..., Any]:
    """``torch_save`` made to pickle first and write nothing if that fails (``import sbpflow``
    puts it in place of ``torch.save``: NOTE [what import sbpflow adds to torch] in _install)."""
    if getattr(torch_save, "__wrapped_by_sbpflow__", False):
        return torch_save
    signature = inspect.signature(torch_save)

    @functools.wraps(torch_save)
    def save(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        _pickles_or_raises(
            arguments["obj"], arguments["pickle_module"], arguments["pickle_protocol"]
        )
        return torch_save(*args, **kwargs)

    save.__wrapped_by_sbpflow__ = True  # type: ignore[attr-defined]
    return save
