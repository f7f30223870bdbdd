"""Peak bytes per rank over one training step: what is held at the worst point of the step.

# NOTE [peak memory]
# Parameters, optimizer state, inputs and buffers are held through the whole step. On top
# of them the step's peak is the largest of three kinds of point:
# - the loss's backward, the backward's first work: every activation the backward keeps
#   (NOTE [saved activations] in _saved.py), no parameter gradient yet, and the loss's
#   working set. The plan does not see the loss; it is taken to be elementwise on each
#   output and reduced to a scalar (a mean square, a cross-entropy): its backward holds the
#   reduction's gradient expanded to the output's whole shape (the expand of a broadcast
#   scalar: whole on every rank) and ``LOSS_TEMPORARIES`` tensors of the output's local size
#   (``pow(2).mean()`` measured 4: ``x ** 1``, two products, and the boxing of the whole
#   gradient to the output's layout).
# - the backward of op k: the activations kept by ops up to k (a kept tensor is taken to
#   live until the backward passes its producer: an upper bound, as the op that saved it
#   may come later and free it earlier), the gradients of the parameters whose last reader
#   (directly or through views) is at or after k (their gradient exists from that reader's
#   backward on), and op k's working set: the gradients of its outputs and of its inputs
#   (in their gradient layouts), and each input gradient boxed to the layout its producer
#   sums it in (none for a view, whose backward views its gradient). An input an op saves
#   and reads in another layout than it arrives in is kept boxed too, beside the input
#   (boxed at a module boundary, the copy is what autograd saves). An output several ops
#   read, boxed once to a distribution layout other than its own (NOTE [shared outputs] in
#   _solve.py), is kept in that layout too where the backward keeps it: on a 2x2 mesh the
#   batch split on axis 0, boxed at the model's input to split on both axes for the first
#   norm and residual, measured that copy (0.25 MiB) over the prediction. The search, whose rows
#   see one op's strategy at a time, counts none of these copies, but the parameters op k reads in
#   the layout it reads them in (a gathered weight).
# - the optimizer's update: every parameter gradient, and ``UPDATE_TEMPORARIES`` tensors of
#   the parameter being updated (AdamW's single-tensor step: ``sqrt`` then a quotient).
# Where ``fully_shard``'s runtime runs a module (NOTE [fully sharded modules of a plan] in
# _api.py), the backward of an op inside it holds the module's gathered parameters and
# those of the module gathered one ahead (the one before it). Known only once the plan is
# chosen, these and the boxed copies are in the plan's prediction, not in the search's
# bound: where they take the plan over its budget, ``auto_parallel`` searches again under
# a bound lowered by the difference, and at last takes the first plan found (or the
# fastest of the smallest bound) with its parameters gathered op by op, where that fits. On the bench's models the measured peak was the loss's
# backward: ``pow(2).mean()`` of 4096 x 64 rows split over 2 ranks held 3.0 MiB there,
# which the earlier count (every kept tensor and every gradient at once, nothing else) left
# out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..sbp import NdSbp, Split, broadcast
from ._capture import Graph, Node
from ._costs import local_bytes
from ._saved import saves
from ._strategies import Strategy, is_view

if TYPE_CHECKING:
    from ._solve import Problem

__all__ = [
    "LOSS_TEMPORARIES",
    "MIB",
    "UPDATE_TEMPORARIES",
    "add_peak",
    "last_readers",
    "peak_bytes",
]

LOSS_TEMPORARIES = 4  # tensors of an output's local size the loss's backward holds
UPDATE_TEMPORARIES = 2  # tensors of a parameter's local size its update holds

MIB = 2**20  # the program's rows count MiB: HiGHS' tolerances see numbers near one


def last_readers(graph: Graph) -> dict[int, int]:
    """Per parameter node read by some op, the last op (node index) reading it or a view
    of it: its gradient exists from that op's backward on."""
    root: dict[int, int] = {}  # node -> the parameter it is (a view of)
    last: dict[int, int] = {}
    for node in graph.nodes:
        if node.kind == "param":
            root[node.index] = node.index
        if node.kind != "op":
            continue
        for u, _ in node.inputs:
            if u in root:
                last[root[u]] = node.index
        if is_view(node) and node.inputs and node.inputs[0][0] in root:
            root[node.index] = root[node.inputs[0][0]]
    return last


