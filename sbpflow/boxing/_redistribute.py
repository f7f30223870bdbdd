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
# While the pipeline runtime runs a step (sbpflow/nn/_pipeline_runtime.py) it
# sets ``transfer_hook``: ``Redistribute`` then shows it each change of
# placement (a stage boundary, a weight used on another stage), in forward the
# input and in backward a way to compute the gradient, which the runtime may
# run once and replay (a zero-bubble weight pass crosses the same boundaries as
# the input pass before it, and must not receive their gradients twice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from .._global import GlobalTensor, as_global_grad
from .._layout import Layout
from ..comm._world import get_rank
from . import executor
from .planner import plan

__all__ = ["Redistribute", "TransferHook", "box_below_autograd"]


class TransferHook(Protocol):
    """What the pipeline runtime sees of changes of placement (NOTE [transfer hook])."""

    def forward(self, ctx: Any, x: GlobalTensor, dst: Layout) -> None: ...

    def backward(self, ctx: Any, compute: Callable[[], GlobalTensor]) -> GlobalTensor: ...


transfer_hook: TransferHook | None = None


def box_below_autograd(x: GlobalTensor, dst: Layout) -> GlobalTensor:
    """``x`` laid out as ``dst`` (same logical value); not differentiable. Every rank calls it."""
    boxing_plan = plan(tuple(x.shape), x.dtype, x._layout, dst)
    local = executor.execute(boxing_plan, x._local, get_rank())
    return GlobalTensor(local, dst, x.shape)


class Redistribute(torch.autograd.Function):
    """Forward: boxing src -> dst. Backward: the gradient boxed back to src's layout."""

    @staticmethod
    def forward(ctx: Any, x: GlobalTensor, dst: Layout) -> GlobalTensor:
        ctx.src = x._layout
        ctx.crosses = x.placement != dst.placement
        if transfer_hook is not None and ctx.crosses:
            transfer_hook.forward(ctx, x, dst)
        return box_below_autograd(x, dst)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[GlobalTensor, None]:
        grad = as_global_grad(grad, "boxing")
        if transfer_hook is not None and ctx.crosses:
            return transfer_hook.backward(ctx, lambda: Redistribute.apply(grad, ctx.src)), None
        return Redistribute.apply(grad, ctx.src), None
