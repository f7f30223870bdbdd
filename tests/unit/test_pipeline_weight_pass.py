"""The weight half of a split backward (NOTE [weight pass] in
sbpflow/nn/pipeline/runtime/_weight_pass.py), on plain torch graphs in one process: the input
half ``torch.autograd.grad`` into the "crossed" tensors, then ``WeightPass.run``, must give
every weight exactly the gradient of one whole ``backward``, running again, of the nodes the
input half ran, only those where a weight's gradient branches off."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sbpflow.nn.pipeline.runtime._weight_pass import WeightPass

Graph = Callable[[], tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]


def _weights(seed: int, count: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(6, 6, requires_grad=True) for _ in range(count)]


def _chain() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A stage after a crossing, whose input needs a gradient, and three linears."""
    w1, w2, w3 = _weights(0, 3)
    x = torch.randn(4, 6, requires_grad=True)
    crossed = torch.relu(x @ w1) * 2  # stands for a tensor that crossed a placement
    y = torch.tanh(crossed @ w2) @ w3
    return (y**2).sum(), [crossed, x], [w1, w2, w3, x]


def _tied() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A weight used before and after the crossing (two intermediates, one beyond the other)."""
    w1, w2 = _weights(3, 2)
    x = torch.randn(4, 6, requires_grad=True)
    crossed = torch.relu(x @ w1) * 2
    y = torch.tanh(crossed @ w2) + crossed @ w1
    return (y**2).sum(), [crossed, x], [w1, w2, x]


def _first_stage() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The first stage: its input needs no gradient, so the input half runs nothing inside
    it and the crossed tensor's own node is where its weights' gradients start."""
    w1, w2 = _weights(1, 2)
    x = torch.randn(4, 6)
    crossed = torch.sigmoid(x @ w1)
    return (crossed @ w2).square().mean(), [crossed], [w1, w2]


def _reference(graph: Graph) -> list[torch.Tensor]:
    loss, _, leaves = graph()
    loss.backward()
    return [t.grad for t in leaves]


def _split(graph: Graph) -> tuple[list[torch.Tensor], int]:
    """The weights' gradients from I then W, and how many nodes W ran that I had run, other
    than the intermediates (where a weight's gradient branches off)."""
    loss, crossed, leaves = graph()
    ran_in_input: set[torch.autograd.graph.Node] = set()
    weights = WeightPass([loss], [None], crossed)
    handles = []
    seen = set()
    stack = [loss.grad_fn]
    while stack:  # a hook on every node: which ran in I, which again in W
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        handles.append(node.register_prehook(lambda g, n=node: ran_in_input.add(n)))
        stack += [fn for fn, _ in node.next_functions]
    with weights:
        grads = torch.autograd.grad([loss], crossed, retain_graph=True, allow_unused=True)
    assert weights.complete(grads)
    ran_before = set(ran_in_input)
    ran_in_input.clear()
    intermediates = {n for group in weights.groups for n in group.intermediates}
    weights.run()
    for handle in handles:
        handle.remove()
    return [t.grad for t in leaves], len(ran_before & ran_in_input - intermediates)


def test_weight_gradients_equal_one_whole_backward() -> None:
    for graph in (_chain, _tied, _first_stage):
        want = _reference(graph)
        got, _ = _split(graph)
        for g, w in zip(got, want, strict=True):
            assert g is not None and torch.equal(g, w), graph.__name__


def test_the_weight_pass_runs_again_only_where_weight_gradients_branch_off() -> None:
    for graph in (_chain, _first_stage):
        _, again = _split(graph)
        assert again == 0, (graph.__name__, again)


def test_a_gradient_nobody_saw_falls_back_to_the_whole_backward() -> None:
    """A crossed tensor whose node I does not run, with another output that got a gradient:
    its gradients are not all known, so ``complete`` says W must run the whole backward."""
    (w,) = _weights(2, 1)
    a, b = (torch.randn(4, 6) @ w).split(3)
    loss = a.sum() + (b * 3).sum()
    weights = WeightPass([loss], [None], [a])
    with weights:
        grads = torch.autograd.grad([loss], [a], retain_graph=True, allow_unused=True)
    assert not weights.complete(grads)