def _param_of(graph: Graph) -> dict[int, int]:
    """Node -> the parameter it is or views."""
    root: dict[int, int] = {}
    for node in graph.nodes:
        if node.kind == "param":
            root[node.index] = node.index
        elif is_view(node) and node.inputs and node.inputs[0][0] in root:
            root[node.index] = root[node.inputs[0][0]]
    return root


def held_bytes(node: Node, strategy: Strategy, problem: Problem) -> float:
    """Bytes held through the step: a parameter and its optimizer state, an input, a buffer."""
    if node.kind not in ("param", "buffer", "input"):
        return 0.0
    size = local_bytes(
        node.out_shapes[0], node.out_dtypes[0], strategy.outputs[0], problem.prices.mesh
    )
    if node.kind == "param" and node.requires_grad:
        return (1 + problem.optimizer_states) * size
    return size


def grad_bytes(node: Node, strategy: Strategy, problem: Problem) -> float:
    """Bytes of a trained parameter's gradient, in the parameter's layout."""
    if node.kind != "param" or not node.requires_grad:
        return 0.0
    return local_bytes(
        node.out_shapes[0], node.out_dtypes[0], strategy.outputs[0], problem.prices.mesh
    )


def kept_bytes(node: Node, strategy: Strategy, problem: Problem) -> float:
    """Bytes of an op's outputs the backward keeps (NOTE [saved activations])."""
    if node.kind != "op" or is_view(node):
        return 0.0
    mesh = problem.prices.mesh
    return sum(
        local_bytes(shape, dtype, layout, mesh)
        for o, (shape, dtype, layout) in enumerate(
            zip(node.out_shapes, node.out_dtypes, strategy.outputs, strict=True)
        )
        if (node.index, o) in problem.saved
    )


def working_bytes(
    node: Node,
    strategy: Strategy,
    problem: Problem,
    params: dict[int, int],
    gathered: Iterable[int] = (),
    edge: Callable[[int, int], tuple[NdSbp, NdSbp]] | None = None,
) -> float:
    """Bytes op ``node``'s backward holds beside what the step keeps: its outputs' and
    inputs' gradients. Without ``edge``: every parameter it reads, in the layout it reads
    it in (the search's count), but those of ``gathered`` (and their views), read in their
    modules' gathered copies. With ``edge(u, o)`` giving the layout an input arrives in and
    the one its gradient is summed in: each input gradient boxed to another layout."""
    if node.kind != "op" or not node.requires_grad or is_view(node):
        return 0.0
    graph, mesh = problem.graph, problem.prices.mesh
    total = sum(
        local_bytes(shape, dtype, layout, mesh)
        for shape, dtype, layout in zip(
            node.out_shapes, node.out_dtypes, strategy.out_grads, strict=True
        )
        if dtype.is_floating_point
    )
    skip = set(gathered)
    for i, (u, o) in enumerate(node.inputs):
        producer = graph.nodes[u]
        shape, dtype = producer.out_shapes[o], producer.out_dtypes[o]
        needs_grad = producer.requires_grad and dtype.is_floating_point
        if needs_grad:
            total += local_bytes(shape, dtype, strategy.grads[i], mesh)
        if edge is None:
            if u in params and params[u] not in skip:
                total += local_bytes(shape, dtype, strategy.inputs[i], mesh)
        elif needs_grad and edge(u, o)[1] != strategy.grads[i]:
            total += local_bytes(shape, dtype, edge(u, o)[1], mesh)
    return total


def boxed_kept_bytes(
    node: Node,
    strategy: Strategy,
    problem: Problem,
    params: dict[int, int],
    gathered: Iterable[int],
    edge: Callable[[int, int], tuple[NdSbp, NdSbp]],
) -> float:
    """Bytes of the inputs op ``node`` saves for its backward and reads in another layout
    than they arrive in (``edge(u, o)[0]``): the boxed copy is kept too (boxed at a module
    boundary, it is what autograd saves), beside the input (but parameters of
    ``gathered``, read in their modules' gathered copies)."""
    if node.kind != "op" or not node.requires_grad or is_view(node):
        return 0.0
    graph, mesh, skip = problem.graph, problem.prices.mesh, set(gathered)
    total = 0.0
    for i in saves(node, graph)[0]:
        u, o = node.inputs[i]
        if params.get(u) in skip or edge(u, o)[0] == strategy.inputs[i]:
            continue
        shape, dtype = graph.nodes[u].out_shapes[o], graph.nodes[u].out_dtypes[o]
        total += local_bytes(shape, dtype, strategy.inputs[i], mesh)
    return total


