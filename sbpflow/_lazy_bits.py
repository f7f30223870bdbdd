"""Lazy conjugate and negative bits are resolved before a local kernel sees them.

# NOTE [lazy bits]
# ``x.conj()`` and ``torch._neg_view(x)`` return views whose conjugation or
# negation is only a flag, applied by the Conjugate and Negative dispatch keys.
# Those keys sit above the Python key, so inside ``__torch_dispatch__`` a flag
# on a local tensor is ignored and a kernel reads the raw data: a silently
# wrong value (hfftn of a real input conjugates internally). Global tensors
# therefore only ever hold resolved local pieces: the ``_conj``/``_neg_view``
# rules (``ops/views.py``) return resolved pieces, ``to_global`` resolves a
# local tensor it is given, and a plain tensor passed to an op together with
# global ones is resolved here on its way in. A resolved tensor is a copy, so
# a plain flagged tensor the op would write into is refused instead.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["resolve_arguments", "resolved"]


def _flagged(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and (a.is_conj() or a.is_neg())


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its conjugate and negative bits applied (``t`` itself when it has none)."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def resolve_arguments(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with every flagged plain tensor resolved (the same objects when none is).

    ATen arguments are tensors or lists of tensors, so one level of nesting is searched.
    """
    if not any(_flagged(a) or _flagged_list(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    _refuse_written(func, args, kwargs)
    new_args = tuple(_resolve_value(a) for a in args)
    new_kwargs = {k: _resolve_value(v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _flagged_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and any(_flagged(x) for x in a)


def _resolve_value(a: Any) -> Any:
    if _flagged(a):
        return resolved(a)
    if _flagged_list(a):
        return type(a)(resolved(x) if _flagged(x) else x for x in a)
    return a


def _refuse_written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    for index, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if _flagged(value) or _flagged_list(value):
            raise ValueError(
                f"{func} writes into argument {argument.name!r}, a plain tensor with a lazy "
                "conjugate/negative bit, together with global tensors; the write cannot reach "
                f"through the bit. Call {argument.name}.resolve_conj().resolve_neg() first "
                "(or make it a global tensor)."
            )
