"""Stages held by other ranks: their calls return stand-ins, their ops never reach this rank.

# NOTE [stages held elsewhere]
# Every rank runs the same ``build``, but a rank computes only the stages it
# holds. While a pipelined step runs, calling a stage held by other ranks runs
# none of its ops here: it returns stand-ins, global tensors with the layout,
# logical shape and dtype the stage's outputs have, and empty pieces, exactly
# what running the stage here would have produced. The hand-off to the next
# stage then moves real data between the ranks that hold the two stages, and a
# rank's host work per micro-batch depends on its own stages only.
#
# What a stage returns is learnt from the stage itself: the first call with
# inputs of a given kind (the inputs' layouts, shapes, dtypes and whether they
# need gradients; the other arguments' values; grad mode, autocast, the
# modules' training flags and the stage's parameter layouts) runs the stage
# here as before, every op skipped on its empty pieces, and records its
# outputs. Every rank makes that first call at the same point of the same
# program, so the process groups the stage needs are still created by all
# ranks together (NOTE [group creation order] in sbpflow/comm/_groups.py). The
# later calls of that kind return stand-ins. As torch.distributed.pipelining,
# this assumes a stage's output metadata depends on its inputs' metadata, not
# on their values (the dispatcher assumes the same for every op a rank sits out).
#
# A stage keeps running here, never replaced, when the recorded call shows this
# rank is needed after all: it took part in a communication, or an output or an
# input lives on a placement holding this rank, or an output is not a global
# tensor or a plain constant, or an input is a plain tensor that needs a
# gradient, or an argument is not a value a key can hold.
#
# The rest follows the program exactly:
#   - randomness: the recorded call counts the random positions the stage
#     draws, and a stand-in advances the random state by as many (NOTE [logical
#     random state] in sbpflow/_rng.py), so the ranks' later draws stay in step;
#   - gradients: the stand-ins' backward gives each input that the stage's
#     outputs depend on (seen in the recorded call's autograd graph) an empty
#     gradient in the input's own layout, which is the layout the hand-off
#     moves gradients in (NOTE [gradients cross in the layout their tensor
#     crossed in] in sbpflow/boxing/_redistribute.py); an input the outputs do
#     not depend on gets none, as it would from the stage.
# The parameters of a stage held elsewhere get no gradient here (``None``), as
# they are not this rank's to update.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .... import _rng, _step_context
from ...._global import GlobalTensor, empty_piece, meta_of
from ....comm._errors import communications_entered
from ._stages import Stage

__all__ = ["CONSTANTS", "HeldElsewhere", "call_key", "flatten_call", "unflatten_call"]

# Argument values a key may hold (compared by value).
CONSTANTS = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)


@dataclass(frozen=True)
class _Outputs:
    """What a stage held elsewhere returned, for inputs of one kind."""

    spec: Any  # the outputs' tree structure
    leaves: tuple[Any, ...]  # per leaf: (Meta, requires_grad) of a global tensor, or a constant
    is_tensor: tuple[bool, ...]
    draws: int  # random positions the stage drew
    reached: tuple[bool, ...]  # per input needing a gradient: whether the outputs depend on it


_UNSEEN = object()


class HeldElsewhere:
    """The stand-ins of a graph's stages that this rank does not hold (NOTE [stages held elsewhere]).

    Kept by the graph across steps; ``installed`` puts the stand-ins in place
    for one step.
    """

    def __init__(self) -> None:
        self._outputs: dict[Any, _Outputs | None] = {}  # call key -> outputs, None: runs here
        self._anchor = torch.empty(0, requires_grad=True)  # makes stand-ins require grad

    @property
    def anchor(self) -> torch.Tensor:
        """The leaf every stand-in hangs from, so that it requires grad; it never gets one."""
        return self._anchor

    @contextlib.contextmanager
    def installed(self, stages: Sequence[Stage], rank: int) -> Iterator[None]:
        """While the block runs, each stage not held by ``rank`` answers calls with stand-ins."""
        replaced = []
        try:
            for stage in stages:
                if rank in stage.placement:
                    continue
                module = stage.module
                own = module.__dict__.get("forward")
                forward = own if own is not None else type(module).forward.__get__(module)
                module.__dict__["forward"] = self._stand_in_forward(stage, forward, rank)
                replaced.append((module, own))
            yield
        finally:
            for module, own in replaced:
                if own is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = own

    def _stand_in_forward(
        self, stage: Stage, forward: Callable[..., Any], rank: int
    ) -> Callable[..., Any]:
        module = stage.module
        state = (
            stage.stage_id,
            tuple((n, _tensor_key(t)) for n, t in module.named_parameters()),
            tuple((n, _tensor_key(t)) for n, t in module.named_buffers()),
            tuple(m.training for m in module.modules()),
        )

        def call(*args: Any, **kwargs: Any) -> Any:
            flat, spec = flatten_call(args, kwargs)
            key = call_key(state, flat, spec, rank)
            found = self._outputs.get(key, _UNSEEN) if key is not None else None
            if found is _UNSEEN:
                out, found = _record(forward, args, kwargs, flat, rank)
                self._outputs[key] = found
                return out
            if found is None:
                return forward(*args, **kwargs)
            assert isinstance(found, _Outputs)
            return self._stand_ins(found, flat)

        return call

    def _stand_ins(self, outputs: _Outputs, flat_inputs: list[Any]) -> Any:
        if outputs.draws:
            _rng.take(outputs.draws)  # NOTE [logical random state]: as the stage would
        needing = [x for x in flat_inputs if isinstance(x, GlobalTensor) and x.requires_grad]
        made = iter(
            _StandIns.apply(outputs, self._anchor, *needing) if any(outputs.is_tensor) else ()
        )
        leaves = [
            next(made) if is_tensor else leaf
            for leaf, is_tensor in zip(outputs.leaves, outputs.is_tensor, strict=True)
        ]
        return tree_unflatten(leaves, outputs.spec)


class _StandIns(torch.autograd.Function):
    """Empty global tensors for a stage's outputs; backward: empty gradients for its inputs."""

    @staticmethod
    def forward(ctx: Any, outputs: _Outputs, anchor: torch.Tensor, *inputs: GlobalTensor) -> Any:
        ctx.inputs = [(x._meta.layout, tuple(x.shape), x.dtype) for x in inputs]
        ctx.reached = outputs.reached
        made, frozen = [], []
        for leaf, is_tensor in zip(outputs.leaves, outputs.is_tensor, strict=True):
            if not is_tensor:
                continue
            meta, requires_grad = leaf
            made.append(empty_piece(meta))
            if not requires_grad:
                frozen.append(made[-1])
        ctx.mark_non_differentiable(*frozen)
        return tuple(made)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        scope = _step_context.current.get()
        if scope is not None:
            scope.check_backward_allowed()  # type: ignore[attr-defined]
        empties = [
            empty_piece(meta_of(*found)) if reached else None
            for found, reached in zip(ctx.inputs, ctx.reached, strict=True)
        ]
        return (None, None, *empties)


