"""The minimal ``__torch_dispatch__`` wrapper subclass: a floor for any Python tensor subclass.

``Floor`` unwraps its arguments, runs the op on the plain tensors and wraps every tensor
output, with no layout logic at all: what torch's subclass dispatch itself costs, a bound
no framework built on a Python subclass (sbpflow's global tensor, DTensor) goes below.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass  # type: ignore[attr-defined]


class Floor(torch.Tensor):
    """Unwrap, run the op on the locals, wrap every tensor output."""

    _local: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(local: torch.Tensor) -> Floor:
        self = _make_wrapper_subclass(
            Floor, local.shape, strides=local.stride(), dtype=local.dtype, device=local.device,
            requires_grad=local.requires_grad,
        )  # fmt: skip
        self._local = local
        return self

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(
            *[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in (kwargs or {}).items()}
        )
        if isinstance(out, torch.Tensor):
            return Floor.wrap(out)
        if isinstance(out, (list, tuple)):
            return type(out)(Floor.wrap(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out


def _unwrap(a: Any) -> Any:
    """A ``Floor``'s local, or a list of them (``cat``, ``_foreach_*``) as a list of locals:
    one level, as ATen's arguments are, and no pytree (it would raise the floor)."""
    if isinstance(a, Floor):
        return a._local
    if isinstance(a, (list, tuple)):
        return type(a)(x._local if isinstance(x, Floor) else x for x in a)
    return a


def floor_model(base: nn.Module) -> nn.Module:
    """A copy of ``base`` whose every parameter wraps its plain tensor in ``Floor``; a
    parameter shared by several modules (tied embeddings) stays one parameter."""
    model = copy.deepcopy(base)
    wrapped: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in wrapped:
                    wrapped[id(p)] = nn.Parameter(Floor.wrap(p.detach().clone()))
                module._parameters[name] = wrapped[id(p)]
    return model
