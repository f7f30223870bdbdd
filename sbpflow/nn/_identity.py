"""Giving a parameter a new value in place: the same Python object holds the converted tensor.

# NOTE [parameters keep their identity]
# ``Module.to_global`` and ``fully_shard`` give each parameter a new value (a plain parameter
# becomes a global tensor, a global one changes layout) and the parameter stays the same
# Python object, as ``module.to()`` keeps it with ``torch.utils.swap_tensors``. Whatever held
# it before -- an optimizer's param groups and its state (keyed by the parameter), a
# ``named_parameters()`` dict, a tied-weight reference, a gradient hook -- holds the
# converted parameter, so an optimizer built before the conversion trains the model.
#   - A global parameter takes the new value through ``p.data = value`` (its ``.data``
#     setter, NOTE [device moves] in _devices): its C++ tensor, ``__dict__`` and hooks
#     stay; its ``.grad`` is boxed to the new layout (the logical value is kept).
#   - A plain parameter cannot take a global value through ``.data`` (another tensor type),
#     so it is swapped with a new global parameter (``torch.utils.swap_tensors``: class,
#     ``__dict__`` and C++ tensor exchanged). The swap leaves two things behind, put back
#     here: the parameter's own ``__dict__`` entries (carried into the new one), and its
#     gradient hooks, whose dicts stay on the Python object while the C++ tensor that runs
#     them is replaced (the dicts are attached to the new C++ tensor, before the layout
#     hook of ``keep_grad_layout``). Its ``.grad`` has no logical value to carry (which
#     rank's?), so it must be None; a weakref to it, a second user of its C++ tensor (a
#     view of it) or ``__slots__`` (a Parameter subclass) make the swap impossible. Those
#     are checked for every parameter of the call before any is converted, and raise with
#     the fix.
"""

from __future__ import annotations

import copyreg
import weakref

import torch

from .._global import GlobalTensor, keep_hook_dicts

__all__ = ["check_convertible", "convert_in_place"]

_VALUE_KEYS = ("_local", "_meta")  # a global tensor's own value, never carried over


def check_convertible(param: torch.Tensor, name: str, what: str) -> None:
    """Raise if ``param`` cannot take a global value in place (NOTE [parameters keep their
    identity]); ``what`` names the call in the message."""
    if isinstance(param, GlobalTensor):
        return
    if param.grad is not None:
        raise ValueError(
            f"{what}: parameter {name!r} has a gradient (.grad) from before the conversion, "
            "and a local gradient has no logical value to carry into the global parameter. "
            "Clear it first (optimizer.zero_grad() or module.zero_grad(), which set it to "
            "None), then convert."
        )
    slots = copyreg._slotnames(type(param))  # type: ignore[attr-defined]
    if slots:
        raise TypeError(
            f"{what}: parameter {name!r} is a {type(param).__name__} with __slots__ {slots}, "
            "which torch.utils.swap_tensors cannot exchange with a global tensor, so it cannot "
            "be converted in place. Make it a torch.nn.Parameter first."
        )
    if _shared(param):
        raise RuntimeError(
            f"{what}: parameter {name!r} is shared with another tensor (a view of it, or an "
            "autograd graph that has not run backward), so it cannot be converted in place "
            "(torch.utils.swap_tensors refuses it) and stay the object that the optimizer and "
            "hooks hold. Drop those tensors (or run the backward) first, then convert."
        )
    if weakref.getweakrefs(param):
        raise RuntimeError(
            f"{what}: parameter {name!r} is referenced by a weakref, so it cannot be converted "
            "in place (torch.utils.swap_tensors refuses it) and stay the object that the "
            "optimizer and hooks hold. Convert the module before whatever took the weakref "
            "(e.g. torch.compile) sees it."
        )


def _shared(param: torch.Tensor) -> bool:
    """Whether another tensor holds ``param``'s C++ tensor, besides its own AccumulateGrad
    node (which the swap allows: it poisons it), as ``torch.utils.swap_tensors`` counts."""
    count = param._use_count()
    if count <= 1:
        return False
    if count > 2 or not param.is_leaf:
        return True
    edge = torch.autograd.graph.get_gradient_edge(param)  # made here if there was none
    shared = param._use_count() != 2
    del edge
    return shared


def convert_in_place(param: torch.Tensor, value: GlobalTensor, name: str, what: str) -> None:
    """``param`` (a parameter, plain or global) becomes ``value`` and stays the same object."""
    if param is value:
        return
    if isinstance(param, GlobalTensor):
        _relayout(param, value)
        return
    requires_grad = param.requires_grad
    new = torch.nn.Parameter(value.detach(), requires_grad=False)  # no hooks of its own yet
    attrs = {k: v for k, v in param.__dict__.items() if k not in _VALUE_KEYS}
    new.__dict__.update(attrs)
    pre, post = param._backward_hooks, param._post_accumulate_grad_hooks
    try:
        torch.utils.swap_tensors(param, new)
    except RuntimeError as error:
        raise RuntimeError(
            f"{what}: parameter {name!r} cannot be converted in place, so the optimizer and "
            f"hooks holding it would be left with the old tensor: {error}. Another tensor "
            "shares it (a view of it, or an autograd graph that has not run backward): drop "
            "those, or convert the module before using it."
        ) from error
    # The hook dicts stayed on the Python object; attach them to its new C++ tensor.
    keep_hook_dicts(param, pre, post)
    if requires_grad:
        param.requires_grad_(True)  # GlobalTensor's: the gradient keeps the parameter's layout


def _relayout(param: GlobalTensor, value: GlobalTensor) -> None:
    """A global parameter takes ``value`` through ``.data``; its gradient is boxed along."""
    grad = param.grad
    param.data = value
    if grad is None or not isinstance(grad, GlobalTensor):
        return
    if grad._layout != value._layout or grad.dtype != value.dtype:
        with torch.no_grad():
            grad = grad.to_global(value.placement, value.sbp, check_meta=False).to(value.dtype)
    param.grad = grad