def _tensor_key(t: torch.Tensor) -> Any:
    if isinstance(t, GlobalTensor):
        return (t._meta, t.requires_grad)
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


# Types a call's argument can be that pytree never opens (exact types: a subclass may be a
# registered node, a namedtuple say).
_LEAF_TYPES = frozenset({GlobalTensor, torch.Tensor, torch.nn.Parameter, *CONSTANTS} - {enum.Enum})
_positional_specs: dict[int, Any] = {}


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``; a stage called with tensors and constants only (the
    usual hand-off) skips pytree's walk, with the spec it would have made."""
    if kwargs or any(type(a) not in _LEAF_TYPES for a in args):
        return tree_flatten((args, kwargs))
    spec = _positional_specs.get(len(args))
    if spec is None:
        spec = _positional_specs[len(args)] = tree_flatten((tuple(range(len(args))), {}))[1]
    return list(args), spec


def unflatten_call(flat: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what ``flatten_call`` gave (with other leaves in place)."""
    if _positional_specs.get(len(flat)) is spec:
        return tuple(flat), {}
    return tree_unflatten(flat, spec)


def call_key(state: Any, flat: list[Any], spec: Any, rank: int, held: bool = False) -> Any:
    """What a stage's outputs may depend on, hashable; ``None`` if this call cannot be replaced.

    ``held``: the stage is this rank's (its global inputs may be on placements holding it).
    """
    leaves: list[Any] = []
    for x in flat:
        if isinstance(x, GlobalTensor):
            if not held and rank in x._meta.layout.placement:
                return None
            leaves.append((x._meta, x.requires_grad))
        elif isinstance(x, torch.Tensor):
            if x.requires_grad:
                return None
            leaves.append((tuple(x.shape), x.dtype, x.device))
        elif isinstance(x, CONSTANTS):
            leaves.append((type(x), x))
        else:
            return None
    autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    key = (state, spec, tuple(leaves), torch.is_grad_enabled(), autocast)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def run_watched(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, bool, int]:
    """``forward(*args, **kwargs)``, whether it entered a communication, and how many random
    draws it made: what decides whether a stage's first run can stand for the next ones."""
    entered, (_, start) = communications_entered(), _rng.position()
    out = forward(*args, **kwargs)
    return out, communications_entered() != entered, _rng.position()[1] - start


def _record(
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    flat_inputs: list[Any],
    rank: int,
) -> tuple[Any, _Outputs | None]:
    """Run the stage here (its ops skipped on empty pieces) and note what it returned."""
    out, communicated, draws = run_watched(forward, args, kwargs)
    if communicated:
        return out, None  # this rank takes part in the stage: it runs here every time
    flat, spec = tree_flatten(out)
    leaves: list[Any] = []
    is_tensor: list[bool] = []
    for leaf in flat:
        if isinstance(leaf, GlobalTensor):
            if rank in leaf._meta.layout.placement:
                return out, None
            leaves.append((leaf._meta, leaf.requires_grad))
            is_tensor.append(True)
        elif isinstance(leaf, CONSTANTS) and not isinstance(leaf, torch.Tensor):
            leaves.append(leaf)
            is_tensor.append(False)
        else:
            return out, None
    needing = [x for x in flat_inputs if isinstance(x, GlobalTensor) and x.requires_grad]
    reached = _reached(
        [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad], needing
    )
    return out, _Outputs(spec, tuple(leaves), tuple(is_tensor), draws, reached)


def _reached(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """For each input, whether a gradient flows from ``outputs`` into it (a walk of the graph)."""
    targets: dict[Any, int] = {}  # (node, output number) of each input -> its index
    leaves: dict[int, int] = {}  # id(leaf) -> its index
    for i, x in enumerate(inputs):
        if x.grad_fn is not None:
            targets[(x.grad_fn, x.output_nr)] = i
        else:
            leaves[id(x)] = i
    found = [False] * len(inputs)
    for x in outputs:  # an output that is an input
        if x.grad_fn is not None and (x.grad_fn, x.output_nr) in targets:
            found[targets[(x.grad_fn, x.output_nr)]] = True
        elif x.grad_fn is None and id(x) in leaves:
            found[leaves[id(x)]] = True
    stops = {node for node, _ in targets}
    todo = [x.grad_fn for x in outputs if x.grad_fn is not None and x.grad_fn not in stops]
    seen = set(todo)
    while todo:
        node = todo.pop()
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            hit = targets.get((nxt, nr))
            if hit is not None:
                found[hit] = True
            variable = getattr(nxt, "variable", None)
            if variable is not None and id(variable) in leaves:
                found[leaves[id(variable)]] = True
            if nxt not in seen and nxt not in stops:
                seen.add(nxt)
                todo.append(nxt)
    return tuple(found)
