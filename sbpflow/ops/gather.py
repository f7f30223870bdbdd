"""``gather`` and ``scatter_add`` (gather's backward): a split index picks from a whole source.

# NOTE [gather splits]
# ``out = gather(self, dim, index)`` has the index's shape; along ``dim``
# ``out[.., j, ..] = self[.., index[.., j, ..], ..]`` and along every other
# dim ``d`` position ``i`` of ``out`` reads position ``i`` of ``self`` (the
# index may be shorter there than ``self``). On one mesh axis:
#   self S(d), index S(d)  -> S(d)  d != dim, self and index equally long on d
#   self B,    index S(d)  -> S(d)  any d: each rank gathers its part of the
#                                   index from the whole source; for d != dim
#                                   the local source is narrowed to the rows
#                                   the rank's index covers (the local function
#                                   does this for every dim, on any mesh)
#   self P,    index B     -> P     gather is linear in self
#   B, B                   -> B
# ``scatter_add(self, dim, index, src)`` adds ``src`` into ``self`` at the
# index's positions (gather's backward: a zero tensor, then scatter_add of the
# gradient). It is linear in (self, src) jointly:
#   self, index, src S(d)  -> S(d)  d != dim, all three equally long on d
#   self P, index S(dim), src S(dim) -> P   each rank adds its part of src; the
#                                   ranks' results sum to self plus all of it
#                                   (index and src equally long on dim)
#   self P, index B, src P -> P
#   B, B, B                -> B
"""

from __future__ import annotations

from typing import Any

import torch

from ..sbp import Split
from ._helpers import B, P, bind, normalize_dim, strategy
from ._registry import LocalContext, OpInfo, Strategy, TensorMeta, register

aten = torch.ops.aten

__all__: list[str] = []


def _metas(info: OpInfo, names: tuple[str, ...]) -> list[TensorMeta] | None:
    """The named arguments' metadata, or None when one is not a global tensor (a plain
    0-dim tensor: the op is then on 0-dim tensors, and only broadcast applies)."""
    bound = info.bound()
    found = [bound.get(name) for name in names]
    if not all(isinstance(m, TensorMeta) for m in found):
        return None
    return found  # type: ignore[return-value]


def _gather_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: LocalContext
) -> Any:
    """The kernel on this rank's index, with the source narrowed (off ``dim``) to the rows that
    index covers: position ``i`` of the output reads position ``i`` of the source."""
    bound = bind(func, args, kwargs)
    source, index = bound["self"], bound["index"]
    if len(ctx.input_metas) != 2 or source.dim() == 0:
        return func(*args, **kwargs)
    dim = normalize_dim(bound["dim"], source.dim())
    source_box = ctx.input_layouts[0].box(ctx.input_metas[0].shape, ctx.rank)
    index_box = ctx.input_layouts[1].box(ctx.input_metas[1].shape, ctx.rank)
    for d in range(source.dim()):
        start, stop = index_box[d]
        offset = start - source_box[d][0]
        if d != dim and (offset, stop - start) != (0, source.shape[d]):
            assert offset >= 0 and stop <= source_box[d][1], "the rule keeps the rows local"
            source = source.narrow(d, offset, stop - start)
    return func(source, bound["dim"], index, sparse_grad=bound["sparse_grad"])


@register(aten.gather.default, family="views", local=_gather_local)
def gather_rule(info: OpInfo) -> list[Strategy]:
    metas = _metas(info, ("self", "index"))
    if metas is None:
        return [strategy(info, {}, (B,))]
    source, index = metas
    dim = normalize_dim(info.arg(1, "dim"), source.ndim)
    out = [
        strategy(info, {"self": Split(d), "index": Split(d)}, (Split(d),))
        for d in range(source.ndim)
        if d != dim and source.shape[d] == index.shape[d] > 0
    ]
    out += [
        strategy(info, {"index": Split(d)}, (Split(d),))
        for d in range(index.ndim)
        if index.shape[d] > 0
    ]
    out.append(strategy(info, {"self": P}, (P,)))
    out.append(strategy(info, {}, (B,)))
    return out


@register(aten.scatter_add.default, aten.scatter_add_.default, family="views")
def scatter_add_rule(info: OpInfo) -> list[Strategy]:
    metas = _metas(info, ("self", "index", "src"))
    if metas is None:
        return [strategy(info, {}, (B,))]
    target, index, src = metas
    dim = normalize_dim(info.arg(1, "dim"), target.ndim)
    out = [
        strategy(info, {"self": Split(d), "index": Split(d), "src": Split(d)}, (Split(d),))
        for d in range(target.ndim)
        if d != dim and target.shape[d] == index.shape[d] == src.shape[d] > 0
    ]
    if index.shape[dim] == src.shape[dim] > 0:
        out.append(strategy(info, {"self": P, "index": Split(dim), "src": Split(dim)}, (P,)))
    out.append(strategy(info, {"self": P, "src": P}, (P,)))
    out.append(strategy(info, {}, (B,)))
    return out
