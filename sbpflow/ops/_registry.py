"""SBP rules: the table the dispatch path consults, and the types rules speak.

# NOTE [rules]
# A rule describes one op family on ONE mesh axis: given the op's inputs
# (logical shapes, dtypes, arguments) it lists candidate ``Strategy``s, each
# an SBP per global input and per tensor output. The dispatcher expands them
# to N-D (one candidate per axis, all combinations), picks the combination
# whose input boxing is cheapest (ties: earlier candidates win), boxes the
# inputs, runs the op on local tensors and wraps the outputs.
#
# Rules whose local computation differs from the op itself (a mean over a
# split dim, a view whose size argument must be the local size, ...) also
# register a ``local`` function that receives the local arguments and a
# ``LocalContext`` describing the chosen layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .._layout import Layout
from ..sbp import SbpParallel

__all__ = ["Strategy", "OpInfo", "LocalContext", "Rule", "register", "lookup", "registered_ops"]


@dataclass(frozen=True)
class Strategy:
    """One candidate for one mesh axis: an SBP per global input and per tensor output."""

    inputs: tuple[SbpParallel, ...]
    outputs: tuple[SbpParallel, ...]


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class OpInfo:
    """What a rule sees: the op, its arguments, and metadata of inputs and outputs.

    ``args``/``kwargs`` hold global inputs as ``TensorMeta`` (logical) and
    everything else as passed. ``inputs`` lists the global inputs' metadata in
    the order they appear (flattened); ``outputs`` the tensor outputs' logical
    metadata; ``mesh_axis_size`` the size of the axis being decided.
    """

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    mesh_axis_size: int


@dataclass
class LocalContext:
    """What a ``local`` function knows: the chosen layouts and this rank."""

    rank: int
    input_layouts: list[Layout]
    output_layouts: list[Layout]
    input_metas: list[TensorMeta]
    output_metas: list[TensorMeta]

    def local_output_shape(self, index: int = 0) -> tuple[int, ...]:
        return self.output_layouts[index].local_shape(self.output_metas[index].shape, self.rank)


Rule = Callable[[OpInfo], Sequence[Strategy]]
LocalFn = Callable[..., Any]  # (func, local_args, local_kwargs, ctx) -> local outputs


@dataclass(frozen=True)
class Registered:
    rule: Rule
    local: LocalFn | None
    family: str


_rules: dict[Any, Registered] = {}


def register(*ops: Any, family: str, local: LocalFn | None = None) -> Callable[[Rule], Rule]:
    """Register ``rule`` for ATen overloads or overload packets (``aten.add`` covers all)."""

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            _rules[op] = Registered(rule, local, family)
        return rule

    return decorate


def lookup(func: Any) -> Registered | None:
    found = _rules.get(func)
    if found is None:
        found = _rules.get(getattr(func, "overloadpacket", None))
    return found


def registered_ops() -> dict[str, list[str]]:
    """Op names by family (for the docs' list of covered ops)."""
    out: dict[str, list[str]] = {}
    for op, reg in _rules.items():
        out.setdefault(reg.family, []).append(str(op))
    return {k: sorted(v) for k, v in sorted(out.items())}
