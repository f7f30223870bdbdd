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
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from .._global import GlobalTensor, as_global_grad
from .._layout import Layout
from ..boxing._redistribute import Redistribute, box_below_autograd
from ..placement import Placement

if TYPE_CHECKING:  # _plan imports this module when a plan is applied
    from ._plan import Boundary

__all__ = ["follow", "unfollow"]

_HANDLES = "_sbpflow_plan_hooks"


class _Follow(torch.autograd.Function):
    """Forward: box to the planned layout. Backward: box the gradient to the planned one."""

    @staticmethod
    def forward(ctx: Any, x: GlobalTensor, dst: Layout, grad: Layout) -> GlobalTensor:
        ctx.grad = grad
        # a new tensor even when nothing moves: an input returned as is would be a view of
        # it, and the propagation's gradient hooks would go on its base (NOTE [gradient plan])
        if x._layout.normalized() == dst:
            return GlobalTensor(x._local, x._layout, x.shape)
        return box_below_autograd(x, dst)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = as_global_grad(grad, "a module boundary of an auto_parallel plan")
        if grad._layout.normalized() != ctx.grad:
            grad = Redistribute.apply(grad, ctx.grad)
        return grad, None, None


class _Boundaries:
    """The boundaries of one model, by module, with their layouts made once."""

    def __init__(self, placement: Placement, boundaries: Sequence[Boundary]) -> None:
        self.placement = placement
        self.tables: dict[tuple[str, str], dict[int, tuple[Boundary, Layout, Layout | None]]]
        self.tables = {}
        for b in boundaries:
            dst = Layout(placement, b.sbp).normalized()
            grad = None if b.grad_sbp is None else Layout(placement, b.grad_sbp).normalized()
            self.tables.setdefault((b.module, b.where), {})[b.position] = (b, dst, grad)
        # tensors a boundary made, with its layouts: the next boundary with the same ones
        # (a module's output handed to the next module) adds nothing
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def box(self, value: Any, key: tuple[str, str]) -> Any:
        table = self.tables[key]
        leaves, spec = pytree.tree_flatten(value)
        if len(leaves) != next(iter(table.values()))[0].num_leaves:
            return value
        for position, (boundary, dst, grad) in table.items():
            x = leaves[position]
            if (
                not isinstance(x, GlobalTensor)
                or x.placement != self.placement
                or tuple(x.shape) != boundary.shape
                or self.made.get(x) == (dst, grad)
            ):
                continue
            if x.requires_grad and torch.is_grad_enabled() and grad is not None:
                x = _Follow.apply(x, dst, grad)
            elif x._layout.normalized() != dst:
                x = x.to_global(sbp=dst.sbp)
            self.made[x] = (dst, grad)
            leaves[position] = x
        return pytree.tree_unflatten(leaves, spec)


def follow(model: torch.nn.Module, placement: Placement, boundaries: Sequence[Boundary]) -> None:
    """Install the boundary hooks on ``model``'s modules (replacing earlier ones)."""
    unfollow(model)
    state = _Boundaries(placement, boundaries)
    handles = []
    for name, module in model.named_modules():
        if (name, "input") in state.tables:

            def pre(_m: Any, args: Any, kwargs: Any, key: tuple = (name, "input")) -> Any:
                return state.box((args, kwargs), key)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        if (name, "output") in state.tables:

            def post(_m: Any, _a: Any, out: Any, key: tuple = (name, "output")) -> Any:
                return state.box(out, key)

            handles.append(module.register_forward_hook(post))
    model.__dict__[_HANDLES] = handles


def unfollow(model: torch.nn.Module) -> None:
    """Remove the hooks ``Plan.apply`` installed on ``model`` (no-op if none)."""
    for handle in model.__dict__.pop(_HANDLES, ()):
        handle.remove()
