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
from torch.utils._pytree import tree_map

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
        def unwrap(a: Any) -> Any:
            return a._local if isinstance(a, Floor) else a

        def wrap(o: Any) -> Any:
            return Floor.wrap(o) if isinstance(o, torch.Tensor) else o

        args, kwargs = tree_map(unwrap, (args, kwargs or {}))  # lists of tensors too (cat)
        return tree_map(wrap, func(*args, **kwargs))


def floor_model(base: nn.Module) -> nn.Module:
    """A copy of ``base`` whose every parameter wraps its plain tensor in ``Floor``."""
    model = copy.deepcopy(base)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(Floor.wrap(p.detach().clone()))
    return model
