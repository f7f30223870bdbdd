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
"""

from __future__ import annotations

from typing import Any

import torch

from .._global import GlobalTensor, as_global_grad
from .._layout import Layout
from ..comm._world import get_rank
from . import executor
from .planner import plan

__all__ = ["Redistribute", "box_below_autograd"]


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
        return box_below_autograd(x, dst)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[GlobalTensor, None]:
        grad = as_global_grad(grad, "boxing")
        return Redistribute.apply(grad, ctx.src), None
