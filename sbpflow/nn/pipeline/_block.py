"""``Block``: the proxy a ``Graph`` puts around each module assigned to it (OneFlow's name).

Attribute access goes through to the module, except that a submodule comes
back as its own ``Block`` (the same one every time, so its settings stick) and
``.config`` is the block's ``BlockConfig``, not the module's attribute: many
models (Hugging Face's among them) already have a ``config`` of their own,
which stays reachable as ``block.origin.config``. Calling a block calls the
module. Nothing is set on the user's module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...placement import Placement

__all__ = ["Block", "BlockConfig"]


class BlockConfig:
    """Per-module settings in a graph: the pipeline stage.

    ``set_stage(stage_id, placement)`` marks the module as stage ``stage_id``
    of the pipeline, living on ``placement``. The graph checks, before each
    step, that stage ids run 0, 1, 2, ... without a gap or a repeat and that
    the module's parameters and buffers are on ``placement``; inside a step the
    global tensors passed to the module are moved onto ``placement`` (as OneFlow
    does), so a stage may be fed the previous stage's output directly.
    """

    __slots__ = ("_placement", "_stage_id")

    def __init__(self) -> None:
        self._stage_id: int | None = None
        self._placement: Placement | None = None

    def set_stage(self, stage_id: int, placement: Placement) -> None:
        """Make the module pipeline stage ``stage_id`` (0 is the first), on ``placement``."""
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id < 0:
            raise TypeError(
                f"stage_id must be a non-negative int (0 for the first stage), got "
                f"{type(stage_id).__name__}: {stage_id!r}."
            )
        if not isinstance(placement, Placement):
            raise TypeError(
                f"placement must be an sbpflow.placement, got {type(placement).__name__}: "
                f"{placement!r}; build one with sbpflow.placement('cpu', ranks)."
            )
        self._stage_id, self._placement = stage_id, placement

    @property
    def stage_id(self) -> int | None:
        """The stage id given to ``set_stage``, or ``None``."""
        return self._stage_id

    @property
    def stage_placement(self) -> Placement | None:
        """The placement given to ``set_stage``, or ``None``."""
        return self._placement

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"sbpflow's BlockConfig has no {name!r}; it offers set_stage(stage_id, placement), "
            "stage_id and stage_placement. (OneFlow's compiler options have no counterpart in "
            "eager execution: leave them out.)"
        )

    def __repr__(self) -> str:
        if self._stage_id is None:
            return "BlockConfig()"
        return f"BlockConfig(stage_id={self._stage_id}, placement={self._placement})"


_OWN = frozenset({"_origin", "_name", "_child", "_config"})


class Block:
    """A module inside a ``Graph``: attribute access and calls go to the module.

    ``block.config`` is the block's ``BlockConfig``; ``block.origin`` (or
    ``block.to(torch.nn.Module)``) is the module itself; a submodule attribute
    comes back as a ``Block``.
    """

    _origin: torch.nn.Module
    _name: str
    _child: Callable[[torch.nn.Module, str], Block]  # the graph's Block for (module, name)
    _config: BlockConfig

    def __init__(
        self, module: torch.nn.Module, name: str, child: Callable[[torch.nn.Module, str], Block]
    ) -> None:
        object.__setattr__(self, "_origin", module)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_child", child)
        object.__setattr__(self, "_config", BlockConfig())

    @property
    def origin(self) -> torch.nn.Module:
        """The module this block stands for."""
        return self._origin

    @property
    def config(self) -> BlockConfig:
        return self._config

    def to(self, kind: type) -> Any:
        """``block.to(torch.nn.Module)`` is the module itself (OneFlow's spelling of ``origin``)."""
        if isinstance(kind, type) and issubclass(kind, torch.nn.Module):
            return self._origin
        if kind is Block:
            return self
        raise TypeError(
            f"Block.to takes torch.nn.Module (the module) or Block, got {kind!r}; to move or "
            "convert the module's tensors, call it on block.origin."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._origin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:  # not set yet (a copy being built): never look them up on the module
            raise AttributeError(name)
        value = getattr(self._origin, name)
        if isinstance(value, torch.nn.Module):
            return self._child(value, f"{self._name}.{name}")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._origin, name, value.origin if isinstance(value, Block) else value)

    def __iter__(self) -> Any:
        for i, module in enumerate(iter(self._origin)):  # type: ignore[call-overload]
            yield (
                self._child(module, f"{self._name}.{i}")
                if isinstance(module, torch.nn.Module)
                else module
            )

    def __getitem__(self, key: Any) -> Any:
        value = self._origin[key]  # type: ignore[index]
        if isinstance(value, torch.nn.Module):
            return self._child(value, f"{self._name}.{key}")
        return value

    def __len__(self) -> int:
        return len(self._origin)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        stage = self._config
        where = (
            f", stage {stage.stage_id} on {stage.stage_placement}"
            if stage.stage_id is not None
            else ""
        )
        return f"Block({self._name!r}: {type(self._origin).__name__}{where})"
