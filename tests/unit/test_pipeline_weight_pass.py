"""The weight half of a split backward (NOTE [weight pass] in
sbpflow/nn/pipeline/runtime/_weight_pass.py), on plain torch graphs in one process: the input
half ``torch.autograd.grad`` into the "crossed" tensors, then ``WeightPass.run_all``, must give
every weight exactly the gradient of one whole ``backward``, running again, of the nodes the
input half ran, only those where a weight's gradient branches off."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sbpflow.nn.pipeline.runtime._weight_pass import SavedTensors, WeightPass

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
    weights.run_all()
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


def _two_windows(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor], SavedTensors]:
    """Two stages on one thread, each a window of its own; ``shared``: the second stage
    uses the first's weight again (one leaf in both windows)."""
    w1, w2 = _weights(4, 2)
    saved = SavedTensors()
    x = torch.randn(4, 6, requires_grad=True)
    with saved.hooks():
        saved.enter(0)
        h = torch.tanh(x @ w1)
        saved.enter(1)
        y = torch.tanh(h @ (w1 if shared else w2))
        loss = (y**2).sum()
    return loss, [x, w1, w2], saved


def test_a_weight_pass_splits_by_window_and_frees_each_window() -> None:
    """Two windows (NOTE [weight pass on several stages] in
    sbpflow/nn/pipeline/runtime/_workers.py): each group runs in the window its nodes were
    made in, the weights get the gradients of one whole backward, and a window's saved
    tensors, once freed, cannot be read again; a weight used in both windows cannot be
    split."""
    loss, leaves, _ = _two_windows(False)
    loss.backward()
    want = [t.grad for t in leaves]
    loss, leaves, saved = _two_windows(False)
    x, w1, w2 = leaves
    weights = WeightPass([loss], [None], [x])
    assert weights.split(saved.window_of)
    assert sorted(g.window for g in weights.groups) == [0, 1]
    with weights:
        grads = torch.autograd.grad([loss], [x], retain_graph=True)
    assert weights.complete(grads)
    assert not weights.any_run
    assert weights.run_window(1)  # the second stage's W
    assert weights.any_run and not any(t is w2 for t in weights.weights())  # w2's group ran
    assert w1.grad is None and torch.equal(w2.grad, want[2])
    saved.release(1)
    weights.run_all()  # the last W: what is left
    assert torch.equal(w1.grad, want[1])
    try:
        torch.autograd.grad([loss], [w2], retain_graph=True)
    except RuntimeError as error:
        assert "freed its saved tensors" in str(error)
    else:
        raise AssertionError("a freed window's saved tensors were read")
    loss, leaves, saved = _two_windows(True)
    assert not WeightPass([loss], [None], [leaves[0]]).split(saved.window_of)


def test_a_window_is_not_split_off_when_a_gradient_nobody_saw_could_be_missing() -> None:
    """The first stage ends in two pieces of one split, one crossing as it is and one through
    another op (whose node I does not run): I cannot know the split's gradient for the second
    piece, and a window freed at its own W could not be run again by the whole backward, so
    the weight pass is not split by window."""
    (w1, w2) = _weights(5, 2)
    saved = SavedTensors()
    x = torch.randn(4, 6)
    with saved.hooks():
        saved.enter(0)
        a, b = (x @ w1).split(2)
        b3 = b * 3
        saved.enter(1)
        loss = ((a @ w2) ** 2).sum() + ((b3 @ w2) ** 2).sum()
    weights = WeightPass([loss], [None], [a, b3])
    assert not weights.split(saved.window_of)
    with weights:
        grads = torch.autograd.grad([loss], [a, b3], retain_graph=True)
    assert not weights.complete(grads)  # what splitting would have run into