def distributed_kept_bytes(
    node: Node,
    strategy: Strategy,
    problem: Problem,
    params: dict[int, int],
    edge: Callable[[int, int], tuple[NdSbp, NdSbp]],
) -> float:
    """Bytes of the copies of ``node``'s kept outputs boxed once to a distribution layout
    ``edge(u, o)[0]`` other than their own (NOTE [shared outputs] in _solve.py; boxed at a
    module boundary, the readers save that copy, which ``boxed_kept_bytes`` compares
    against): taken to live as long as the output (an upper bound). Not a parameter's,
    which each reader boxes for itself."""
    if node.index in params:
        return 0.0
    mesh = problem.prices.mesh
    total = 0.0
    for o, (shape, dtype) in enumerate(zip(node.out_shapes, node.out_dtypes, strict=True)):
        given = edge(node.index, o)[0]
        if (node.index, o) in problem.saved and given != strategy.outputs[o]:
            total += local_bytes(shape, dtype, given, mesh)
    return total


def loss_bytes(graph: Graph, output: tuple[int, int], layout: NdSbp, mesh: Any) -> float:
    """The loss's backward working set for one output in ``layout``."""
    shape, dtype = (
        graph.nodes[output[0]].out_shapes[output[1]],
        graph.nodes[output[0]].out_dtypes[output[1]],
    )
    if not dtype.is_floating_point:
        return 0.0
    whole = math.prod(shape) * dtype.itemsize
    return whole + LOSS_TEMPORARIES * local_bytes(shape, dtype, layout, mesh)


def gathered_bytes(node: Node, layout: NdSbp, mesh: Any) -> float:
    """Bytes of a parameter stored in ``layout`` once gathered on the data axis (axis 0)."""
    whole = (broadcast, *layout[1:]) if isinstance(layout[0], Split) else layout
    return local_bytes(node.out_shapes[0], node.out_dtypes[0], whole, mesh)


def peak_bytes(
    problem: Problem,
    chosen: Callable[[int], Strategy],
    edge: Callable[[int, int], tuple[NdSbp, NdSbp]],
    sharded: Iterable[tuple[str, tuple[int, ...]]] = (),
) -> float:
    """The step's peak bytes per rank with every node's strategy ``chosen(n)``, output
    ``(u, o)`` handed to its readers in ``edge(u, o)[0]`` and its gradient summed in
    ``edge(u, o)[1]``; ``sharded`` lists the modules ``fully_shard``'s runtime runs
    (innermost first), each with its parameter nodes (NOTE [peak memory])."""
    graph, mesh = problem.graph, problem.prices.mesh
    params = _param_of(graph)
    last = last_readers(graph)
    modules = list(sharded)
    gathered = {
        module: sum(gathered_bytes(graph.nodes[p], chosen(p).outputs[0], mesh) for p in nodes)
        for module, nodes in modules
    }
    skip = [p for _, nodes in modules for p in nodes]  # read in their gathered modules
    root = gathered.pop("", 0.0)  # gathered from its forward to its backward
    inner = [m for m in modules if m[0]]
    order = [module for module, _ in _backward_order(graph, inner)]
    # the module gathered one ahead in the backward: the one before it in the forward
    ahead = dict(itertools.pairwise(order))
    held = sum(held_bytes(n, chosen(n.index), problem) for n in graph.nodes)
    grads_from: dict[int, float] = {}
    for p, k in last.items():
        grads_from[k] = grads_from.get(k, 0.0) + grad_bytes(graph.nodes[p], chosen(p), problem)
    kept = [
        kept_bytes(n, chosen(n.index), problem)
        + boxed_kept_bytes(n, chosen(n.index), problem, params, skip, edge)
        + distributed_kept_bytes(n, chosen(n.index), problem, params, edge)
        for n in graph.nodes
    ]
    total_kept = sum(kept)
    loss = sum(
        loss_bytes(graph, out, chosen(out[0]).outputs[out[1]], mesh) for out in graph.outputs
    )
    worst = total_kept + loss + root
    kept_before = total_kept  # kept by ops up to k
    grads = 0.0  # gradients of parameters last read at or after k
    for node in reversed(graph.nodes):
        grads += grads_from.get(node.index, 0.0)
        if node.kind == "op" and node.requires_grad:
            module = _innermost(node.module, inner)
            extra = root
            if module is not None:
                extra += gathered[module] + (gathered[ahead[module]] if module in ahead else 0.0)
            work = working_bytes(node, chosen(node.index), problem, params, skip, edge)
            worst = max(worst, kept_before + grads + work + extra)
        kept_before -= kept[node.index]
    trained = [n for n in graph.nodes if n.index in last]
    update = max((grad_bytes(n, chosen(n.index), problem) for n in trained), default=0.0)
    worst = max(worst, grads + UPDATE_TEMPORARIES * update)
    return held + worst


