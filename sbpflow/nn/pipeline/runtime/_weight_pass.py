"""The weight half of a split backward from the gradients its input half saw (NOTE [weight pass]).

# NOTE [weight pass]
# The input half I (NOTE [split backward] in _scope.py) runs the recorded loss's backward
# only as far as the tensors that crossed a placement. Every weight gradient branches off
# that path at some node of it (an "intermediate": a matmul's backward, say, whose input
# gradient I needs and whose weight gradient it skips). Before I runs, a pre-hook on each
# such node keeps the gradients the node receives; W then runs the backward from those
# nodes, with those gradients, into the weights only: of what I ran, W runs again only the
# intermediates themselves, for their weight half (torch.distributed.pipelining's
# ``stage_backward_weight`` does the same). The weights are found by walking the graph: every leaf the loss reaches (the
# parameters, their pieces, any other leaf that needs a gradient), so W accumulates into
# the same ``.grad`` as a whole backward, through their AccumulateGrad nodes and hooks.
#
# A weight's intermediates are the nodes of I's path where its branches meet that path;
# weights that share an intermediate form one group, and W runs one backward per group
# with ``inputs`` its weights, so the engine runs only the nodes between the group's
# intermediates and its weights. A weight reached from two intermediates of which one lies
# beyond the other on I's path (a weight used twice) gets the gradient of both, and W runs
# the path between them again; the farther one's pre-hook then gives back its kept
# gradients, so what arrives there from the nearer one is not counted twice. Each weight is in one group, so its gradient is
# summed inside one backward and accumulated once, as in the whole backward: gradients
# equal B's exactly. A changed placement W crosses again returns the gradient I kept.
#
# Two cases have no hook to read: a loss I never runs from (no crossed tensor lies beyond
# it: its gradient is the one it was given), and the node of a crossed tensor that I does
# not run (nothing it needs lies beyond it: its gradients are what I returned). When a
# node's kept gradients are incomplete even then, W falls back to the whole backward.
#
# NOTE [saved tensors of a split micro-batch]
# A whole backward frees each node's saved tensors as it runs it; I and W run the graph
# with ``retain_graph`` (W needs what I ran, and a group's W may run a node another group's
# W runs), and neither runs every node, while ``build``'s output (the loss) keeps the
# graph itself alive after the step. So for a micro-batch whose backward is split, ``build``
# runs under ``saved_tensors_hooks`` that keep every saved tensor in the micro-batch's
# ``SavedTensors``, emptied when W is done (``MicroBatch.release``): its activations are
# freed at W, as a whole backward frees them at B; on a rank holding several stages, each
# stage's at its own W (NOTE [weight pass on several stages] in _workers.py).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SavedTensors", "WeightPass"]


class SavedTensors:
    """The tensors a split micro-batch's graph saved (NOTE [saved tensors of a split micro-batch]),
    by window (NOTE [weight pass on several stages] in _workers.py)."""

    __slots__ = ("_entered", "_starts", "_tensors", "_window", "_windows")

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor | None] | None = []
        self._windows: list[int | None] = []  # per tensor, the window it was saved in
        self._starts: list[tuple[int, int]] = []  # (first autograd sequence number, window)
        self._window: int | None = None
        self._entered = False

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def enter(self, window: int) -> None:
        """The nodes made and tensors saved from now on (on this thread) are ``window``'s; those
        before the first window are the first's."""
        if not self._entered:
            self._windows = [window] * len(self._windows)
        self._entered = True
        self._window = window
        if _sequence_nr is not None:
            self._starts.append((_sequence_nr(), window))

    @property
    def windowed(self) -> bool:
        return self._entered

    def window_of(self, node: Node) -> int | None:
        """The window ``node`` was made in (``None`` when unknown)."""
        starts = self._starts
        if not starts:
            return None
        i = bisect.bisect_right(starts, (node._sequence_nr(), _LAST)) - 1
        return starts[max(i, 0)][1]

    def release(self, window: int) -> None:
        """Drop the tensors saved in ``window``."""
        tensors = self._tensors
        if tensors is None:
            return
        for i, w in enumerate(self._windows):
            if w == window:
                tensors[i] = None

    def _pack(self, tensor: torch.Tensor) -> int:
        tensors = self._tensors
        if tensors is None:
            raise RuntimeError("a pipelined micro-batch saved a tensor after its backward")
        tensors.append(tensor)
        self._windows.append(self._window)
        return len(tensors) - 1

    def _unpack(self, index: int) -> torch.Tensor:
        tensors = self._tensors
        tensor = tensors[index] if tensors is not None else None
        if tensor is None:
            raise RuntimeError(
                "a backward reached the graph of a pipelined micro-batch after its weight "
                "pass freed its saved tensors: a zero-bubble schedule runs each micro-batch's "
                "backward once. Do not call backward on build's outputs after the step."
            )
        return tensor

    def clear(self) -> None:
        self._tensors = None


