"""Reading a global tensor's logical value: ``print(t)``, ``t.item()``, ``t.tolist()``, ``t.numpy()``.

# NOTE [reading values is a collective]
# The logical value is spread over ranks (split pieces, partial sums), so
# reading it gathers it to broadcast first: an all_gather / all_reduce (or
# point-to-point sends to ranks outside the placement, so that every rank gets
# the value). Like any collective, every rank must make the same call: a
# ``print(loss.item())`` under ``if rank == 0`` hangs the other ranks' peers.
# Read the local piece with ``t.to_local()`` when only this rank should look.
# A read that only some ranks make is an error on every rank, naming each
# rank's call and line, at once or (if a peer is busy elsewhere) at the
# collective timeout (NOTE [call agreement] in _meta_check.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _meta_check
from ._bounded import BoundedDict
from ._layout import Layout
from .boxing._redistribute import box_below_autograd
from .comm._world import get_world_size
from .placement import Placement
from .sbp import Broadcast, sbp_str

if TYPE_CHECKING:
    from ._global import GlobalTensor

__all__ = ["global_format", "global_repr", "logical_value"]


def _reading_placement(placement: Placement) -> Placement:
    """The placement itself if it covers every rank, else all ranks (so each gets the value)."""
    world = get_world_size()
    if set(placement.flat_ranks) == set(range(world)):
        return placement
    return Placement(placement.type, list(range(world)))


def _agree_on_reading(t: GlobalTensor, call: str) -> None:
    """Every rank must be reading this tensor at this line (NOTE [call agreement])."""
    key = (t._layout, tuple(t.shape), t.dtype)
    mine = _reading_metas.get(key)
    if mine is None:
        mine = _reading_metas[key] = _meta_check.RankMeta(
            error=None,
            dtype=t.dtype,
            shape=tuple(t.shape),
            placement=repr(t.placement),
            sbp=sbp_str(t.sbp),
            in_placement=False,  # differs by rank and is not compared
        )
    _meta_check.agree(mine, call)


# The encoded metadata of tensors read before (a training loop reads the same loss shape).
READING_METAS_BOUND = 1024
_reading_metas: BoundedDict[Any, _meta_check.RankMeta] = BoundedDict(
    "reading meta checks", READING_METAS_BOUND
)


def logical_value(t: GlobalTensor, call: str = "print()") -> torch.Tensor:
    """The whole logical tensor as a plain (detached) tensor on every rank. A collective.

    ``call`` names the user's call reading it (``item()``, ``tolist()``, ...) in errors.
    """
    _agree_on_reading(t, call)
    target = _reading_placement(t.placement)
    dst = Layout(target, tuple(Broadcast() for _ in range(target.ndim)))
    if t._layout.normalized() == dst.normalized():
        return t._local.detach()
    return box_below_autograd(t, dst)._local.detach()


def _without_data(local: torch.Tensor) -> bool:
    """A piece with no values to read: a meta tensor, or a fake or functional one while
    torch.compile or another tracer builds a graph (they print their tensors' metadata)."""
    return local.is_meta or is_fake(local) or torch.compiler.is_compiling()


def global_repr(t: GlobalTensor) -> str:
    """``tensor([...], placement=..., sbp=...)`` with the logical value (a collective).

    While a tracer runs (the piece is fake or meta) there is no value to gather: the text
    shows the metadata only, ``tensor(..., size=(4, 8), placement=..., sbp=...)``, as torch
    prints a meta tensor, and no rank communicates.
    """
    if _without_data(t._local):
        dtype = "" if t.dtype == torch.get_default_dtype() else f", dtype={t.dtype}"
        body = f"tensor(..., size={tuple(t.shape)}{dtype})"
    else:
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
        return logical_value(t, "format()").item().__format__(spec)
    if spec:
        raise TypeError(
            f"unsupported format string {spec!r} for a global tensor of shape {list(t.shape)}; "
            "only 0-dim tensors take a format spec (use f'{t.item():{spec}}' on a scalar)."
        )
    return global_repr(t)
