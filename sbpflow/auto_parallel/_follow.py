"""Running a plan: module hooks that box inputs and outputs to the planned layouts.

# NOTE [following the plan]
# ``Plan.apply`` sets the parameters' layouts; between them, sbpflow's own propagation lays
# out each op from the layouts it is given (NOTE [choosing a strategy] in
# sbpflow/_propagation.py), and may box elsewhere than the plan (an all_reduce where the
# plan reduce-scatters and all-gathers later). So ``apply`` also pins the layouts at module
# boundaries, as DTensor's ``parallelize_module`` input/output layouts do: a forward
# pre-hook and a forward hook per module box each tensor the module is given or returns to
# the layout the plan reads it in (``Boundary.sbp``), through ``_Follow``, an autograd
# Function whose backward boxes the gradient to the layout the plan hands back there
# (``Boundary.grad_sbp``), from whatever layout it arrives in. Being a Function, its output
# gets no gradient hook of the propagation's own (NOTE [gradient plan]): the plan decides.
# Inside a module, ops still propagate; from planned inputs and parameters they mostly
# take the planned strategy, and the boundaries bring any drift back. Boxing never changes
# a value, so a boundary can only move collectives, never numerics.
#
# A boundary applies when the module's call has as many tensor leaves as when the step was
# captured and the tensor has the captured shape; otherwise the tensor is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._global import GlobalTensor, as_global_grad
from .._layout import Layout
from ..boxing._redistribute import Redistribute, box_below_autograd
from ..placement import Placement
from ._plan import Boundary

__all__ = ["follow", "unfollow"]

_HANDLES = "_sbpflow_plan_hooks"


class _Follow(torch.autograd.Function):
    """Forward: box to the planned layout. Backward: box the gradient to the planned one."""

    @staticmethod
    def forward(ctx: Any, x: GlobalTensor, dst: Layout, grad: Layout | None) -> GlobalTensor:
        ctx.grad = grad
        return box_below_autograd(x, dst)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.grad is None:
            return grad, None, None
        grad = as_global_grad(grad, "a module boundary of an auto_parallel plan")
        if grad._layout.normalized() != ctx.grad.normalized():
            grad = Redistribute.apply(grad, ctx.grad)
        return grad, None, None


def _box(x: Any, placement: Placement, boundary: Boundary) -> Any:
    if not isinstance(x, GlobalTensor) or x.placement != placement:
        return x
    if tuple(x.shape) != boundary.shape:
        return x
    dst = Layout(placement, boundary.sbp)
    grad = None if boundary.grad_sbp is None else Layout(placement, boundary.grad_sbp)
    if x.requires_grad and torch.is_grad_enabled() and grad is not None:
        return _Follow.apply(x, dst, grad)
    return x if x._layout.normalized() == dst.normalized() else x.to_global(sbp=boundary.sbp)


def _boxed(value: Any, placement: Placement, table: dict[int, Boundary]) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    if not table or len(leaves) != next(iter(table.values())).num_leaves:
        return value
    for position, boundary in table.items():
        leaves[position] = _box(leaves[position], placement, boundary)
    return pytree.tree_unflatten(leaves, spec)


def follow(model: torch.nn.Module, placement: Placement, boundaries: Sequence[Boundary]) -> None:
    """Install the boundary hooks on ``model``'s modules (replacing earlier ones)."""
    unfollow(model)
    tables: dict[tuple[str, str], dict[int, Boundary]] = {}
    for b in boundaries:
        tables.setdefault((b.module, b.where), {})[b.position] = b
    handles = []
    for name, module in model.named_modules():
        given = tables.get((name, "input"))
        if given:

            def pre(_m: Any, args: Any, kwargs: Any, table: dict = given) -> Any:
                return _boxed((args, kwargs), placement, table)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        returned = tables.get((name, "output"))
        if returned:

            def post(_m: Any, _a: Any, out: Any, table: dict = returned) -> Any:
                return _boxed(out, placement, table)

            handles.append(module.register_forward_hook(post))
    model.__dict__[_HANDLES] = handles


def unfollow(model: torch.nn.Module) -> None:
    """Remove the hooks ``Plan.apply`` installed on ``model`` (no-op if none)."""
    for handle in model.__dict__.pop(_HANDLES, ()):
        handle.remove()
