"""Small tools shared by the view and nn rule modules.

Rules name their inputs by schema argument (``{"input": S(0), "weight": B}``)
rather than by position, because optional tensors (a missing bias, an absent
class weight) drop out of ``OpInfo.inputs`` and shift every later position.
``local`` functions that need a collective (batch-norm statistics, a loss's
global count) box a small partial tensor to broadcast through the boxing
executor, so only ``sbpflow.comm`` ever calls ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten_with_path

from .. import _global
from .._layout import Layout, local_piece
from ..boxing._redistribute import box_below_autograd
from ..sbp import Broadcast, Partial, SbpParallel, Split
from ._registry import OpInfo, Strategy, TensorMeta, bind

__all__ = [
    "B",
    "P",
    "bind",
    "box_to",
    "gather_splits",
    "inputs_by_name",
    "local_piece",
    "masked_outputs",
    "normalize_dim",
    "strategy",
    "sum_partials",
]

B = Broadcast()
P = Partial("sum")

SbpChoice = SbpParallel | Sequence[SbpParallel] | Callable[[int], SbpParallel]


def _arg_name(func: Any, path: tuple[Any, ...]) -> tuple[str, int]:
    """Schema name of a flattened leaf of ``(args, kwargs)``, and its index inside a list."""
    where, key = path[0], path[1]
    assert isinstance(where, SequenceKey)
    if where.idx == 0:
        assert isinstance(key, SequenceKey)
        name = func._schema.arguments[key.idx].name
    else:
        assert isinstance(key, MappingKey)
        name = str(key.key)
    item = path[2].idx if len(path) > 2 and isinstance(path[2], SequenceKey) else 0
    return name, item


def inputs_by_name(info: OpInfo, table: Mapping[str, SbpChoice]) -> tuple[SbpParallel, ...]:
    """One SBP per global input, looked up by schema argument name.

    A value is an SBP, a sequence of SBPs (per element of a tensor-list
    argument) or a callable of the element index. Inputs not in ``table`` are B.
    """
    out: list[SbpParallel] = []
    for path, leaf in tree_flatten_with_path((info.args, info.kwargs))[0]:
        if not isinstance(leaf, TensorMeta):
            continue
        name, item = _arg_name(info.func, path)
        choice = table.get(name, B)
        if callable(choice) and not isinstance(choice, SbpParallel):
            out.append(choice(item))
        elif isinstance(choice, SbpParallel):
            out.append(choice)
        else:
            out.append(choice[item])
    return tuple(out)


def strategy(
    info: OpInfo, table: Mapping[str, SbpChoice], outputs: Sequence[SbpParallel]
) -> Strategy:
    """A strategy from inputs named by schema argument and outputs in order.

    ``outputs`` may list more SBPs than the op returned tensors (outputs an
    ``output_mask`` switched off): only as many as there are tensor outputs are used.
    """
    return Strategy(inputs_by_name(info, table), tuple(outputs[: len(info.outputs)]))


def masked_outputs(
    info: OpInfo, sbps: Sequence[SbpParallel], mask: Sequence[bool] | None
) -> tuple[SbpParallel, ...]:
    """The SBPs of the tensor outputs of an op with an ``output_mask``.

    Outputs the mask switches off come back as None and drop out of
    ``info.outputs``, except where the op's meta kernel still returns them all
    (batch norm's backward): then every output keeps its SBP, and the ``local``
    function must return them all as well.
    """
    if mask is None or len(info.outputs) == len(sbps):
        return tuple(sbps)
    return tuple(s for s, keep in zip(sbps, mask, strict=True) if keep)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


# -- local helpers ------------------------------------------------------------------


def box_to(local: torch.Tensor, layout: Layout, shape: Sequence[int], dst: Layout) -> torch.Tensor:
    """This rank's piece after boxing a global tensor (``local`` laid out as ``layout``,
    logical ``shape``) to ``dst``. Not differentiable: ``local`` functions run below autograd."""
    if layout == dst:
        return local
    return box_below_autograd(
        _global.GlobalTensor(local.contiguous(), layout, tuple(shape)), dst
    )._local


def gather_splits(layout: Layout) -> Layout:
    """``layout`` with every split axis made broadcast (partial axes stay partial)."""
    return Layout(layout.placement, tuple(B if isinstance(s, Split) else s for s in layout.sbp))


def sum_partials(layout: Layout) -> Layout:
    """``layout`` with every partial axis made broadcast (an all-reduce of those axes)."""
    return Layout(layout.placement, tuple(B if isinstance(s, Partial) else s for s in layout.sbp))
