"""``Module.to_global``: convert every parameter and buffer in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..placement import Placement
from ..tensor import GlobalTensor, keep_grad_layout, to_global

SbpSpec = Any | Callable[[str, torch.Tensor], Any]


def module_to_global(
    module: torch.nn.Module, placement: Placement, sbp: SbpSpec
) -> torch.nn.Module:
    """Convert ``module``'s parameters and buffers to global tensors, in place; returns it.

    ``sbp`` is one SBP (or N-D tuple) for all, or a callable ``(name, tensor) -> sbp``
    for per-parameter layouts (``name`` as in ``module.named_parameters()``).
    Every rank must call this with the same module structure.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}.")
    for prefix, sub in module.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            value = _convert(param.detach(), placement, _sbp_for(sbp, full, param))
            new = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            if new.requires_grad:
                keep_grad_layout(new)  # its gradient arrives in its own layout
            sub._parameters[name] = new
        for name, buf in list(sub._buffers.items()):
            if buf is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            sub._buffers[name] = _convert(buf, placement, _sbp_for(sbp, full, buf))
    return module


def _sbp_for(sbp: SbpSpec, name: str, tensor: torch.Tensor) -> Any:
    if callable(sbp) and not isinstance(sbp, (tuple, list)) and not hasattr(sbp, "is_split"):
        return sbp(name, tensor)
    return sbp


def _convert(t: torch.Tensor, placement: Placement, sbp: Any) -> GlobalTensor:
    if isinstance(t, GlobalTensor):
        return t.to_global(placement, sbp)
    return to_global(t, placement, sbp)


def _module_to_global(self: torch.nn.Module, placement: Placement, sbp: SbpSpec) -> torch.nn.Module:
    return module_to_global(self, placement, sbp)


_module_to_global.__doc__ = module_to_global.__doc__
torch.nn.Module.to_global = _module_to_global  # type: ignore[attr-defined]
