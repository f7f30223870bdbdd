"""Random ops on global tensors: dropout, Bernoulli draws and in-place random fills.

# NOTE [random ops]
# A random op on a global tensor gives the logical tensor of the logical
# program: broadcast ranks the same values, split ranks different slices of
# one draw, whatever earlier ops a rank sat out (NOTE [logical random state] in
# _rng.py). Each rank claims the op's positions in the logical state and draws
# the WHOLE logical tensor with torch's own kernel (same call, dtype and shape
# as one process would make) on a generator seeded for those positions, then
# keeps its piece. So the result is a function of (seed, offset, shape) only,
# and a rank outside the placement advances the offset without drawing. The
# price is a draw of the full logical size on every rank of the placement;
# dropout masks are cheap next to the matmuls around them. A call given its own
# ``generator=`` draws from it as given (the caller keeps it in step).
#
# Random ops without a rule here (``normal.Tensor_float``, ``multinomial``,
# ...) fall back to broadcast inputs; the fallback hands them the logical
# generator too, so every rank draws the same values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import _rng
from .._compiling import compiling
from .._layout import Layout
from ..sbp import Split
from ._helpers import B, P, bind, local_piece
from ._registry import LocalContext, OpInfo, Strategy, register

aten = torch.ops.aten

__all__: list[str] = []


def logical_generator(bound: dict[str, Any], ctx: LocalContext, device: torch.device) -> Any:
    """The generator this call draws with: its own, or the logical state's next draw."""
    own = bound.get("generator")
    if own is not None:
        return own
    seed, offset = _rng.take(math.prod(ctx.input_metas[0].shape))
    return _rng.generator(seed, offset, device)


def _full(ctx: LocalContext, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(ctx.input_metas[0].shape, dtype=like.dtype, device=like.device)


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
    gen = logical_generator(bound, ctx, self.device)
    full = _full(ctx, self).bernoulli_(bound.get("p", 0.5), generator=gen)
    piece = local_piece(full, ctx.output_layouts[0], ctx.rank)
    if func is aten.bernoulli_.float:
        return self.copy_(piece)
    return piece.clone()


@register(aten.bernoulli_.float, aten.bernoulli.p, family="nn", local=_bernoulli_local)
def bernoulli_rule(info: OpInfo) -> list[Strategy]:
    """Any layout: the draw ignores the input's values (only its shape and dtype count)."""
    return _any_layout(info)


def _bernoulli_probabilities_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    p = bound["self"]  # broadcast: the whole logical tensor of probabilities
    return torch.bernoulli(p, generator=logical_generator(bound, ctx, p.device))


@register(aten.bernoulli.default, family="nn", local=_bernoulli_probabilities_local)
def bernoulli_probabilities_rule(info: OpInfo) -> list[Strategy]:
    """Probabilities per element: drawn whole on every rank (B), as one process would."""
    return [Strategy((B,), (B,))]


def _fill_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext) -> Any:
    bound = bind(func, args, kwargs)
    self = bound["self"]
    gen = logical_generator(bound, ctx, self.device)
    full = func(_full(ctx, self), *args[1:], **{**kwargs, "generator": gen})
    return self.copy_(local_piece(full, ctx.output_layouts[0], ctx.rank))


@register(
    aten.uniform_.default, aten.normal_.default, aten.random_.default, getattr(aten.random_, "from"),
    aten.random_.to, aten.exponential_.default, aten.geometric_.default,
    aten.log_normal_.default, aten.cauchy_.default, aten.bernoulli_.Tensor,
    family="nn", local=_fill_local,
)  # fmt: skip
def random_fill_rule(info: OpInfo) -> list[Strategy]:
    """The written tensor keeps its layout (``nn.init.normal_`` on a split weight);
    a probability tensor (``bernoulli_(p)``) is read whole."""
    rest = tuple(B for _ in info.inputs[1:])
    return [Strategy((info.current[0], *rest), (info.current[0],))]


def _randint_like_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    bound = bind(func, args, kwargs)
    meta, device = ctx.output_metas[0], args[0].device
    gen = logical_generator(bound, ctx, device)
    full = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    full.random_(bound.get("low", 0), bound["high"], generator=gen)
    return local_piece(full, ctx.output_layouts[0], ctx.rank)


@register(
    aten.randint_like.default, aten.randint_like.low_dtype, family="nn", local=_randint_like_local
)
def randint_like_rule(info: OpInfo) -> list[Strategy]:
    """The input as it is (its values are not read); the output follows its splits."""
    current = info.current[0]
    return [Strategy((current,), (current if isinstance(current, Split) else B,))]


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
    shape = list(ctx.input_metas[0].shape)
    starts = [a for a, _ in mask_layout.box(tuple(shape), ctx.rank)]
    # NOTE [compiled dropout]: traced, the draw is an op of the graph; eager, the same draw now
    draw = torch.ops.sbpflow.logical_bernoulli if compiling() else _bernoulli_box
    mask = draw(x, keep, shape, starts)
    scale = 0.0 if keep == 0 else 1.0 / keep
    return x * mask * scale, mask.to(torch.bool)


# NOTE [compiled dropout]
# A compiled graph cannot hold the logical random state (it advances in Python),
# so other random ops break the graph (``_rng.take``). Dropout, the one random op
# real models run every step, instead puts ``sbpflow::logical_bernoulli`` in the
# graph: an opaque op that, when the compiled graph runs, claims the positions
# and draws the whole logical mask exactly as the eager path does, then keeps
# this rank's box of it. So a compiled model draws the masks eager sbpflow draws
# from the same seed, in the order the graph runs its dropouts (the same on every
# rank: every rank runs the same graph). Tagged ``nondeterministic_seeded`` so
# that no pass merges two draws or recomputes one in the backward (the mask is
# saved for the backward like native_dropout's), and ``cudagraph_unsafe`` where
# torch has it, so that a CUDA graph never replays a draw without claiming new
# positions (``mode="reduce-overhead"`` runs it outside the captured graph).


_DRAW_TAGS = (
    torch.Tag.nondeterministic_seeded,
    # a CUDA graph would replay the draw without claiming new positions: never capture it
    *(getattr(torch.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch.Tag, name)),
)


def _bernoulli_box(
    like: torch.Tensor, keep: float, logical_shape: list[int], starts: list[int]
) -> torch.Tensor:
    """This rank's box (at ``starts``, ``like``'s shape) of a Bernoulli(``keep``) draw of
    the whole logical tensor at the program's next random positions."""
    gen = _rng.generator(*_rng.take(math.prod(logical_shape)), like.device)
    full = torch.empty(logical_shape, dtype=like.dtype, device=like.device)
    full.bernoulli_(keep, generator=gen)
    return full[tuple(slice(a, a + n) for a, n in zip(starts, like.shape, strict=True))]


@torch.library.custom_op("sbpflow::logical_bernoulli", mutates_args=(), tags=_DRAW_TAGS)
def logical_bernoulli(
    like: torch.Tensor, keep: float, logical_shape: list[int], starts: list[int]
) -> torch.Tensor:
    """``_bernoulli_box`` drawn when a compiled graph runs (NOTE [compiled dropout])."""
    return _bernoulli_box(like, keep, logical_shape, starts).clone()


@logical_bernoulli.register_fake
def _logical_bernoulli_fake(
    like: torch.Tensor, keep: float, logical_shape: list[int], starts: list[int]
) -> torch.Tensor:
    return like.new_empty(like.shape)  # contiguous, as the real op's clone of a box


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
