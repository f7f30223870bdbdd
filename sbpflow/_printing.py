"""Reading a global tensor's logical value: ``print(t)``, ``t.item()``, ``t.tolist()``, ``t.numpy()``.

# NOTE [reading values is a collective]
# The logical value is spread over ranks (split pieces, partial sums), so
# reading it gathers it to broadcast first: an all_gather / all_reduce (or
# point-to-point sends to ranks outside the placement, so that every rank gets
# the value). Like any collective, every rank must make the same call: a
# ``print(loss.item())`` under ``if rank == 0`` hangs the other ranks' peers.
# Read the local piece with ``t.to_local()`` when only this rank should look.
"""

from __future__ import annotations

from typing import Any

import torch

from ._global import GlobalTensor
from ._layout import Layout
from .boxing._redistribute import box_below_autograd
from .comm._world import get_world_size
from .placement import Placement
from .sbp import Broadcast, sbp_str

__all__ = ["global_format", "global_repr", "logical_value"]


def _reading_placement(placement: Placement) -> Placement:
    """The placement itself if it covers every rank, else all ranks (so each gets the value)."""
    world = get_world_size()
    if set(placement.flat_ranks) == set(range(world)):
        return placement
    return Placement(placement.type, list(range(world)))


def logical_value(t: GlobalTensor) -> torch.Tensor:
    """The whole logical tensor as a plain (detached) tensor on every rank. A collective."""
    target = _reading_placement(t.placement)
    dst = Layout(target, tuple(Broadcast() for _ in range(target.ndim)))
    if t._layout.normalized() == dst.normalized():
        return t._local.detach()
    return box_below_autograd(t, dst)._local.detach()


def global_repr(t: GlobalTensor) -> str:
    """``tensor([...], placement=..., sbp=...)`` with the logical value (a collective)."""
    body = torch._tensor_str._str(logical_value(t))
    assert body.endswith(")")
    extra = f", placement={t.placement!r}, sbp={sbp_str(t.sbp)}"
    if t.grad_fn is not None:
        extra += f", grad_fn=<{type(t.grad_fn).__name__}>"
    elif t.requires_grad:
        extra += ", requires_grad=True"
    return body[:-1] + extra + ")"


def global_format(t: GlobalTensor, spec: str) -> Any:
    """``format(t, spec)``: a 0-dim tensor formats its value (``f"{loss:>7f}"``)."""
    if t.dim() == 0:
        return logical_value(t).item().__format__(spec)
    if spec:
        raise TypeError(
            f"unsupported format string {spec!r} for a global tensor of shape {list(t.shape)}; "
            "only 0-dim tensors take a format spec (use f'{t.item():{spec}}' on a scalar)."
        )
    return global_repr(t)
