"""Which op outputs autograd keeps for the backward: the activations a plan's memory counts.

# NOTE [saved activations]
# An op's output stays alive through the step only if some op saves it for its backward
# (or the loss reads it): ``add`` keeps neither input, a matmul keeps each operand the other
# operand's gradient needs, ``gelu`` its input, ``rsqrt`` its output, layer norm its input
# and its mean and rstd, attention its inputs and outputs. A view keeps its base alive, so a
# saved view marks the tensor it views. Ops with no rule here are taken to save every
# floating input (an upper bound). A quotient ``a / b`` keeps its denominator whenever it
# needs a gradient at all (both operands' gradients divide by ``b``) and its numerator only
# when ``b`` needs one (``-grad * a / b**2``). Temporaries freed within the forward (the output of a
# row-parallel matmul before its all_reduce, an ``add``'s operands) are not counted.
"""

from __future__ import annotations

from ._capture import Graph, Node
from ._strategies import _base, is_view

__all__ = ["saved_outputs", "saves"]

# ops whose backward needs none of their inputs or outputs (shapes aside)
_SAVES_NOTHING = {
    "add",
    "sub",
    "neg",
    "cat",
    "stack",
    "clone",
    "contiguous",
    "mean",
    "sum",
    "_to_copy",
    "copy",
    "dropout",  # its mask is an extra output, saved below when it has one
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
}
# ops whose backward reads their result
_SAVES_OUTPUT = {"rsqrt", "sqrt", "exp", "tanh", "sigmoid", "_softmax", "softmax", "relu"}
# ops whose backward reads, for each input, the other inputs (a product's operands)
_SAVES_OTHERS = {"mm", "addmm", "bmm", "matmul", "mul", "baddbmm"}


def saves(node: Node, graph: Graph) -> tuple[list[int], list[int]]:
    """(input positions, output positions) of ``node`` its backward reads."""
    if node.kind != "op" or not node.requires_grad or is_view(node):
        return [], []
    base = _base(node.target)
    floating = [i for i, (u, o) in enumerate(node.inputs) if _floating(graph, u, o)]
    if base in _SAVES_NOTHING:
        return [], [o for o in range(1, len(node.out_shapes))]  # masks and the like
    if base in _SAVES_OUTPUT:
        return [], [0]
    if base == "native_layer_norm":
        return [0], [1, 2]  # input, mean, rstd
    if base == "div":
        return _quotient(node, graph), []
    if base == "sdpa":
        return floating, list(range(len(node.out_shapes)))
    if base in _SAVES_OTHERS:
        operands = floating[1:] if base in ("addmm", "baddbmm") else floating
        grads = [i for i in operands if graph.nodes[node.inputs[i][0]].requires_grad]
        return [i for i in operands if any(j != i for j in grads)], []
    return floating, []


def _quotient(node: Node, graph: Graph) -> list[int]:
    """Input positions ``div(a, b)`` saves: ``b`` always, ``a`` when ``b`` needs a gradient.
    A scalar denominator (``div.Scalar``: one tensor input) saves nothing."""
    if len(node.inputs) < 2:
        return []
    numerator, denominator = node.inputs[0], node.inputs[1]
    kept = [1] if _floating(graph, *denominator) else []
    if graph.nodes[denominator[0]].requires_grad and _floating(graph, *numerator):
        kept.insert(0, 0)
    return kept


def _floating(graph: Graph, u: int, o: int) -> bool:
    return graph.nodes[u].out_dtypes[o].is_floating_point


def saved_outputs(graph: Graph) -> frozenset[tuple[int, int]]:
    """Every (node, output) the backward keeps alive, the step's outputs included."""
    kept: set[tuple[int, int]] = set(graph.outputs)
    for node in graph.nodes:
        inputs, outputs = saves(node, graph)
        kept.update(node.inputs[i] for i in inputs)
        kept.update((node.index, o) for o in outputs)
    for node in reversed(graph.nodes):  # a kept view keeps its base
        if (
            is_view(node)
            and node.inputs
            and any((node.index, o) in kept for o in range(len(node.out_shapes)))
        ):
            kept.add(node.inputs[0])
    return frozenset(kept)
