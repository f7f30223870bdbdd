"""Stages this rank holds whose pieces are the whole tensors: run on the pieces, as plain torch.

# NOTE [stages run on their pieces]
# A stage on a placement of one rank, or whose every tensor is broadcast, computes on each
# of its ranks exactly what plain torch computes on the local pieces: every piece is the
# whole logical tensor, and each op's rule would only run the op locally and say "broadcast".
# Going through the dispatcher anyway costs a decision per op, in forward and in backward
# (about a fifth of the compute of a 4 x Linear(1024, 1024) stage on micro-batches of 32
# rows). So inside a pipelined step such a stage runs its module on the pieces: the inputs'
# and parameters' pieces enter through an autograd Function whose backward wraps the
# gradient in the tensor's own layout (the parameters' gradients accumulate in ``.grad`` as
# before, through their hooks), the module runs with its parameters swapped for those
# pieces, and the outputs are wrapped in the layouts the stage gives them.
#
# Whether a stage qualifies is learnt from the stage itself, as for the stand-ins (NOTE
# [stages held elsewhere]): the first call with inputs of a kind runs through the dispatcher
# and is recorded; the later calls of that kind run on the pieces if that call took part in
# no communication, drew no random numbers (a random op must draw from the program's
# logical state, NOTE [logical random state] in sbpflow/_rng.py), and every global tensor
# it read, held or returned has the whole logical tensor as its piece on this rank. A stage
# compiled with ``enable_compile`` runs its compiled forward instead.
#
# NOTE [parameter pieces are leaves]
# A parameter's piece enters the stage as a leaf of its own (a detached view of the
# parameter's storage), not through ``_ToPiece``: the autograd engine runs a leaf's
# AccumulateGrad as soon as its gradient is ready, but runs ready nodes in order of creation,
# latest first, so the ``_ToPiece`` nodes of a stage's parameters (made before any of the
# stage's ops) ran only after the whole stage's backward. Every weight gradient of the stage
# was then alive at once (16 MB for 4 x Linear(1024, 1024)), freed together at the end, and
# the C allocator handed that memory back to the system and faulted it in again on the next
# micro-batch: a fifth more CPU time per backward than plain torch. A hook after the leaf's
# accumulation moves its gradient into the parameter's ``.grad`` as AccumulateGrad would
# (the first one taken as it is, the later ones added in place, out of place under
# ``create_graph``), on the pieces, with no dispatch, so each gradient is in ``.grad`` as
# soon as it is computed, as in plain torch. One leaf per parameter, with its hook, serves
# every micro-batch of a step (``StepLeaves``): making a leaf and registering a hook per
# parameter and micro-batch cost more than the hook itself. A parameter with other
# gradient hooks than ``keep_grad_layout``'s (a user's, a ``GradientSync``'s) keeps
# ``_ToPiece`` and runs them. The leaf is noted on each micro-batch that used it, so a
# ``backward(inputs=...)`` naming a parameter also names its leaf (``run_backward``), as
# does the input half of a split backward for a parameter that crossed a placement (a tied
# weight: NOTE [split backward]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .... import _step_context
from ...._global import GlobalTensor, has_only_layout_hooks, meta_of, wrap
from ...._layout import Layout
from ....boxing._redistribute import box_below_autograd
from ....sbp import Broadcast
from ._held_elsewhere import CONSTANTS, call_key, flatten_call, run_watched, unflatten_call
from ._scope import Scope
from ._stages import Stage

__all__ = ["HeldHere"]


@dataclass(frozen=True)
class _Outputs:
    """The layouts a stage gives its outputs (``None`` for a constant leaf)."""

    layouts: tuple[Layout | None, ...]


_UNSEEN = object()


class HeldHere:
    """This rank's stages that run on their pieces (NOTE [stages run on their pieces]).

    Kept by the graph across steps; ``installed`` puts the local forwards in place for
    one step.
    """

    def __init__(self) -> None:
        self._outputs: dict[Any, _Outputs | None] = {}  # call key -> outputs, None: dispatcher

    @contextlib.contextmanager
    def installed(self, stages: Sequence[Stage], rank: int) -> Iterator[None]:
        """While the step runs, this rank's stages run on their pieces."""
        replaced = []
        leaves = StepLeaves()  # for this step only
        try:
            for stage in stages:
                module = stage.module
                if rank not in stage.placement or "forward" in module.__dict__:
                    continue  # held elsewhere, or compiled
                forward = type(module).forward.__get__(module)
                module.__dict__["forward"] = self._local_forward(stage, forward, rank, leaves)
                replaced.append(module)
            yield
        finally:
            for module in replaced:
                del module.__dict__["forward"]

    def _local_forward(
        self, stage: Stage, forward: Callable[..., Any], rank: int, leaves: StepLeaves
    ) -> Callable[..., Any]:
        module = stage.module
        params = [
            (sub, name, p)
            for sub in module.modules()
            for name, p in sub._parameters.items()
            if p is not None
        ]
        buffers = [
            (sub, name, b)
            for sub in module.modules()
            for name, b in sub._buffers.items()
            if b is not None
        ]
        whole = all(
            isinstance(t, GlobalTensor) and _whole_here(t._meta.layout, rank)
            for _, _, t in (*params, *buffers)
        )
        state = (
            stage.stage_id,
            tuple(tensor_state(p) for _, _, p in params),
            tuple(tensor_state(b) for _, _, b in buffers),
            tuple(m.training for m in module.modules()),
        )

        def call(*args: Any, **kwargs: Any) -> Any:
            flat, spec = flatten_call(args, kwargs)
            key = call_key(state, flat, spec, rank, held=True) if whole else None
            found = self._outputs.get(key, _UNSEEN) if key is not None else None
            if found is _UNSEEN:
                out, found = _record(forward, args, kwargs, flat, rank)
                self._outputs[key] = found
                return out
            if found is None:
                return forward(*args, **kwargs)
            assert isinstance(found, _Outputs)
            return _run_on_pieces(forward, found, flat, spec, params, buffers, leaves)

        return call


