"""Gradient accumulation's data plumbing: cut a step's arguments into micro-batches, average what comes back.

A batch argument is any tensor (local or global) with at least one dim, found
at any depth in the positional and keyword arguments (inside tuples, lists and
dicts). Micro-batch ``k`` of a batch of ``n * m`` rows is its logical rows
``k*m .. k*m + m - 1``: for a global tensor that is a slice of the logical
tensor, whatever its layout (the view rules box when a split dim is cut), so
the micro-batches are the same on every layout and equal single-process
slicing. A 0-dim tensor and anything that is not a tensor go to every
micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MicroBatchArgs", "mean_outputs", "split_microbatches"]

MicroBatchArgs = tuple[tuple[Any, ...], dict[str, Any]]


def split_microbatches(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatches: int
) -> list[MicroBatchArgs]:
    """``num_microbatches`` (args, kwargs) pairs, each holding one micro-batch of every batch argument.

    Every batch argument is checked before any is cut, so a batch that
    ``num_microbatches`` does not divide is a ``ValueError`` naming the
    argument, its batch size and the number of micro-batches (the same on
    every rank: a global tensor's logical shape is).
    """
    if num_microbatches == 1:
        return [(args, dict(kwargs))]
    for where, tensor in _batch_arguments(args, kwargs):
        size = tensor.shape[0]
        if size % num_microbatches:
            raise ValueError(
                f"gradient accumulation cuts each batch argument into {num_microbatches} "
                f"micro-batches along dim 0, but {where} has batch size {size} (shape "
                f"{tuple(tensor.shape)}), which {num_microbatches} does not divide; pass a batch "
                f"whose size is a multiple of {num_microbatches}, or set "
                "config.set_gradient_accumulation_steps to a divisor of the batch size."
            )
    out = []
    for k in range(num_microbatches):

        def piece(t: torch.Tensor, k: int = k) -> torch.Tensor:
            size = t.shape[0] // num_microbatches
            return t.narrow(0, k * size, size)

        out.append((_map(piece, args), _map(piece, kwargs)))
    return out


def mean_outputs(outputs: list[Any]) -> Any:
    """The micro-batches' outputs of ``build`` averaged leaf by leaf, detached.

    Tensors (a loss, a metric) are averaged elementwise, in their own layout;
    so are Python numbers; tuples, lists and dicts keep their structure;
    ``None`` stays ``None``. With
    one micro-batch the output is returned detached as it is.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        total = first.detach()
        for other in outputs[1:]:
            total = total + other.detach()
        return total / len(outputs) if len(outputs) > 1 else total
    if first is None:
        return None
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(outputs) / len(outputs) if len(outputs) > 1 else first
    if isinstance(first, (tuple, list)):
        items = [mean_outputs([o[i] for o in outputs]) for i in range(len(first))]
        return _rebuild(first, items)
    if isinstance(first, dict):
        return {key: mean_outputs([o[key] for o in outputs]) for key in first}
    if len(outputs) == 1:
        return first
    raise TypeError(
        f"build returned a {type(first).__name__}; with gradient accumulation the graph averages "
        "build's outputs over the micro-batches, so return tensors (or tuples, lists or dicts of "
        "tensors), e.g. the loss."
    )


def _batch_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """Every batch argument, with a readable path to it."""
    found = []
    for i, value in enumerate(args):
        found += _batch_tensors(value, f"positional argument {i}")
    for key, value in kwargs.items():
        found += _batch_tensors(value, f"keyword argument {key!r}")
    return found


def _batch_tensors(tree: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor with at least one dim in ``tree``."""
    if isinstance(tree, torch.Tensor):
        return [(where, tree)] if tree.dim() > 0 else []
    if isinstance(tree, (tuple, list)):
        return [hit for i, item in enumerate(tree) for hit in _batch_tensors(item, f"{where}[{i}]")]
    if isinstance(tree, dict):
        return [hit for k, v in tree.items() for hit in _batch_tensors(v, f"{where}[{k!r}]")]
    return []


def _map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to each tensor with at least one dim."""
    if isinstance(tree, torch.Tensor):
        return fn(tree) if tree.dim() > 0 else tree
    if isinstance(tree, (tuple, list)):
        return _rebuild(tree, [_map(fn, item) for item in tree])
    if isinstance(tree, dict):
        return {key: _map(fn, value) for key, value in tree.items()}
    return tree


def _rebuild(like: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    """A tuple, named tuple or list of ``items``, the same kind as ``like``."""
    if isinstance(like, list):
        return items
    return type(like)(*items) if hasattr(like, "_fields") else tuple(items)
