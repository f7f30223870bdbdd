"""When a fully sharded module gathers, frees and reduces: its hooks, and what a step shares.

# NOTE [gathered parameters in autograd]
# Before a fully sharded module's forward, its parameters are gathered (``ParamGroup``)
# and ``_GatheredParams`` turns the sharded parameters into new tensors of the unsharded
# ones (B on the data axis), one autograd node for the block; the module computes with
# those (they replace the parameters on their owners during its forward, and the sharded
# ones come back after it). Autograd runs that node once the gradients of all its
# outputs have arrived, i.e. after every op of the block that used a parameter has run
# its backward: that is the block's post-backward, in two parts. A pre-hook of the node
# frees the gathered parameters, finishes the previous block's reduction and packs the
# gradients into the rows of the block's one reduce_scatter (P -> S(d)); it hands
# autograd None in their place, so the unsharded gradients are freed before the node's
# backward starts the reduce_scatter (whose buffers would otherwise be alive with them:
# autograd holds a node's inputs until the node returns). The node's input is not the
# sharded parameters but an anchor leaf of the module (an empty tensor requiring grad):
# a sharded parameter's ``.grad`` receives its shard when the reduce_scatter completes,
# and its gradient hooks run there (NOTE [hooks of a fully sharded parameter] in
# _fsdp_group); as an input, its AccumulateGrad would run too, with no gradient, and call
# them once more. The next block's post-backward (so one reduce_scatter is in flight while the
# block before it computes its backward) or the end of the backward pass, whichever
# comes first, waits for it and writes ``.grad``, so ``clip_grad_norm_`` and
# ``optimizer.step()`` find every gradient reduced.
#
# A module freed after its forward (``reshard_after_forward``) is gathered again before
# its backward: a hook on each of its outputs runs when the output's gradient is ready,
# before the first of the block's backward ops. The tensors autograd saved alias the
# group's buffer, which that gather refills (NOTE [one gather, one reduction per block]).

# NOTE [prefetch]
# Every rank runs the same modules in the same order, so each rank gathers the same
# blocks in the same order and the all_gathers pair up. Forward: the order of the
# previous step's forward is kept; when a block starts, the gather of the block that
# followed it last time starts too, and runs while this block computes. Backward: the
# blocks run in the reverse of this step's forward order, so when a block's backward is
# about to start, the gather of the block whose forward ran before it starts. A block
# is thus gathered at most one block ahead: with every block freed after its forward, at
# most two blocks are gathered at any time (and the root module, which stays gathered
# from its forward to its backward: it is needed first in backward). A prefetch the step
# did not use (the order changed) is freed at the end of the forward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree

from ..._compiling import graph_break
from ._fsdp_group import ParamGroup, PendingReduction, ShardedState

__all__ = ["FSDPState", "MixedPrecision"]

_WHY = "sbpflow: a fully sharded module gathers and frees its parameters between graphs."


class MixedPrecision:
    """The dtypes a fully sharded module computes, reduces and returns in (resolved)."""

    def __init__(
        self,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        output_dtype: torch.dtype | None,
        cast_forward_inputs: bool,
    ) -> None:
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.output_dtype, self.cast_forward_inputs = output_dtype, cast_forward_inputs


class _StepContext:
    """What the fully sharded modules under one root share during a step."""

    def __init__(self) -> None:
        self.states: list[FSDPState] = []
        self.root: FSDPState | None = None  # the module whose forward is running the step
        self.forward_order: list[ParamGroup] = []  # this step's, as blocks start
        self.previous_order: list[ParamGroup] = []  # the previous step's (NOTE [prefetch])
        self.post_forward: list[ParamGroup] = []  # blocks as their forwards end
        self.generation = 0  # bumped when ``post_forward`` is cleared
        self.reductions: list[PendingReduction] = []
        self._callback: Callable[[], Any] | None = None  # the end-of-backward one, weakly

    def queue_end_of_backward(self) -> None:
        """Once per backward pass: finish every reduction when it ends."""
        if self._callback is not None and self._callback() is not None:
            return
        finish = functools.partial(self.end_of_backward)
        torch.autograd.Variable._execution_engine.queue_callback(finish)
        # Held weakly: the graph task drops it when the pass ends, run or not (a pass that
        # raised never runs it, and the next pass queues its own).
        self._callback = weakref.ref(finish)

    def finish_reductions(self) -> None:
        reductions, self.reductions = self.reductions, []
        for reduction in reductions:
            reduction.finish()

    def end_of_backward(self) -> None:
        self.finish_reductions()
        for state in self.states:
            state.group.reshard()
        self.post_forward.clear()
        self.generation += 1

    def reshard_all(self) -> None:
        for state in self.states:
            state.group.reshard()


class _ForwardCall:
    """One forward of a module: where it ended in the step, and whether its backward began."""

    def __init__(self, index: int, generation: int) -> None:
        self.index, self.generation, self.began = index, generation, False


class FSDPState:
    """The hooks of one fully sharded module around its ``ParamGroup``."""

    def __init__(
        self,
        module: torch.nn.Module,
        group: ParamGroup,
        reshard_after_forward: bool,
        precision: MixedPrecision,
    ) -> None:
        self.module, self.group = module, group
        self.reshard_after_forward = reshard_after_forward
        self.precision = precision
        self.ctx = _StepContext()
        self.ctx.states.append(self)
        self._adopted = False
        # the input of the block's gather node (NOTE [gathered parameters in autograd])
        self._anchor = torch.empty(0, requires_grad=True)
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward, always_call=True),
        ]

    def nested_states(self) -> list[FSDPState]:
        """This module's state and those of the fully sharded modules inside it."""
        out = []
        for sub in self.module.modules():
            state = sub.__dict__.get(STATE_ATTR)
            if isinstance(state, FSDPState):
                out.append(state)
        return out

    # -- forward ---------------------------------------------------------------------
    @graph_break(_WHY)
    def _pre_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = self.ctx
        if ctx.root is None:
            if not self._adopted:
                self._adopt_nested()
                ctx = self.ctx
            ctx.root = self
            ctx.forward_order = []
        group = self.group
        group.wait_unsharded()
        self._prefetch_forward()
        params = group.params
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            gathered = _GatheredParams.apply(self, self._anchor)
            node = next(t.grad_fn for t in gathered if t.grad_fn is not None)
            node.register_prehook(self._pack_gradients)
        else:
            gathered = tuple(p.gathered() for p in params)
        for p, tensor in zip(params, gathered, strict=True):
            for owner, attr in p.owners:
                owner._parameters[attr] = tensor
        if self.precision.cast_forward_inputs and self.precision.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.precision.param_dtype)
        return args, kwargs

    def _adopt_nested(self) -> None:
        """The first forward of a module not inside another's step: the fully sharded
        modules inside it share its step from now on."""
        for state in self.nested_states():
            if state is not self and state.ctx.root is None:
                state.ctx = self.ctx
                if state not in self.ctx.states:
                    self.ctx.states.append(state)
            state._adopted = True

    def _prefetch_forward(self) -> None:
        ctx = self.ctx
        position = len(ctx.forward_order)
        ctx.forward_order.append(self.group)
        previous = ctx.previous_order
        if position + 1 < len(previous) and previous[position] is self.group:
            previous[position + 1].unshard()

    @graph_break(_WHY)
    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        for p in self.group.params:
            for owner, attr in p.owners:
                owner._parameters[attr] = p.param  # type: ignore[assignment]  # an nn.Parameter
        ctx = self.ctx
        is_root = ctx.root is self
        if not is_root and self.reshard_after_forward:
            self.group.reshard()
        call = _ForwardCall(len(ctx.post_forward), ctx.generation)
        ctx.post_forward.append(self.group)
        outputs = [
            t
            for t in _pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        hook = functools.partial(self._pre_backward, call)
        for t in outputs:
            t.register_hook(hook)
        if is_root:
            ctx.root = None
            ctx.previous_order, ctx.forward_order = ctx.forward_order, []
            if not outputs:  # no backward will follow (evaluation): free everything now
                ctx.reshard_all()
            else:  # a prefetch this step did not use (NOTE [prefetch])
                for state in ctx.states:
                    if state.group.state is ShardedState.GATHERING:
                        state.group.reshard()
        if self.precision.output_dtype is not None:
            output = _cast_floating(output, self.precision.output_dtype)
        return output

    # -- backward --------------------------------------------------------------------
    @graph_break(_WHY)
    def _pre_backward(self, call: _ForwardCall, grad: torch.Tensor) -> None:
        if call.began:
            return
        call.began = True
        ctx = self.ctx
        ctx.queue_end_of_backward()
        self.group.wait_unsharded()
        if call.generation == ctx.generation and 0 < call.index <= len(ctx.post_forward):
            ctx.post_forward[call.index - 1].unshard()  # NOTE [prefetch]

    def _pack_gradients(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[None, ...]:
        """The block's gradients are all in (NOTE [gathered parameters in autograd]): the
        first part of its post-backward, a pre-hook of its gather's autograd node."""
        ctx = self.ctx
        ctx.queue_end_of_backward()
        self.group.reshard()
        ctx.finish_reductions()  # the previous block's: one reduce_scatter in flight
        self.group.pack_gradients(grads)
        return (None,) * len(grads)  # autograd drops the unsharded gradients

    def post_backward(self) -> None:
        """The second part: start the block's reduce_scatter."""
        reduction = self.group.start_reduction()
        if reduction is not None:
            self.ctx.reductions.append(reduction)


STATE_ATTR = "_sbpflow_fsdp_state"  # in a fully sharded module's __dict__


class _GatheredParams(torch.autograd.Function):
    """Forward: the block's gathered parameters as new tensors. Backward: their gradients
    reduced for the block (NOTE [gathered parameters in autograd])."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.set_materialize_grads(False)
        params = state.group.params
        outputs = tuple(p.gathered() for p in params)
        frozen = [out for out, p in zip(outputs, params, strict=True) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.state.post_backward()  # the gradients went to the pre-hook, these are None
        return None, None


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return _pytree.tree_map_only(torch.Tensor, cast, tree)