class _ToPiece(torch.autograd.Function):
    """A global tensor's piece (the whole tensor here); backward: the gradient in its layout."""

    @staticmethod
    def forward(ctx: Any, x: GlobalTensor) -> torch.Tensor:
        ctx.layout = x._meta.layout
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> GlobalTensor:
        return wrap(grad, meta_of(ctx.layout, tuple(grad.shape), grad.dtype))


class _FromPiece(torch.autograd.Function):
    """A piece as the global tensor it is the whole of; backward: the gradient's piece."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, layout: Layout) -> GlobalTensor:
        ctx.layout = layout
        strides = None if y.is_contiguous() else tuple(y.stride())
        return wrap(y.view_as(y), meta_of(layout, tuple(y.shape), y.dtype, strides))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if isinstance(grad, GlobalTensor):
            if grad._meta.layout != ctx.layout:  # within the stage's placement: whole again
                grad = box_below_autograd(grad, ctx.layout)
            return grad._local, None
        return grad, None


def _run_on_pieces(
    forward: Callable[..., Any],
    outputs: _Outputs,
    flat: list[Any],
    spec: Any,
    params: Sequence[tuple[torch.nn.Module, str, Any]],
    buffers: Sequence[tuple[torch.nn.Module, str, Any]],
    leaves: StepLeaves,
) -> Any:
    pieces = [
        (_ToPiece.apply(x) if x.requires_grad else x._local) if isinstance(x, GlobalTensor) else x
        for x in flat
    ]
    args, kwargs = unflatten_call(pieces, spec)
    scope = _step_context.current.get()
    noted = scope.mb.pieces if isinstance(scope, Scope) else None
    swapped = [(sub, name, leaves.piece(p, noted)) for sub, name, p in params]
    swapped += [(sub, name, b._local) for sub, name, b in buffers]
    try:
        for sub, name, piece in swapped:
            slots: dict[str, Any] = sub._parameters if name in sub._parameters else sub._buffers
            slots[name] = piece
        out = forward(*args, **kwargs)
    finally:
        for sub, name, t in (*params, *buffers):
            slots = sub._parameters if name in sub._parameters else sub._buffers
            slots[name] = t
    if isinstance(out, torch.Tensor) and len(outputs.layouts) == 1:  # one tensor: no pytree
        layout = outputs.layouts[0]
        return _FromPiece.apply(out, layout) if layout is not None else out
    results, out_spec = tree_flatten(out)
    made = [
        _FromPiece.apply(y, layout) if layout is not None else y
        for y, layout in zip(results, outputs.layouts, strict=True)
    ]
    return tree_unflatten(made, out_spec)


class StepLeaves:
    """The leaf each parameter's piece is in one step, shared by its micro-batches (NOTE
    [parameter pieces are leaves])."""

    def __init__(self) -> None:
        self._leaves: dict[int, tuple[GlobalTensor, torch.Tensor]] = {}

    def piece(
        self, p: GlobalTensor, noted: list[tuple[GlobalTensor, torch.Tensor]] | None
    ) -> torch.Tensor:
        """The piece a stage computes with in place of ``p``."""
        if not p.requires_grad:
            return p._local
        if noted is None or not has_only_layout_hooks(p):
            return _ToPiece.apply(p)
        found = self._leaves.get(id(p))
        if found is None:  # setdefault: stages on worker threads may share a parameter
            leaf = p._local.detach().requires_grad_()
            leaf.register_post_accumulate_grad_hook(_IntoParameter(p))
            found = self._leaves.setdefault(id(p), (p, leaf))
        noted.append(found)
        return found[1]


class _IntoParameter:
    """Post-accumulate-grad hook of a parameter's leaf: its gradient into the parameter's
    ``.grad``, as AccumulateGrad would have put it (NOTE [parameter pieces are leaves])."""

    __slots__ = ("param",)

    def __init__(self, param: GlobalTensor) -> None:
        self.param = param

    def __call__(self, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None:
            return
        param = self.param
        layout = param._meta.layout
        total = param.grad
        in_place = not torch.is_grad_enabled()  # else create_graph: added out of place
        if in_place and isinstance(total, GlobalTensor) and total._meta.layout == layout:
            total._local.add_(grad)
            return
        strides = None if grad.is_contiguous() else tuple(grad.stride())
        wrapped = wrap(grad, meta_of(layout, tuple(grad.shape), grad.dtype, strides))
        if total is None:
            param.grad = wrapped
        elif in_place:
            total.add_(wrapped)
        else:
            param.grad = total + wrapped


def _whole_here(layout: Layout, rank: int) -> bool:
    """Whether this rank's piece of a tensor laid out as ``layout`` is the whole tensor."""
    placement = layout.placement
    if rank not in placement:
        return False
    return len(placement.flat_ranks) == 1 or all(isinstance(s, Broadcast) for s in layout.sbp)


def tensor_state(t: torch.Tensor) -> Any:
    if isinstance(t, GlobalTensor):
        return (t._meta, t.requires_grad)
    return (tuple(t.shape), t.dtype, t.requires_grad)


def _record(
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    flat_inputs: list[Any],
    rank: int,
) -> tuple[Any, _Outputs | None]:
    """Run the stage through the dispatcher and decide whether it may run on its pieces."""
    out, communicated, draws = run_watched(forward, args, kwargs)
    if communicated or draws:
        return out, None
    for x in flat_inputs:
        if isinstance(x, GlobalTensor) and not _whole_here(x._meta.layout, rank):
            return out, None
    layouts: list[Layout | None] = []
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, GlobalTensor) and _whole_here(leaf._meta.layout, rank):
            layouts.append(leaf._meta.layout)
        elif isinstance(leaf, CONSTANTS) and not isinstance(leaf, torch.Tensor):
            layouts.append(None)
        else:
            return out, None
    return out, _Outputs(tuple(layouts))
