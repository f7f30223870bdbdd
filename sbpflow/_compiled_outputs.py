"""Zero gradients for the outputs of compiled regions that a backward does not reach.

# NOTE [outputs the backward does not reach]
# A compiled region runs as one autograd node (AOTAutograd's ``CompiledFunction``)
# whose outputs are the region's outputs, and its backward was traced with a
# tangent for each output that requires a gradient: a global tangent for a
# global output. A model returns more than its loss (the logits, a KV cache), and a
# backward from the loss reaches none of the others. Autograd fills their
# gradients with zeros, and on torch 2.11-2.13 those are plain tensors (only a
# nested tensor gets ``zeros_like``; pytorch/pytorch#173123). AOTAutograd then
# stops the backward with "Expected a GlobalTensor tangent but got a plain
# Tensor": it asks the *incoming* tangent to convert itself
# (``__coerce_same_metadata_as_tangent__``), and a plain tensor has no such method;
# a hook cannot help either (autograd forbids a hook to replace a missing gradient).
#
# So the missing gradients are given before autograd would make its own:
# ``GlobalTensor.backward`` walks the graph from the loss, and for every output of a
# compiled node that no node of the walk feeds, starts the backward from that
# output too (a ``GradientEdge`` root: the output itself may be gone, as an
# intermediate of an aliased output is) with a ``ZeroGradient``. That is a tensor
# holding no data whose ``__coerce_same_metadata_as_tangent__`` becomes whatever
# the compiled backward was traced with: zeros laid out as the traced global
# tangent (each rank's piece, no communication), or plain zeros for a plain output.
# An output that something does feed gets nothing extra, so no gradient is summed.
# Nor does an output no gradient can flow through (a bool mask, integer indices, an
# output AOTAutograd found not to require a gradient): the compiled node marked it
# non-differentiable, autograd gives it no gradient, and a root there trips an internal
# assert of torch's. AOTAutograd's metadata on the node's forward says which they are.
# The walk runs only while a compiled region's global output made at run time is
# alive (``CompiledRuns``); a backward that does not start at a global tensor
# (``torch.autograd.backward``/``grad`` called directly) is not walked and still
# stops at the first plain zero tangent, as DTensor's does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from . import _global
from .comm._world import get_rank

__all__ = ["CompiledRuns", "ZeroGradient", "unreached_outputs"]


class CompiledRuns:
    """The global outputs compiled regions made at run time, held weakly: while one is
    alive, a backward may reach a compiled node (NOTE [outputs the backward does not
    reach])."""

    def __init__(self) -> None:
        self._outputs: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )

    def record(self, output: torch.Tensor) -> None:
        """``output`` is being made by a compiled region (outside a backward: a compiled
        backward's gradients are not outputs)."""
        if torch._C._current_autograd_node() is None:
            self._outputs[id(output)] = output

    def __bool__(self) -> bool:
        return len(self._outputs) > 0


class ZeroGradient(torch.Tensor):
    """The zero gradient of a compiled region's output that backward does not reach: no
    data, only the logical shape, dtype and device autograd records for the output.

    A compiled backward turns it into the tangent it was traced with
    (``__coerce_same_metadata_as_tangent__``); any other use sees plain zeros, the
    gradient autograd would have made.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, shape: Any, dtype: torch.dtype, device: torch.device) -> ZeroGradient:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def plain(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(
            ZeroGradient, ZeroGradient.plain, (args, kwargs or {})
        )
        return func(*args, **kwargs)

    def __coerce_same_metadata_as_tangent__(
        self, expected: Any, expected_type: type | None = None
    ) -> torch.Tensor | None:
        if expected_type is torch.Tensor:
            return self.plain()
        if expected_type is None or not issubclass(expected_type, _global.GlobalTensor):
            return None  # another subclass's tangent: torch reports the mismatch
        layout, shape, dtype = expected[:3]  # __tensor_flatten__'s context
        local_shape = layout.local_shape(shape, get_rank())
        local = torch.zeros(local_shape, dtype=dtype, device=self.device)
        return _global.wrap(local, _global.meta_of(layout, shape, dtype))


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def _is_compiled_node(node: Any) -> bool:
    """Whether ``node`` is the backward of an AOTAutograd-compiled region."""
    forward_cls = getattr(node, "_forward_cls", None)
    return getattr(forward_cls, "_aot_id", None) is not None


# ``_differentiable`` by compiled region (its ``CompiledFunction`` class, made once per
# compiled graph, whose records do not change): a backward asks it every step.
_DIFFERENTIABLE: weakref.WeakKeyDictionary[type, list[bool]] = weakref.WeakKeyDictionary()


def _differentiable(node: Any) -> list[bool]:
    """Which leading outputs of a compiled node can take a gradient (its mutated inputs,
    then its user outputs, as AOTAutograd's ``CompiledFunction.forward`` returns them and
    marks those not requiring one non-differentiable); outputs after those (intermediate
    bases) always can."""
    forward_cls = node._forward_cls
    known = _DIFFERENTIABLE.get(forward_cls)
    if known is not None:
        return known
    try:  # AOTAutograd's own records: private, so a torch without them marks nothing
        from torch._functorch._aot_autograd.schemas import MutationType

        meta = forward_cls.metadata
        mutated = [i for i in meta.input_info if i.mutation_type == MutationType.MUTATED_OUT_GRAPH]
        known = [info.requires_grad for info in [*mutated, *meta.output_info]]
    except (ImportError, AttributeError):
        known = []
    _DIFFERENTIABLE[forward_cls] = known
    return known


def unreached_outputs(root: torch.Tensor) -> tuple[list[GradientEdge], list[ZeroGradient]]:
    """The outputs of compiled nodes that a backward from ``root`` runs but that no node of
    it feeds, with their zero gradients (NOTE [outputs the backward does not reach])."""
    start = root.grad_fn
    if start is None:
        return [], []
    compiled: list[Any] = []
    fed: set[tuple[int, int]] = {(id(start), root.output_nr)}
    # Node objects by id, held so that an id stays theirs (a C++ node's Python object
    # lives only while referenced).
    seen: dict[int, Any] = {id(start): start}
    stack = [start]
    while stack:
        node = stack.pop()
        if _is_compiled_node(node):
            compiled.append(node)
        for next_node, input_nr in node.next_functions:
            if next_node is None:
                continue
            fed.add((id(next_node), input_nr))
            if id(next_node) not in seen:
                seen[id(next_node)] = next_node
                # a leaf's accumulator feeds nothing and is no compiled node: not walked
                if type(next_node) is not _ACCUMULATE_GRAD:
                    stack.append(next_node)
    edges, zeros = [], []
    for node in compiled:
        differentiable = _differentiable(node)
        for output_nr, meta in enumerate(node._input_metadata):
            if output_nr < len(differentiable) and not differentiable[output_nr]:
                continue
            if (id(node), output_nr) not in fed:
                edges.append(GradientEdge(node, output_nr))
                zeros.append(ZeroGradient(meta.shape, meta.dtype, meta.device))
    return edges, zeros
