"""Nested state dicts as flat ``{"a.b.0.c": value}`` dicts, and back. Pure code.

# NOTE [checkpoint keys]
# A checkpoint stores flat keys, the path of each value joined with ".", as
# ``torch.distributed.checkpoint`` names them: ``model.fc.weight``,
# ``optim.state.0.exp_avg``, ``optim.param_groups`` (a list holding no tensor
# is stored whole). Dicts are walked by key; lists and tuples are walked by
# index when they hold a tensor or a dict (else they are one value). Objects
# with ``state_dict()`` and ``load_state_dict()`` at the top level (a module,
# an optimizer, a GradScaler) stand for their state dict: saved as
# ``obj.state_dict()``, loaded by filling that dict and handing it to
# ``obj.load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["Path", "flatten", "is_stateful", "set_at"]

Path = tuple[Any, ...]  # the keys and indices leading to a value


def is_stateful(value: object) -> bool:
    """Whether ``value`` stands for its state dict (NOTE [checkpoint keys])."""
    return (
        not isinstance(value, (Mapping, torch.Tensor))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _walks_into(value: object) -> bool:
    if isinstance(value, Mapping):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) or _walks_into(v) for v in value)
    return False


def flatten(state_dict: Mapping[Any, Any]) -> dict[str, tuple[Path, Any]]:
    """``{flat key: (path, value)}`` for every leaf of ``state_dict`` (NOTE [checkpoint keys])."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a dict, got {type(state_dict).__name__}; pass e.g. "
            '{"model": model.state_dict(), "optim": optimizer.state_dict()}.'
        )
    flat: dict[str, tuple[Path, Any]] = {}

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            items: Any = value.items()
        elif _walks_into(value):
            items = enumerate(value)
        else:
            key = ".".join(str(k) for k in path)
            if key in flat:
                raise ValueError(
                    f"two values of the state_dict have the same checkpoint key {key!r}: at "
                    f"{list(flat[key][0])} and at {list(path)} (keys are joined with '.'); "
                    "rename one of them."
                )
            flat[key] = (path, value)
            return
        for k, v in items:
            visit((*path, k), v)

    for key, value in state_dict.items():
        visit((key,), value)
    return flat


def set_at(root: MutableMapping[Any, Any], path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` in the nested ``root`` (lists in place; tuples cannot change)."""
    parent: Any = root
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if isinstance(parent, tuple):
        if parent[last] is not value and parent[last] != value:
            raise TypeError(
                f"cannot load {value!r} into the tuple at {list(path[:-1])} of the state_dict "
                "(a tuple cannot change); use a list there."
            )
        return
    parent[last] = value
