"""Changing a global tensor's layout: the two ways, one differentiable and one below autograd.

# NOTE [two ways to box]
# ``GlobalTensor.to_global`` (the one public way) boxes through
# ``Redistribute``, an autograd Function whose backward boxes the gradient,
# from the layout it arrives in, back to the input's layout (NOTE [one-axis
# transitions] in planner.py names the collectives). Code that runs below autograd (the
# dispatcher, the rules' ``local`` functions, the optimizer's inf check,
# reading a value to print it) calls ``box_below_autograd``: plan, execute on
# this rank's piece, wrap. Autograd differentiates those ops through their own
# backward formulas, so that boxing must add no graph node of its own.
#
# NOTE [transfer hook]
# While the pipeline runtime runs a step (NOTE [pipeline step context] in
# sbpflow/_step_context.py), ``Redistribute`` shows the micro-batch's scope each
# change of placement (a stage boundary, a weight used on another stage): in
# forward the input, and in backward a way to compute the gradient, which the
# runtime may run once and replay (a zero-bubble weight pass crosses the same
# boundaries as the input pass before it, and must not receive their gradients
# twice). Its move goes on lane 0 of the pair of placements and its gradient's
# move back on lane 1 (NOTE [lanes] in sbpflow/comm/_p2p.py), so the ranks need
# to agree on the order of messages within each lane only. The runtime runs its
# backwards with the autograd engine on the
# calling thread (``torch.autograd.set_multithreading_enabled(False)``), so the
# backward finds the scope of the pass that runs it (an input-gradient or a
# weight pass) in the context variable.
#
# NOTE [gradients cross in the layout their tensor crossed in]
# Inside a pipelined step a gradient changes placement only from the layout
# its tensor had after the change in forward: it is first boxed to that layout
# within the destination placement (e.g. a partial-sum gradient of a
# tensor-parallel stage is all-reduced among the stage's ranks), then moved.
# A rank that does not hold a stage never computes the stage's gradients (NOTE
# [stages held elsewhere] in sbpflow/nn/pipeline/runtime/_held_elsewhere.py);
# it cannot know the layout they come out in, but it knows this one, so the
# ranks on both sides of the move plan the same transfer.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .. import _step_context
from .._global import GlobalTensor, as_global_grad
from .._layout import Layout
from ..comm._world import get_rank
from . import executor
from .planner import plan

__all__ = ["Redistribute", "box_below_autograd"]


def box_below_autograd(
    x: GlobalTensor, dst: Layout, lane: tuple[Hashable, int] | None = None
) -> GlobalTensor:
    """``x`` laid out as ``dst`` (same logical value); not differentiable. Every rank calls it.

    A change of placement goes on ``lane`` (NOTE [lanes] in sbpflow/comm/_p2p.py).
    """
    boxing_plan = plan(tuple(x.shape), x.dtype, x._layout, dst)
    local = executor.execute(boxing_plan, x._local, get_rank(), lane)
    return GlobalTensor(local, dst, x.shape)


class Redistribute(torch.autograd.Function):
    """Forward: boxing src -> dst. Backward: the gradient boxed back to src's layout."""

    @staticmethod
    def forward(
        ctx: Any, x: GlobalTensor, dst: Layout, lane: tuple[Hashable, int] | None = None
    ) -> GlobalTensor:
        ctx.src, ctx.dst = x._layout, None
        if lane is None and x.placement != dst.placement:
            scope = _step_context.current.get()
            if scope is not None:  # NOTE [transfer hook]
                ctx.dst = dst
                lane = ((x.placement, dst.placement), 0)  # its gradient comes back on lane 1
                scope.transfer_forward(ctx, x, dst)
        return box_below_autograd(x, dst, lane)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[GlobalTensor, None, None]:
        grad = as_global_grad(grad, "boxing")
        scope = _step_context.current.get() if ctx.dst is not None else None
        if scope is None:
            return Redistribute.apply(grad, ctx.src), None, None
        lane = ((ctx.src.placement, ctx.dst.placement), 1)

        def move() -> GlobalTensor:  # NOTE [gradients cross in the layout their tensor crossed in]
            crossed = grad if grad._layout == ctx.dst else Redistribute.apply(grad, ctx.dst)
            return Redistribute.apply(crossed, ctx.src, lane)

        return scope.transfer_backward(ctx, move), None, None
