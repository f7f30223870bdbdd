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
#
# Decisions are cached per op, input layouts/shapes/dtypes and arguments.
# A float argument (a learning rate, Adam's step size: new every step) reaches
# the rule as a ``FloatArg``, which behaves as the float and records that the
# rule read it. A decision whose rule read no float argument is cached for any
# float values; one whose rule read a float (compared it, did arithmetic with
# it, converted it) is cached under the exact float values, so another value
# asks the rule again. Rules need not declare anything. Floats inside lists
# (``float[]`` arguments such as scale factors) are always keyed exactly.
# ``local`` functions see the actual values.
#
# A few ops are not one local computation in any layout (foreach ops over
# lists of differently laid-out tensors, the AMP inf check whose flag must
# agree on every rank): they register a *decomposition* instead, a function
# of the global arguments that calls other ops (which dispatch again) or
# boxes explicitly. Packet registrations (``aten.add``) never cover ``out=``
# overloads: their written ``out`` argument is an extra input no rule expects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._layout import Layout
from ..sbp import Broadcast, Partial, SbpParallel, Split

__all__ = [
    "FloatArg",
    "LocalContext",
    "OpInfo",
    "Rule",
    "Strategy",
    "TensorMeta",
    "bind",
    "every_sbp",
    "lookup",
    "lookup_decomposition",
    "register",
    "register_decomposition",
    "registered_ops",
]


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


class FloatArg:
    """A float argument as a rule sees it: behaves as the float, and records being read.

    Comparing, converting (``float(x)``, ``math.isinf(x)``), formatting or
    computing with it sets ``read``; then the dispatcher caches the rule's
    decision under the exact value (NOTE [rules]). ``isinstance(x, float)`` is
    True, and does not count as a read: it tells no value apart. An operation
    not defined here raises ``TypeError`` rather than treating it as a float.
    """

    __slots__ = ("_value", "read")

    def __init__(self, value: float) -> None:
        self._value = value
        self.read = False

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(x, float) holds, as for the float itself
        return float

    def value(self) -> float:
        """The float, marking it read."""
        self.read = True
        return self._value


def _reading(name: str) -> Any:
    def method(self: FloatArg, *args: Any) -> Any:
        args = tuple(a.value() if type(a) is FloatArg else a for a in args)
        return getattr(self.value(), name)(*args)

    method.__name__ = name
    return method


for _name in (
    "__float__", "__int__", "__bool__", "__hash__", "__repr__", "__str__", "__format__",
    "__round__", "__trunc__", "__floor__", "__ceil__", "__neg__", "__pos__", "__abs__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__rpow__", "__divmod__", "__rdivmod__", "is_integer", "as_integer_ratio", "hex",
):  # fmt: skip
    setattr(FloatArg, _name, _reading(_name))


@dataclass
class OpInfo:
    """What a rule sees: the op, its arguments, and metadata of inputs and outputs.

    ``args``/``kwargs`` hold global inputs as ``TensorMeta`` (logical) and
    everything else as passed. ``inputs`` lists the global inputs' metadata in
    the order they appear (flattened); ``outputs`` the tensor outputs' logical
    metadata; ``mesh_axis_size`` the size of the axis being decided;
    ``current`` each global input's SBP on that axis now (for ops that never
    read their input's values and so accept it as it is, like ``ones_like``).
    """

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    mesh_axis_size: int
    current: list[SbpParallel] = field(default_factory=list)

    def input_at(self, position: int) -> int | None:
        """Index in ``inputs`` of the global tensor passed as positional arg ``position``.

        ``None`` when that argument is not a global tensor (a number, a plain
        0-dim tensor, ``None``), which is what decides e.g. whether ``x + 2``
        may keep a partial ``x`` (it may not: every rank would add 2).
        """
        if position >= len(self.args):
            return None
        value = self.args[position]
        for k, meta in enumerate(self.inputs):
            if value is meta:
                return k
        return None

    def arg(self, position: int, name: str, default: Any = None) -> Any:
        """Argument ``name`` whether passed positionally (at ``position``) or by keyword."""
        if position < len(self.args):
            return self.args[position]
        return self.kwargs.get(name, default)

    def bound(self) -> dict[str, Any]:
        """Every schema argument by name (defaults filled in); see ``bind``."""
        return bind(self.func, self.args, self.kwargs)


def bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, with defaults for those not passed."""
    out: dict[str, Any] = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            out[argument.name] = args[i]
        elif argument.name in kwargs:
            out[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            out[argument.name] = argument.default_value
    return out


@dataclass
class LocalContext:
    """What a ``local`` function knows: the chosen layouts and this rank."""

    rank: int
    input_layouts: list[Layout]
    output_layouts: list[Layout]
    input_metas: list[TensorMeta]
    output_metas: list[TensorMeta]
    global_args: frozenset[int] = frozenset()  # positional args that are (or hold) globals

    def local_output_shape(self, index: int = 0) -> tuple[int, ...]:
        return self.output_layouts[index].local_shape(self.output_metas[index].shape, self.rank)

    def holds_constants(self, index: int = 0) -> bool:
        """Whether this rank's piece of output ``index`` carries constant terms.

        On a partial-sum axis only the group's first rank may add a constant
        (``P + 2``: that rank adds 2, the others 0), or the ranks would sum to
        it once per rank.
        """
        layout = self.output_layouts[index]
        axes = [
            a for a, s in enumerate(layout.sbp) if isinstance(s, Partial) and s.reduce_op == "sum"
        ]
        if not axes:  # no partial-sum axis (an optimizer's ``add_(eps)`` on B): every rank
            return True
        coords = layout.placement.coords_of(self.rank)
        return all(coords[a] == 0 for a in axes)


Rule = Callable[[OpInfo], Sequence[Strategy]]
LocalFn = Callable[..., Any]  # (func, local_args, local_kwargs, ctx) -> local outputs


@dataclass(frozen=True)
class Registered:
    rule: Rule
    local: LocalFn | None
    family: str


_rules: dict[Any, Registered] = {}
Decomposition = Callable[[Any, tuple, dict], Any]  # (func, args, kwargs) -> result
_decompositions: dict[Any, Decomposition] = {}


_on_change: list[Callable[[], None]] = []


def on_change(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever a rule or decomposition is (re-)registered.

    The dispatcher caches what it decided per op (NOTE [fast path]); a rule
    registered after an op was first seen must replace those decisions.
    """
    _on_change.append(forget)


def _changed() -> None:
    for forget in _on_change:
        forget()


def register(*ops: Any, family: str, local: LocalFn | None = None) -> Callable[[Rule], Rule]:
    """Register ``rule`` for ATen overloads or overload packets (``aten.add`` covers all)."""

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            _rules[op] = Registered(rule, local, family)
        _changed()
        return rule

    return decorate


def register_decomposition(*ops: Any) -> Callable[[Decomposition], Decomposition]:
    """Register ``fn(func, args, kwargs)`` computing the op on global arguments directly."""

    def decorate(fn: Decomposition) -> Decomposition:
        for op in ops:
            _decompositions[op] = fn
        _changed()
        return fn

    return decorate


def _packet_applies(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is None or not any(a.is_out for a in schema.arguments)


def lookup(func: Any) -> Registered | None:
    found = _rules.get(func)
    if found is None and _packet_applies(func):
        found = _rules.get(getattr(func, "overloadpacket", None))
    return found


def lookup_decomposition(func: Any) -> Decomposition | None:
    found = _decompositions.get(func)
    if found is None and _packet_applies(func):
        found = _decompositions.get(getattr(func, "overloadpacket", None))
    return found


def registered_ops() -> dict[str, list[str]]:
    """Op names by family (for the docs' list of covered ops)."""
    out: dict[str, list[str]] = {}
    for op, reg in _rules.items():
        out.setdefault(reg.family, []).append(str(op))
    for op in _decompositions:
        out.setdefault("decompositions", []).append(str(op))
    return {k: sorted(v) for k, v in sorted(out.items())}


def every_sbp(ndim: int) -> list[SbpParallel]:
    """Every one-axis SBP a tensor of ``ndim`` dims can have (for rules that accept any)."""
    return [Broadcast(), Partial("sum"), Partial("max")] + [Split(d) for d in range(ndim)]