_LAST = 1 << 62  # sorts after every window id


# The autograd sequence number the next node made on this thread gets (``None`` where this
# torch lacks it: no weight pass is then split by stage).
_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


class _Group:
    __slots__ = ("branch", "intermediates", "weights", "window")

    def __init__(self) -> None:
        self.weights: list[Node] = []
        self.intermediates: list[Node] = []
        self.branch: list[Node] = []  # the nodes between its weights and its intermediates
        self.window: int | None = None  # where it runs, with windows


class WeightPass:
    """What I keeps for W (NOTE [weight pass]): built before I, read after it."""

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        gradients: Sequence[Any],
        inputs: Sequence[Any],
        ignore: Sequence[torch.Tensor] = (),
    ) -> None:
        """``ignore``: leaves that never get a gradient (the stand-ins' anchor, NOTE [stages
        held elsewhere] in _held_elsewhere.py): not weights W runs into."""
        self.outputs = list(outputs)
        self.gradients = list(gradients)
        self.inputs = list(inputs)
        roots = [t.grad_fn for t in self.outputs if t.grad_fn is not None]
        self._consumers, self._used = _reverse_graph(roots)
        self._leaves = {id(_variable(n)): n for n in self._consumers if _is_leaf_node(n)}
        self._input_nodes = [self._node_of(t) for t in self.inputs]
        closure = _closure([n for n in self._input_nodes if n is not None], self._consumers)
        self._roots = roots
        ignored = {id(t) for t in ignore}
        leaves = [
            n for n in self._consumers if _is_leaf_node(n) and id(_variable(n)) not in ignored
        ]
        self.groups = _groups(leaves, closure | set(roots), self._consumers)
        self._kept: dict[Node, tuple[Any, ...]] = {}
        self._handles: list[Any] = []
        self._replaying = False
        self._num_groups = len(self.groups)
        self.completed = False  # I is done and every group's gradients are known

    def _node_of(self, t: Any) -> Node | None:
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return None
        return t.grad_fn if t.grad_fn is not None else self._leaves.get(id(t))

    def __enter__(self) -> WeightPass:
        for group in self.groups:
            for node in group.intermediates:
                self._handles.append(node.register_prehook(self._keeper(node)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _keeper(self, node: Node) -> Any:
        def keep(grad_outputs: tuple[Any, ...]) -> None:
            if not self._replaying:  # not a group's W run while I waits (several stages)
                self._kept[node] = tuple(grad_outputs)

        return keep

    def complete(self, input_grads: Sequence[Any]) -> bool:
        """Fill in the gradients no hook saw (of the intermediates only); ``False`` when
        some cannot be known."""
        needed = {n for g in self.groups for n in g.intermediates}
        for t, node, grad in zip(self.inputs, self._input_nodes, input_grads, strict=True):
            if node not in needed or isinstance(self._kept.get(node), tuple):
                continue
            if t.grad_fn is not None:
                self._missing(node, t.output_nr)[t.output_nr] = grad
        for t, grad in zip(self.outputs, self.gradients, strict=True):
            node = t.grad_fn
            if node not in needed or isinstance(self._kept.get(node), tuple):
                continue
            if grad is None:
                grad = torch.ones_like(t, memory_format=torch.preserve_format)
            self._missing(node, t.output_nr)[t.output_nr] = grad
        for node, grads in list(self._kept.items()):
            if isinstance(grads, list):
                if node in needed and any(grads[i] is None for i in self._used.get(node, ())):
                    return False  # an output that got a gradient in I, which nobody saw
                self._kept[node] = tuple(grads)
        self.completed = all(n in self._kept for g in self.groups for n in g.intermediates)
        return self.completed

    def _missing(self, node: Node, index: int) -> list[Any]:
        grads = self._kept.get(node)
        if not isinstance(grads, list):
            count = max(self._used.get(node, set()) | {index}) + 1
            metadata = getattr(node, "_input_metadata", None)  # one entry per output
            grads = [None] * max(count, len(metadata) if metadata is not None else 0)
            self._kept[node] = grads  # type: ignore[assignment]
        return grads

    def split(self, window_of: Callable[[Node], int | None]) -> bool:
        """Give each group the window its nodes were made in; ``False`` when a group's nodes
        span several (NOTE [weight pass on several stages] in _workers.py), or when
        ``complete`` could fail: a window is freed at its own W, before I is done, so the
        whole backward could no longer run when I's gradients turn out incomplete."""
        if not self._complete_without_hooks():
            return False
        for group in self.groups:
            nodes = group.intermediates + [n for n in group.branch if not _is_leaf_node(n)]
            windows = {window_of(n) for n in nodes}
            if len(windows) != 1 or None in windows:
                return False
            group.window = windows.pop()
        return True

    def _complete_without_hooks(self) -> bool:
        """Whether every gradient ``complete`` fills in is known: of an intermediate I may not
        run (a crossed tensor's node, an output's), each output some node uses must be one
        of the tensors I starts or ends at."""
        ends: dict[Node, set[int]] = collections.defaultdict(set)
        for t in [*self.inputs, *self.outputs]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                ends[t.grad_fn].add(t.output_nr)
        needed = {n for g in self.groups for n in g.intermediates}
        return all(self._used.get(n, set()) <= ends[n] for n in needed if n in ends)

    def run_window(self, window: int) -> bool:
        """W of one stage on a rank holding several: the groups of ``window`` whose
        intermediates I has already run (NOTE [weight pass on several stages] in
        _workers.py); returns whether none of that window is left."""
        done = True
        for group in [g for g in self.groups if g.window == window]:
            if all(isinstance(self._kept.get(n), tuple) for n in group.intermediates):
                self._run(group)
            else:
                done = False
        return done

    def run_all(self) -> None:
        """W: one backward per group left, from its intermediates into its weights."""
        for group in list(self.groups):
            self._run(group)

    @property
    def any_run(self) -> bool:
        """Whether some group has run (its weights have their gradients)."""
        return len(self.groups) < self._num_groups

    def weights(self) -> list[torch.Tensor]:
        """The weights of the groups not run yet."""
        return [_variable(node) for group in self.groups for node in group.weights]

    def _run(self, group: _Group) -> None:
        self.groups.remove(group)
        self._run_group(group)
        if not self.groups:
            self._kept = {}

    def _run_group(self, group: _Group) -> None:
        kept = self._kept
        edges, grads = [], []
        for node in group.intermediates:
            for i, grad in enumerate(kept[node]):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            return
        handles = []
        if len(group.intermediates) > 1:
            for node in group.intermediates:
                handles.append(node.register_prehook(lambda _g, saved=kept[node]: saved))
        self._replaying = True
        try:
            weights = [_variable(node) for node in group.weights]
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=weights)
        finally:
            self._replaying = False
            for handle in handles:
                handle.remove()


def _variable(node: Node) -> torch.Tensor:
    """The tensor of a leaf's AccumulateGrad node."""
    return node.variable  # type: ignore[attr-defined]


def _is_leaf_node(node: Node) -> bool:
    return hasattr(node, "variable")


def _reverse_graph(roots: list[Node]) -> tuple[dict[Node, list[Node]], dict[Node, set[int]]]:
    """Each node's consumers, and which of its outputs they use, for every node the roots reach."""
    consumers: dict[Node, list[Node]] = {}
    used: dict[Node, set[int]] = collections.defaultdict(set)
    queue: collections.deque[Node] = collections.deque()
    for root in roots:
        if root not in consumers:
            consumers[root] = []
            queue.append(root)
    while queue:
        node = queue.popleft()
        for fn, index in node.next_functions:
            if fn is None:
                continue
            used[fn].add(index)
            if fn not in consumers:
                consumers[fn] = []
                queue.append(fn)
            consumers[fn].append(node)
    return consumers, used


def _closure(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """The nodes on a path from a root to one of ``starts``."""
    seen = set(starts)
    queue = collections.deque(starts)
    while queue:
        for fn in consumers.get(queue.popleft(), ()):
            if fn not in seen:
                seen.add(fn)
                queue.append(fn)
    return seen


def _groups(
    weights: list[Node], path: set[Node], consumers: dict[Node, list[Node]]
) -> list[_Group]:
    """The weights grouped by shared intermediates (where their branches meet ``path``)."""
    order = {node: i for i, node in enumerate(consumers)}
    group_of: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for weight in weights:
        met: set[Node] = set()
        seen = {weight}
        queue = collections.deque([weight])
        while queue:
            for fn in consumers.get(queue.popleft(), ()):
                if fn in path:
                    met.add(fn)
                elif fn not in seen:
                    seen.add(fn)
                    queue.append(fn)
        joined = {id(group_of[n]): group_of[n] for n in met if n in group_of}
        group = _Group()
        group.weights.append(weight)
        group.branch.extend(seen)
        for other in joined.values():
            group.weights.extend(other.weights)
            group.branch.extend(other.branch)
            group.intermediates.extend(other.intermediates)
            groups.remove(other)
        group.intermediates.extend(
            n for n in sorted(met, key=order.__getitem__) if n not in group.intermediates
        )
        for node in group.intermediates:
            group_of[node] = group
        groups.append(group)
    return groups
