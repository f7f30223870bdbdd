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
#
# NOTE [crossing hooks]
# While step hooks are installed (NOTE [step hooks] in sbpflow/_step_context.py),
# ``Redistribute`` shows them each change of placement it makes (a crossing):
# in forward ``crossing_forward`` sees the input and picks the transport of its
# move (NOTE [transports] in executor.py), and in backward the gradient of a
# crossing goes to ``crossing_backward``, which moves it back to the input's
# layout (boxing it first, running ``Redistribute`` and ``box_below_autograd``
# with a transport of its choice) or returns a gradient it computed before. The
# hooks' backward is looked up when the backward runs, so it is that of the pass
# running it. A move given a transport is not shown to the hooks again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _global, _meta_check, _step_context
from .._bounded import BoundedDict
from .._compiling import graph_break
from .._layout import Layout
from ..comm._mesh import MESHES
from ..comm._world import get_rank
from ..placement import Placement
from ..sbp import SbpParallel, normalize, sbp_str
from . import executor
from .planner import plan

if TYPE_CHECKING:
    from .._global import GlobalTensor

__all__ = ["Redistribute", "box_below_autograd", "to_global"]


def to_global(
    x: GlobalTensor,
    placement: Placement | None,
    sbp: SbpParallel | Sequence[SbpParallel] | None,
    *,
    check_meta: bool,
) -> GlobalTensor:
    """``x.to_global(placement, sbp)``: boxing, differentiable (``GlobalTensor.to_global``)."""
    if torch.compiler.is_compiling():
        return _box_between_graphs(x, placement, sbp, check_meta=check_meta)
    return _box(x, placement, sbp, check_meta=check_meta)


@graph_break(
    "sbpflow: to_global on a global tensor runs between graphs; the boxing the ops inside a "
    "compiled function need is compiled into its graph."
)
def _box_between_graphs(
    x: GlobalTensor,
    placement: Placement | None,
    sbp: SbpParallel | Sequence[SbpParallel] | None,
    *,
    check_meta: bool,
) -> GlobalTensor:
    return _box(x, placement, sbp, check_meta=check_meta)


def _box(
    x: GlobalTensor,
    placement: Placement | None,
    sbp: SbpParallel | Sequence[SbpParallel] | None,
    *,
    check_meta: bool,
) -> GlobalTensor:
    if placement is not None and not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}. Build one with sbpflow.placement('cpu', ranks)."
        )
    if placement is None:
        placement = x.placement
    if sbp is None:
        if placement.ndim != x.placement.ndim:
            raise ValueError(
                f"to_global(placement={placement}) changes the mesh from {x.placement.ndim} "
                f"to {placement.ndim} axes, so the SBP cannot be kept; pass sbp= as well."
            )
        sbp = x.sbp
    dst = Layout(placement, normalize(sbp, placement.ndim, x.ndim))
    if check_meta:
        _check_boxing_meta(x, dst)
    if dst == x._layout:
        return x
    if placement.type != x.placement.type:
        # NOTE [device moves] in _devices: the same ranks and SBP on the other device type
        # (a local copy, differentiable), then boxing between placements of one type.
        moved = cast(_global.GlobalTensor, x.to(placement.type))
        return moved.to_global(placement, dst.sbp, check_meta=False)
    MESHES.of(placement, "to_global")  # its groups, made up front on every rank (NOTE [meshes])
    return Redistribute.apply(x, dst)


def _check_boxing_meta(x: GlobalTensor, dst: Layout) -> None:
    """Every rank must box the same (layout, shape, dtype) to the same destination."""
    if not _meta_check.boxing_agreement.get():
        return  # NOTE [boxing agreement turned off]
    key = (x._layout, dst, tuple(x.shape), x.dtype)
    mine = _boxing_metas.get(key)
    if mine is None:
        mine = _meta_check.RankMeta(
            error=None,
            dtype=x.dtype,
            shape=tuple(x.shape),
            placement=f"{x.placement} -> {dst.placement}",
            sbp=f"{sbp_str(x.sbp)} -> {sbp_str(dst.sbp)}",
            in_placement=False,  # differs by rank and is not compared: keep vectors equal
        )
        _boxing_metas[key] = mine
    _meta_check.agree(mine, "to_global (boxing)")


# The encoded metadata of boxing calls seen before: a training loop repeats the
# same conversions, and encoding (string hashing) costs more than the exchange.
BOXING_METAS_BOUND = 1024
_boxing_metas: BoundedDict[Any, _meta_check.RankMeta] = BoundedDict(
    "boxing meta checks", BOXING_METAS_BOUND
)


def box_below_autograd(
    x: GlobalTensor, dst: Layout, transport: executor.Transport | None = None
) -> GlobalTensor:
    """``x`` laid out as ``dst`` (same logical value); not differentiable. Every rank calls it.

    A change of placement goes through ``transport`` (NOTE [transports] in executor.py).
    """
    boxing_plan = plan(tuple(x.shape), x.dtype, x._layout, dst)
    local = executor.execute(boxing_plan, x._local, get_rank(), transport)
    return _global.GlobalTensor(local, dst, x.shape)


class Redistribute(torch.autograd.Function):
    """Forward: boxing src -> dst. Backward: the gradient boxed back to src's layout."""

    @staticmethod
    def forward(
        ctx: Any, x: GlobalTensor, dst: Layout, transport: executor.Transport | None = None
    ) -> GlobalTensor:
        ctx.src, ctx.dst, ctx.hooked = x._layout, dst, False
        if transport is None and x.placement != dst.placement:
            hooks = _step_context.current.get()
            if hooks is not None:  # NOTE [crossing hooks]
                ctx.hooked = True
                transport = hooks.crossing_forward(ctx, x, dst)
        return box_below_autograd(x, dst, transport)

    @staticmethod
    def backward(ctx: Any, grad: GlobalTensor) -> tuple[GlobalTensor, None, None]:
        grad = _global.as_global_grad(grad, "boxing")
        hooks = _step_context.current.get() if ctx.hooked else None
        if hooks is None:
            return Redistribute.apply(grad, ctx.src), None, None
        return hooks.crossing_backward(ctx, grad), None, None
