"""A write into a view that no longer shares its base's data is an error, not a lost write.

# NOTE [view writes]
# A view of a global tensor aliases its base only when its rule kept the
# local pieces as views of the base's pieces. Where the rule had to re-lay the
# input out (``x[:, 1]`` of an S(1) tensor gathers it; ``diagonal`` falls back
# to broadcast), the view's piece is a copy: ``x[:, 1] = 5`` or
# ``x.diagonal().zero_()`` would change the copy and leave ``x`` as it was, a
# silently wrong value. Autograd still records such an output as a view of its
# base, so an op writing into a global view whose piece does not share storage
# with its base's piece is refused here, naming the fix. (Reading such a view
# after writing into its base is not detected: the view keeps the old values.)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["refuse_detached_view_writes"]

_written_positions: dict[Any, tuple[tuple[int, str], ...]] = {}


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
    if local is None or not isinstance(tensor, torch.Tensor) or not tensor._is_view():
        return False
    base_local = getattr(tensor._base, "_local", None)
    if base_local is None:
        return False
    return local.untyped_storage().data_ptr() != base_local.untyped_storage().data_ptr()
