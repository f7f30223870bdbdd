"""A write into a view that no longer shares its base's data is an error, not a lost write.

# NOTE [view writes]
# A view of a global tensor aliases its base only when its rule kept the
# local pieces as views of the base's pieces. Where the rule had to re-lay the
# input out (``x[:, 1]`` of an S(1) tensor gathers it; ``diagonal`` falls back
# to broadcast), the view's piece is a copy: ``x[:, 1] = 5`` or
# ``x.diagonal().zero_()`` would change the copy and leave ``x`` as it was, a
# silently wrong value. Autograd still records such an output as a view of its
# base, so an op writing into a global view whose piece does not share storage
# with its base's piece is refused here, naming the fix. A tensor detached from
# such a view (``x[:, 1].detach()``, ``x[:, 1].data``) is no view to autograd but
# shares the view's piece, so writing into it is refused too: ``detach``,
# ``alias`` and ``p.data = view`` note the piece's storage as a copy
# (``note_alias``), and so does every tensor sharing that storage: views of the
# detached tensor, tensors detached from those. Storages are compared and noted
# by identity (their Python objects live as long as the storage), never by data
# pointer, so the check holds for fake pieces under a trace too; a compiled
# region's input rebuilt from a noted piece carries the note into the trace
# (``holds_copy`` in ``__tensor_flatten__``'s context). A rank whose pieces are
# all empty (outside the placement) has nothing to lose and does not refuse.
# (Reading such a view after writing into its base is not detected: the view
# keeps the old values.)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = [
    "holds_copy",
    "may_hold_a_copy",
    "note_alias",
    "note_copy",
    "refuse_detached_view_writes",
]

_written_positions: dict[Any, tuple[tuple[int, str], ...]] = {}
# Storages of pieces that hold a copy of another global tensor's data, noted when a tensor
# is detached from (or its .data set to) a view holding one; held weakly.
_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_alias(source: Any, piece: torch.Tensor) -> None:
    """``piece`` is the piece of a tensor that ``detach``/``alias``/``.data`` made of
    ``source``: if ``source`` holds a copy of its base's data, so does it (NOTE [view writes])."""
    if _detached_view(source):
        note_copy(piece)


def note_copy(piece: torch.Tensor) -> None:
    """Every tensor whose piece shares ``piece``'s storage holds a copy (NOTE [view writes])."""
    storage = _storage(piece)
    if storage is not None:
        _copies[storage] = True


def holds_copy(tensor: Any) -> bool:
    """Whether global ``tensor``'s piece lies in a storage noted as a copy."""
    if not _copies:
        return False
    storage = _storage(tensor._local)
    return storage is not None and storage in _copies


def _storage(piece: torch.Tensor) -> Any:
    try:
        return piece.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage (functional)
        return None


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes into (cached per op)."""
    found = _written_positions.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments if schema is not None else ())
            if a.alias_info is not None and a.alias_info.is_write
        )
        _written_positions[func] = found
    return found


def may_hold_a_copy(tensor: Any) -> bool:
    """Cheap test for the fast paths: whether writing into global ``tensor`` needs
    ``refuse_detached_view_writes``' check (a view, or detached from one whose piece is a copy)."""
    return tensor._is_view() or holds_copy(tensor)


def refuse_detached_view_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise if ``func`` writes into a global view whose piece is a copy of its base's data."""
    for position, name in _written(func):
        value = args[position] if position < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if _detached_view(tensor):
                raise ValueError(
                    f"{func} writes into {name!r}, a view of a global tensor whose layout the "
                    "view op could not keep (it re-laid its input out, e.g. x[:, i] of a tensor "
                    "split on dim 1, or a view with no SBP rule), so the view holds a copy and "
                    "the write would never reach the base. Box the base so the view keeps it "
                    "(e.g. x = x.to_global(sbp=sbpflow.sbp.broadcast) before x[:, i] = v), or "
                    "build the new tensor out of place (torch.where, index_put, scatter)."
                )


def _detached_view(tensor: Any) -> bool:
    local = getattr(tensor, "_local", None)
    if local is None or not isinstance(tensor, torch.Tensor):
        return False
    if holds_copy(tensor):
        return True
    if not tensor._is_view():
        return False
    base_local = getattr(tensor._base, "_local", None)
    if base_local is None or (local.numel() == 0 and base_local.numel() == 0):
        return False  # not a global view, or no data on this rank (NOTE [view writes])
    storage, base_storage = _storage(local), _storage(base_local)
    return storage is not None and base_storage is not None and storage is not base_storage
