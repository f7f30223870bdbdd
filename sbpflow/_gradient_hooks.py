"""Running a choice's gradient plan: hooks that box a complete gradient to its tensor's layout.

NOTE [gradient plan] in ``_propagation`` says which inputs of an op get one;
this module registers them while the forward runs. A hook boxes the gradient
of a tensor, after autograd has summed every use of it, from the layout it
arrives in to the tensor's own layout with partial axes reduced (P -> B), the
same for every rank, so the ops of the tensor's own backward run on it as its
forward ops ran on the tensor. The value never changes, only its layout.

A tensor gets at most one such hook (``_GRADIENT_HOOK`` in its ``__dict__``).
No hook goes on
- a leaf: parameters already get their gradient in their own layout
  (``keep_grad_layout``) or reduced in buckets (``GradientSync``);
- a tensor made by an autograd Function (``to_global``'s boxing, a local tensor
  made global, a user's Function): its backward already says where the
  gradient goes (boxing's backward is boxing back; a conversion from local
  tensors reads gradients with the dual layout).
Nor are hooks registered while a backward pass runs ops (``create_graph=True``,
or AOTAutograd tracing a backward): a hook belongs to the forward graph. Under
``torch.compile`` the forward trace registers them like eager code does, and
the traced backward holds their boxing.
A view whose base has the same layout hooks the base instead: ``F.linear`` on a
3-D input views it as 2-D for each projection, and the gradients of the views
must be summed (at the base) before they are reduced once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _global
from ._layout import Layout
from ._propagation import GradientPlan
from .boxing._redistribute import Redistribute

if TYPE_CHECKING:
    from ._global import GlobalTensor

__all__ = ["apply_gradient_plan"]

_GRADIENT_HOOK = "_sbpflow_gradient_hook"


def apply_gradient_plan(plan: GradientPlan, inputs: Sequence[Any]) -> None:
    """Register the hooks ``plan`` names on ``inputs`` (the op's global inputs, in order)
    while a forward pass records a graph (not while a backward pass runs its ops)."""
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return
    for k in plan.reverse:
        if _may_hook(inputs[k]):
            _return_gradient(inputs[k])
    for k, sources in plan.fan_out:
        # A data-parallel weight (W.t() of a broadcast parameter) fans out over the batch on
        # every call: asked first whether it is a parameter itself, it is passed over at once.
        t = inputs[k]
        if _may_hook(t) and not _is_parameter(t) and any(_is_parameter(inputs[j]) for j in sources):
            _return_gradient(t)


def _may_hook(t: Any) -> bool:
    """A global non-leaf that requires grad and was not looked at yet."""
    return (
        isinstance(t, _global.GlobalTensor)
        and t.requires_grad
        and t.grad_fn is not None
        and _GRADIENT_HOOK not in t.__dict__
    )


def _return_gradient(t: GlobalTensor) -> None:
    t.__dict__[_GRADIENT_HOOK] = None  # looked at once
    if t._is_view():
        base = t._base
        if (
            isinstance(base, _global.GlobalTensor)
            and base._layout.normalized() == t._layout.normalized()
        ):
            if _may_hook(base):
                _return_gradient(base)
            return
    if _made_by_function(t):
        return
    own = t._layout
    target = Layout(own.placement, own.without_partial().sbp)
    t.__dict__[_GRADIENT_HOOK] = t.register_hook(_boxing_to(target))


def _boxing_to(target: Layout) -> Any:
    normalized = target.normalized()

    def box_gradient(grad: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(grad, _global.GlobalTensor) or grad.placement != target.placement:
            return None
        if grad._layout.normalized() == normalized:
            return None
        return Redistribute.apply(grad, target)

    return box_gradient


def _made_by_function(t: torch.Tensor) -> bool:
    """Whether ``t`` is the output of an autograd Function (``_forward_cls`` marks their
    backward nodes), whose backward decides its gradient's way itself."""
    return getattr(t.grad_fn, "_forward_cls", None) is not None


def _is_parameter(t: Any) -> bool:
    """Whether ``t`` is a parameter (a leaf that requires grad) or a view of one, at any depth
    (``W.t()``, ``W.view(...)[0]``). Asked of the inputs an op uses split or partial: the
    weights of column- and row-parallel matmuls.

    Answered from the tensor, not its autograd history: a view's ``_base`` is the tensor it
    shows (a view of a view has the first one's base). While torch.compile traces, the traced
    function's inputs stand in for the parameters it uses (NOTE [inputs of a traced function]
    in _global); a view made in the trace has such an input as its base.
    """
    if not isinstance(t, _global.GlobalTensor) or not t.requires_grad:
        return False
    shown = t._base if t._is_view() else t
    if not isinstance(shown, _global.GlobalTensor) or not shown.requires_grad:
        return False
    return shown.is_leaf or shown._traced_input