def add_peak(program: Any, problem: Problem, offset: dict[int, int]) -> int:
    """Add to ``program`` a continuous column bounding the step's peak in MiB from above
    (the search's side of NOTE [peak memory], without ``fully_shard``'s modules); returns
    it. Each node's strategy is its representative's one-hot choice at ``offset``.

    A chain column per backward point holds the kept activations and the gradients alive
    there (each row sparse: the next point's column less what the backward freed in
    between, plus the gradients it made), so the rows stay linear in the graph's size.
    """
    graph, mesh = problem.graph, problem.prices.mesh
    params = _param_of(graph)
    last = last_readers(graph)
    grads_at: dict[int, list[int]] = {}
    for p, k in last.items():
        grads_at.setdefault(k, []).append(p)

    def linear(
        n: int, price: Callable[[Node, Strategy], float], sign: float = 1.0
    ) -> dict[int, float]:
        rep = problem.reps[n]
        node = graph.nodes[n]
        values = [price(node, strategy) for strategy in problem.choices[rep]]
        return {offset[rep] + s: sign * v / MIB for s, v in enumerate(values) if v}

    def add(*parts: dict[int, float]) -> dict[int, float]:
        total: dict[int, float] = {}
        for part in parts:
            for col, value in part.items():
                total[col] = total.get(col, 0.0) + value
        return {col: value for col, value in total.items() if value}

    peak, held = program.continuous(), program.continuous()
    program.equal(
        add(
            {held: -1.0},
            *(linear(n.index, lambda v, s: held_bytes(v, s, problem)) for n in graph.nodes),
        )
    )

    def at_most_peak(*parts: dict[int, float]) -> None:  # peak >= held + parts
        program.at_least(
            add({peak: 1.0, held: -1.0}, *({c: -v for c, v in part.items()} for part in parts))
        )

    def kept(n: int, sign: float) -> dict[int, float]:
        return linear(n, lambda v, s: kept_bytes(v, s, problem), sign)

    # the loss's backward: every kept activation and the loss's working set
    alive = program.continuous()  # kept activations and gradients at the current point
    program.equal(add({alive: -1.0}, *(kept(n.index, 1.0) for n in graph.nodes)))
    outputs = [
        linear(u, lambda v, s, o=o: loss_bytes(graph, (v.index, o), s.outputs[o], mesh))
        for u, o in graph.outputs
    ]
    at_most_peak({alive: 1.0}, *outputs)
    for node in reversed(graph.nodes):  # the backward, op by op
        made = [
            linear(p, lambda v, s: grad_bytes(v, s, problem)) for p in grads_at.get(node.index, [])
        ]
        if made:
            before, alive = alive, program.continuous()
            program.equal(add({alive: -1.0, before: 1.0}, *made))
        if node.kind == "op" and node.requires_grad:
            at_most_peak(
                {alive: 1.0}, linear(node.index, lambda v, s: working_bytes(v, s, problem, params))
            )
        freed = kept(node.index, -1.0)
        if freed:
            before, alive = alive, program.continuous()
            program.equal(add({alive: -1.0, before: 1.0}, freed))
    # the optimizer's update: every gradient and the temporaries of one parameter's update
    for p in sorted({problem.reps[p] for p in last}):
        at_most_peak(
            {alive: 1.0}, linear(p, lambda v, s: UPDATE_TEMPORARIES * grad_bytes(v, s, problem))
        )
    return peak


def _innermost(path: str, modules: list[tuple[str, tuple[int, ...]]]) -> str | None:
    for module, _ in modules:  # innermost first
        if not module or path == module or path.startswith(module + "."):
            return module
    return None


def _backward_order(
    graph: Graph, modules: list[tuple[str, tuple[int, ...]]]
) -> list[tuple[str, tuple[int, ...]]]:
    """``modules`` by the first op the forward runs in each, the last first."""
    first: dict[str, int] = {}
    for node in graph.nodes:
        if node.kind == "op":
            module = _innermost(node.module, modules)
            if module is not None:
                first.setdefault(module, node.index)
    return sorted(modules, key=lambda m: -first.get(m[0], -1))
