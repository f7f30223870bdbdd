"""Dropout and Bernoulli draws whose values do not depend on the layout.

# NOTE [random ops]
# A random op on a global tensor must give the logical tensor one process
# would draw: broadcast ranks the same mask, split ranks different slices of
# that one mask. Each rank draws the WHOLE logical mask with torch's own
# generator, exactly as a single process would (same call, same dtype, same
# shape), and keeps its piece. So with ``torch.manual_seed(s)`` on every rank
# (``sbpflow.manual_seed`` does that) the result equals a single-process run's
# slice bit for bit, and the ranks' generators stay in step. The price is a
# draw of the full logical size on every rank; dropout masks are cheap next to
# the matmuls around them. A rank outside the placement skips the op and so
# does not advance its generator.
"""

from __future__ import annotations

from typing import Any

import torch

from .._layout import Layout
from ..sbp import Split
from ._helpers import B, P, bind, local_piece
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__: list[str] = []


def _draw(shape: tuple[int, ...], like: torch.Tensor, p: float, generator: Any) -> torch.Tensor:
    """The full logical Bernoulli(p) draw, as a single process would make it."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(
        p, generator=generator
    )


def _any_layout(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    k = len(info.outputs)
    out = [Strategy((Split(d),), (Split(d),) * k) for d in range(ndim)]
    return [*out, Strategy((B,), (B,) * k), Strategy((P,), (P,) * k)]


def _bernoulli_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    self = bound["self"]
    full = _draw(ctx.input_metas[0].shape, self, bound.get("p", 0.5), bound.get("generator"))
    piece = local_piece(full, ctx.output_layouts[0], ctx.rank)
    if func is aten.bernoulli_.float:
        return self.copy_(piece)
    return piece.clone()


@register(aten.bernoulli_.float, aten.bernoulli.p, family="nn", local=_bernoulli_local)
def bernoulli_rule(info: OpInfo) -> list[Strategy]:
    """Any layout: the draw ignores the input's values (only its shape and dtype count)."""
    return _any_layout(info)


@register(aten.bernoulli.default, family="nn")
def bernoulli_probabilities_rule(info: OpInfo) -> list[Strategy]:
    """Probabilities per element: drawn whole on every rank (B), as one process would."""
    return [Strategy((B,), (B,))]


def _native_dropout_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    x, p = bound["input"], bound["p"]
    if bound.get("train") is False:
        return func(*args, **kwargs)
    keep = 1.0 - p
    # The mask is cut like the input on split axes and whole on partial ones: every
    # partial piece is masked the same way, so their sum is masked.
    layout = ctx.input_layouts[0]
    mask_layout = Layout(layout.placement, tuple(B if s.is_partial else s for s in layout.sbp))
    mask = local_piece(_draw(ctx.input_metas[0].shape, x, keep, None), mask_layout, ctx.rank)
    scale = 0.0 if keep == 0 else 1.0 / keep
    return x * mask * scale, mask.to(torch.bool)


@register(aten.native_dropout.default, family="nn", local=_native_dropout_local)
def native_dropout_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    out = [Strategy((Split(d),), (Split(d), Split(d))) for d in range(ndim)]
    return [*out, Strategy((B,), (B, B)), Strategy((P,), (P, B))]


@register(aten.native_dropout_backward.default, family="nn")
def native_dropout_backward_rule(info: OpInfo) -> list[Strategy]:
    ndim = info.inputs[0].ndim
    out = [Strategy((Split(d), Split(d)), (Split(d),)) for d in range(ndim)]
    return [*out, Strategy((B, B), (B,)), Strategy((P, B), (P,))]
