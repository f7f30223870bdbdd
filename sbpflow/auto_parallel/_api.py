"""``auto_parallel``: capture the step, list the strategies, solve, and write the plan down."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..boxing.cost import CostModel
from ..boxing.plan import BoxingStep, _fmt_bytes
from ..nn.parallel._buckets import assign_buckets
from ..nn.parallel._reducer import FIRST_BUCKET_BYTES
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Partial, Split, normalize, sbp_str
from ._capture import SDPA, Graph, capture
from ._costs import (
    BUCKET_CAP_BYTES,
    ComputeModel,
    Prices,
    local_bytes,
    optimizer_ops,
    optimizer_states,
)
from ._peak import peak_bytes
from ._plan import Boundary, Collective, Memory, OpChoice, ParamLayout, Plan, ShardedModule
from ._saved import saved_outputs
from ._solve import Problem, Solution, node_bytes, output_seconds, solve
from ._strategies import Strategy, strategies, unsupported

__all__ = ["auto_parallel", "reprice"]

# searches under a lowered budget where fully_shard's gathered modules take a plan over it
_BUDGET_TRIES = 4


def auto_parallel(
    model: torch.nn.Module,
    placement: Placement,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    memory_budget: float | None = None,
    fixed: Mapping[str | int, Any] | None = None,
    optimizer: str | int | None = "adamw",
    cost_model: CostModel | None = None,
    compute_model: ComputeModel | None = None,
) -> Plan:
    """Choose every parameter's and input's layout on ``placement`` for one training step.

    The forward of ``model(*example_inputs)`` is captured on meta tensors (no data, no
    process group); every op's candidate strategies are priced (compute from FLOPs and
    bytes, boxing forward and backward by the boxing planner's cost model) and the cheapest
    whole-step choice is found by an integer linear program (HiGHS), with repeated blocks
    sharing decisions. ``memory_budget`` (bytes per rank) bounds parameters, gradients,
    ``optimizer`` state ("adamw"/"adam": 2 tensors per parameter, "sgd": 0,
    "sgd_momentum": 1, or a number) and activations. ``fixed`` pins layouts:
    ``{"fc1.weight": broadcast, 0: (split(0), broadcast)}`` (parameter names, or input
    positions). Prices use the default constants unless ``cost_model`` / ``compute_model``
    are given, so every rank and machine makes the same plan.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}: {model!r}.")
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be a sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}; e.g. sbpflow.placement('cpu', [[0, 1], [2, 3]])."
        )
    inputs = _inputs(example_inputs)
    if memory_budget is not None and (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, (int, float))
        or memory_budget <= 0
    ):
        raise ValueError(
            f"memory_budget must be a positive number of bytes per rank or None, got "
            f"{memory_budget!r}; e.g. memory_budget=8 * 2**30."
        )
    states = optimizer_states(optimizer)
    graph = capture(model, inputs)
    prices = Prices(placement, cost_model, compute_model, optimizer_ops(optimizer))
    reps = [n.tie if n.tie >= 0 else n.index for n in graph.nodes]
    pins = _pins(fixed, graph, placement, reps)
    choices = {}
    for rep in sorted(set(reps)):
        node = graph.nodes[rep]
        options = strategies(node, placement.shape)
        if rep in pins:
            options = [s for s in options if s.outputs[0] == pins[rep]]
            if not options:
                raise ValueError(
                    f"fixed layout {sbp_str(pins[rep])} for {node.target} of shape "
                    f"{list(node.out_shapes[0])} does not divide it evenly on a mesh of shape "
                    f"{list(placement.shape)}; pin a layout whose split dims divide evenly."
                )
        choices[rep] = options
    problem = Problem(graph, reps, choices, prices, states, saved_outputs(graph))
    bound, found = memory_budget, []
    for _ in range(_BUDGET_TRIES):
        solution = solve(problem, bound)
        if solution is None:
            break
        found.append(solution)
        plan = _plan(problem, solution, memory_budget)
        if memory_budget is None or plan.memory.peak <= memory_budget:
            return plan
        # the plan's own prediction (its boxed copies, fully_shard's gathered modules) is
        # over the budget: search again with the bound lowered by the difference (NOTE
        # [peak memory] in _peak.py)
        bound -= plan.memory.peak - memory_budget
    smallest = solve(problem, None, objective="memory")
    if smallest is not None:  # the fastest plan of the smallest bound
        fastest = solve(problem, smallest.bytes_per_rank + 1.0)
        found += [fastest] if fastest is not None else []
    peak = math.inf
    for solution in found:  # with parameters gathered op by op, then the smallest
        plan = _plan(problem, solution, memory_budget, fully_shard=False)
        if plan.memory.peak <= memory_budget:
            return plan
        peak = min(peak, plan.memory.peak)
    footprint = "unknown" if smallest is None else f"{peak:.0f} bytes"
    shown = "" if smallest is None else f" ({_fmt_bytes(peak)})"
    raise ValueError(
        f"memory_budget={memory_budget:.0f} bytes per rank cannot be met: the smallest "
        f"footprint found is {footprint}{shown} per rank at its peak (parameters, gradients, "
        "optimizer state, activations and the backward's buffers). Raise the budget, use more ranks, "
        "or a smaller batch."
    )


def reprice(
    plan: Plan,
    model: torch.nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    optimizer: str | int | None = "adamw",
    cost_model: CostModel | None = None,
    compute_model: ComputeModel | None = None,
) -> Plan:
    """``plan``'s layouts, op by op, priced with other constants: what the plan is predicted
    to cost where these prices hold (e.g. ``calibrate_compute`` and
    ``sbpflow.boxing.calibrate``'s model, measured on this machine).

    ``model`` and ``example_inputs`` must be those the plan was made for. Every op keeps
    its planned strategy; only where a tensor read by several ops is boxed for all of them
    (and its gradients summed) is chosen again, as the search chooses it under the new prices
    (the cheapest).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan from auto_parallel, got {type(plan).__name__}.")
    inputs = _inputs(example_inputs)
    graph = capture(model, inputs)
    placement = plan.placement
    prices = Prices(placement, cost_model, compute_model, optimizer_ops(optimizer))
    reps = [n.tie if n.tie >= 0 else n.index for n in graph.nodes]
    planned: dict[int, tuple[Any, ...]] = {op.index: (op.inputs, op.outputs) for op in plan.ops}
    for name, layout in plan.param_sbp.items():
        if name in graph.param_nodes:
            planned[graph.param_nodes[name]] = ((), (layout,))
    for n, layout in zip(graph.input_nodes, plan.input_sbp, strict=False):
        planned[n] = ((), (layout,))
    choices = {}
    for rep in sorted(set(reps)):
        node = graph.nodes[rep]
        options = strategies(node, placement.shape)
        if rep in planned:
            want_in, want_out = planned[rep]
            options = [
                s
                for s in options
                if s.outputs == want_out and (node.kind != "op" or s.inputs == want_in)
            ]
        if not options:
            raise ValueError(
                f"the plan's layout of {node.target} (node {rep}) is not a strategy of this "
                "model's step: reprice takes the model and example inputs the plan was made for."
            )
        choices[rep] = options
    problem = Problem(
        graph, reps, choices, prices, optimizer_states(optimizer), saved_outputs(graph)
    )
    solution = solve(problem, None)
    assert solution is not None  # no budget: every choice is feasible
    return _plan(problem, solution, plan.memory_budget)


def _inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and all(
        isinstance(x, torch.Tensor) for x in example_inputs
    ):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of tensors (the model's positional "
        f"arguments), got {type(example_inputs).__name__}: {example_inputs!r}."
    )


def _pins(
    fixed: Mapping[str | int, Any] | None, graph: Graph, placement: Placement, reps: list[int]
) -> dict[int, NdSbp]:
    if fixed is None:
        return {}
    if not isinstance(fixed, Mapping):
        raise TypeError(
            f"fixed must be a dict of parameter names / input positions -> sbp, got "
            f"{type(fixed).__name__}: {fixed!r}."
        )
    pins: dict[int, NdSbp] = {}
    for key, value in fixed.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(graph.input_nodes):
                raise ValueError(
                    f"fixed names input {key}, but the model takes {len(graph.input_nodes)} inputs."
                )
            node = graph.input_nodes[key]
        elif isinstance(key, str) and key.startswith("input") and key[5:].isdigit():
            node = graph.input_nodes[int(key[5:])] if int(key[5:]) < len(graph.input_nodes) else -1
            if node < 0:
                raise ValueError(
                    f"fixed names {key!r}, but the model takes {len(graph.input_nodes)} inputs."
                )
        elif isinstance(key, str) and key in graph.param_nodes:
            node = graph.param_nodes[key]
        else:
            known = sorted(graph.param_nodes)[:6]
            raise ValueError(
                f"fixed names {key!r}, which is neither a parameter of the model nor an input "
                f"position; expected a name such as {known} or an int input position."
            )
        layout = normalize(value, placement.ndim, len(graph.nodes[node].out_shapes[0]))
        _untie(reps, node)  # a pinned tensor decides apart from its repeated block
        pins[node] = layout
    return pins


def _untie(reps: list[int], node: int) -> None:
    others = [n for n, rep in enumerate(reps) if rep == reps[node] and n != node]
    if others and reps[node] == node:  # the others keep their shared decision
        for n in others:
            reps[n] = others[0]
    reps[node] = node


def _collectives(
    steps: tuple[BoxingStep, ...],
    phase: str,
    shape: tuple[int, ...],
    tensor: str,
    bucketed: Callable[[BoxingStep], bool] = lambda step: False,
) -> list[Collective]:
    return [
        Collective(
            phase,
            s.op,
            s.axes,
            s.bytes_per_rank,
            s.cost,
            shape,
            str(s.src),
            str(s.dst),
            tensor,
            bucketed(s),
        )
        for s in steps
    ]


def _into_parameter(
    prices: Prices,
    layout: NdSbp | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    param: int,
    bucketed: list[tuple[tuple[int, ...], float, int]],
) -> Callable[[BoxingStep], bool]:
    """Which steps of a gradient's boxing into parameter node ``param`` laid out ``layout``
    (``None``: not a parameter) the data-parallel buckets run (NOTE [bucketed gradients]);
    each such step is noted in ``bucketed`` (axes, gradient bytes, parameter)."""
    num_bytes = 0.0 if layout is None else prices.gradient_bytes(shape, dtype, layout)

    def into(step: BoxingStep) -> bool:
        if layout is None or prices.bucket_discount(step, layout, num_bytes) <= 0:
            return False
        bucketed.append((step.axes, num_bytes, param))
        return True

    return into


def _plan(
    problem: Problem, solution: Solution, budget: float | None, fully_shard: bool = True
) -> Plan:
    """The plan of ``solution``; ``fully_shard=False`` runs no module with ``fully_shard``'s
    runtime (its parameters gathered op by op, as the search's peak counts them)."""
    graph, prices = problem.graph, problem.prices
    mesh = prices.mesh

    def chosen(n: int) -> Strategy:
        rep = problem.reps[n]
        return problem.choices[rep][solution.chosen[rep]]

    def name_of(n: int) -> str:
        node = graph.nodes[n]
        return node.target if node.kind != "op" else f"{node.module or '(root)'}:{node.target}"

    ops = []
    bucketed: list[tuple[tuple[int, ...], float, int]] = []
    boxing_seconds = 0.0
    activations = 0.0
    for node in graph.nodes:
        strategy = chosen(node.index)
        if node.kind in ("input", "buffer"):
            activations += node_bytes(node, strategy, problem)
        if node.kind != "op":
            continue
        collectives: list[Collective] = []
        for i, (u, o) in enumerate(node.inputs):
            producer = graph.nodes[u]
            out_layout = chosen(u).outputs[o]
            shape, dtype = producer.out_shapes[o], producer.out_dtypes[o]
            source = solution.distribute.get((problem.reps[u], o), out_layout)
            steps = prices.boxing(shape, dtype, source, strategy.inputs[i])[1]
            collectives += _collectives(steps, "forward", shape, name_of(u))
            grad_layout = strategy.grads[i]
            target = solution.accumulate.get((problem.reps[u], o))
            if target is None:
                if not (producer.requires_grad and dtype.is_floating_point):
                    continue
                target = chosen(u).out_grads[o]
            steps = prices.boxing(shape, dtype, grad_layout, target)[1]
            into = (
                target
                if producer.kind == "param" and (problem.reps[u], o) not in solution.accumulate
                else None
            )
            collectives += _collectives(
                steps,
                "backward",
                shape,
                name_of(u) + " gradient",
                _into_parameter(prices, into, shape, dtype, u, bucketed),
            )
        boxing_seconds += sum(c.seconds for c in collectives)
        act = node_bytes(node, strategy, problem)
        activations += act
        ops.append(
            OpChoice(
                node.index,
                node.target,
                node.module,
                strategy.inputs,
                strategy.outputs,
                prices.compute_seconds(node, strategy),
                act,
                tuple(collectives),
                unsupported(node),
                node.in_shapes,
            )
        )
    output_sbp = []
    output_collectives: list[Collective] = []
    for u, o in graph.outputs:
        layout, needs = chosen(u).outputs[o], chosen(u).out_grads[o]
        seconds, target = output_seconds(graph, prices, (u, o), layout, needs)
        boxing_seconds += seconds
        output_sbp.append(target)
        shape, dtype = graph.nodes[u].out_shapes[o], graph.nodes[u].out_dtypes[o]
        output_collectives += _collectives(
            prices.boxing(shape, dtype, layout, target)[1], "forward", shape, "output"
        )
        if graph.nodes[u].requires_grad:
            steps = prices.boxing(shape, dtype, target, needs)[1]
            output_collectives += _collectives(steps, "backward", shape, "output gradient")
    producer_collectives: list[Collective] = []
    for node in graph.nodes:
        for o, (shape, dtype) in enumerate(zip(node.out_shapes, node.out_dtypes, strict=True)):
            spread = solution.distribute.get((problem.reps[node.index], o))
            if spread is not None:
                steps = prices.boxing(shape, dtype, chosen(node.index).outputs[o], spread)[1]
                producer_collectives += _collectives(
                    steps, "forward", shape, name_of(node.index) + " (for all its readers)"
                )
            summed = solution.accumulate.get((problem.reps[node.index], o))
            if summed is not None:
                target = chosen(node.index).out_grads[o]
                steps = prices.boxing(shape, dtype, summed, target)[1]
                producer_collectives += _collectives(
                    steps,
                    "backward",
                    shape,
                    name_of(node.index) + " summed gradient",
                    _into_parameter(
                        prices,
                        target if node.kind == "param" else None,
                        shape,
                        dtype,
                        node.index,
                        bucketed,
                    ),
                )
    boxing_seconds += sum(c.seconds for c in producer_collectives)
    params = []
    param_bytes = grad_bytes = optimizer = 0.0
    counted = set()
    for name, n in graph.param_nodes.items():
        node = graph.nodes[n]
        layout = chosen(n).outputs[0]
        size = local_bytes(node.out_shapes[0], node.out_dtypes[0], layout, mesh)
        params.append(ParamLayout(name, node.out_shapes[0], node.out_dtypes[0], layout, size))
        if n not in counted:
            counted.add(n)
            param_bytes += size
            grad_bytes += size if node.requires_grad else 0.0
            optimizer += prices.optimizer_seconds(node, chosen(n))
    fully_sharded = _fully_sharded(problem, solution) if fully_shard else ()

    def edge(u: int, o: int) -> tuple[NdSbp, NdSbp]:
        key = (problem.reps[u], o)
        given = solution.distribute.get(key, chosen(u).outputs[o])
        return given, solution.accumulate.get(key, chosen(u).out_grads[o])

    sharded = [
        (m.module, tuple(graph.param_nodes[name] for name in m.params)) for m in fully_sharded
    ]
    memory = Memory(
        param_bytes,
        grad_bytes,
        grad_bytes * problem.optimizer_states,
        activations,
        peak_bytes(problem, chosen, edge, sharded),
    )
    compute = sum(prices.compute_seconds(n, chosen(n.index)) for n in graph.nodes)
    # the plan's own account of its costs is the program's objective, where parameter
    # gradients' all_reduces are priced as buckets (NOTE [bucketed gradients in the search])
    searched = (
        compute + boxing_seconds - _search_bucket_savings(bucketed, prices, problem, solution)
    )
    assert abs(searched - solution.seconds) <= 1e-6 * max(solution.seconds, 1e-9), (
        searched,
        solution.seconds,
    )
    return Plan(
        bucket_savings_seconds=_bucket_savings(bucketed, prices, graph),
        boundaries=_boundaries(problem, solution, tuple(output_sbp)),
        fully_sharded=fully_sharded,
        placement=prices.placement,
        params=tuple(params),
        input_sbp=tuple(chosen(n).outputs[0] for n in graph.input_nodes),
        output_sbp=tuple(output_sbp),
        ops=tuple(ops),
        output_collectives=tuple(output_collectives),
        producer_collectives=tuple(producer_collectives),
        memory=memory,
        compute_seconds=compute,
        boxing_seconds=boxing_seconds,
        optimizer_seconds=optimizer,
        memory_budget=budget,
        num_variables=solution.num_variables,
        num_constraints=solution.num_constraints,
        num_tied=sum(1 for n in graph.nodes if n.tie >= 0),
        solve_seconds=solution.solve_seconds,
    )


# NOTE [bucketed gradients]
# The plan lists each parameter gradient's all_reduce on its own (``Collective``, priced one
# by one): its layout decides whether there is one. At run time data-parallel buckets
# (nn/parallel/_reducer.py) all-reduce the gradients of one group of ranks together, in
# backward order: a first bucket of ``FIRST_BUCKET_BYTES``, then ``DEFAULT_BUCKET_CAP_MB``
# each, one collective and one eager launch per bucket. So the predicted step counts each
# bucket's fixed cost (latency rounds, step overhead, the eager work of a boxing step) once;
# the bytes cost the same either way. The search prices them the same way, linearised (NOTE
# [bucketed gradients in the search] in _costs.py); the predicted step counts the buckets
# exactly.


def _by_axes(
    bucketed: Sequence[tuple[tuple[int, ...], float, int]],
) -> dict[tuple[int, ...], list[tuple[float, int]]]:
    found: dict[tuple[int, ...], list[tuple[float, int]]] = {}
    for axes, num_bytes, param in bucketed:
        found.setdefault(axes, []).append((num_bytes, param))
    return found


def _search_bucket_savings(
    bucketed: Sequence[tuple[tuple[int, ...], float, int]],
    prices: Prices,
    problem: Problem,
    solution: Solution,
) -> float:
    """What the search's linearised buckets take off the one-by-one prices."""
    saved = 0.0
    for axes, found in _by_axes(bucketed).items():
        fixed = prices.bucket_fixed_seconds(axes)
        saved += sum(fixed * (1.0 - b / BUCKET_CAP_BYTES) for b, _ in found) - fixed
        last = solution.bucket_last.get(axes)
        ahead = sum(b for b, _ in found) - next(
            (b for b, n in found if problem.reps[n] == last), 0.0
        )
        if ahead >= FIRST_BUCKET_BYTES:
            saved -= fixed  # a second bucket
    return saved


def _bucket_savings(
    bucketed: Sequence[tuple[tuple[int, ...], float, int]], prices: Prices, graph: Graph
) -> float:
    """Seconds saved by all-reducing parameter gradients in buckets instead of one by one,
    with the buckets the runtime fills (``assign_buckets``, in backward order)."""
    order = {n: k for k, n in enumerate(graph.param_nodes.values())}
    saved = 0.0
    for axes, found in _by_axes(bucketed).items():
        fixed = prices.bucket_fixed_seconds(axes)
        launch = sorted(found, key=lambda entry: order.get(entry[1], 0), reverse=True)
        entries = [(axes, int(b)) for b, _ in launch]
        buckets = assign_buckets(entries, int(BUCKET_CAP_BYTES), FIRST_BUCKET_BYTES)
        saved += (len(found) - len(buckets)) * fixed
    return saved


def _boundaries(
    problem: Problem, solution: Solution, output_sbp: tuple[NdSbp, ...]
) -> tuple[Boundary, ...]:
    """Each module input and output the plan lays out (NOTE [following the plan]).

    A tensor read by one op is boxed to that op's input layout, its gradient to the layout
    its producer needs; one read by several, to the shared layout it is spread from (its
    gradient, at a module's input, to the layout the readers' gradients are summed in; at
    the producing module's output, to the producer's); a step output, to the layout it is
    handed to the loss in. A module called several times with different layouts gets none.
    """
    graph = problem.graph
    chosen = _chosen_strategy(problem, solution)
    readers = _readers(graph)
    outputs = {ref: k for k, ref in enumerate(graph.outputs)}

    def layouts(ref: tuple[int, int], where: str, module: str) -> tuple[NdSbp, NdSbp | None] | None:
        u, o = ref
        node = graph.nodes[u]
        if node.kind not in ("op", "input"):
            return None
        strategy = chosen(u)
        key = (problem.reps[u], o)
        grad = strategy.out_grads[o]
        if not (node.requires_grad and node.out_dtypes[o].is_floating_point):
            grad = None  # type: ignore[assignment]
        found = readers.get(ref, [])
        if key in solution.distribute:
            if where == "output":
                return solution.distribute[key], grad
            summed = solution.accumulate.get(key, grad) if grad is not None else None
            inside = [(v, i) for v, i in found if _within(graph.nodes[v].module, module)]
            if len(inside) == 1:  # the module's one reader: straight to its layout
                return chosen(inside[0][0]).inputs[inside[0][1]], summed
            return solution.distribute[key], summed
        if len(found) == 1:
            v, i = found[0]
            return chosen(v).inputs[i], grad
        if ref in outputs:
            return output_sbp[outputs[ref]], grad
        return strategy.outputs[o], None

    found: list[Boundary] = []
    for module, calls in graph.module_io.items():
        per_call = []
        for call in calls:
            entries = []
            for where, refs in zip(("input", "output"), call, strict=True):
                for position, tensor in enumerate(refs):
                    laid = None if tensor is None else layouts(tensor, where, module)
                    if tensor is not None and laid is not None:
                        shape = graph.nodes[tensor[0]].out_shapes[tensor[1]]
                        entries.append(
                            Boundary(module, where, position, len(refs), shape, laid[0], laid[1])
                        )
            per_call.append(tuple(entries))
        if per_call and all(entries == per_call[0] for entries in per_call):
            found += per_call[0]
    return tuple(found)


def _within(path: str, module: str) -> bool:
    return not module or path == module or path.startswith(module + ".")


# NOTE [fully sharded modules of a plan]
# A plan that stores a parameter split on the data axis (the placement's axis 0) and has
# every op that reads it read it broadcast there (gathered whole right before use, its
# gradient reduce-scattered back to the split) has chosen ZeRO-3 / FSDP for it. Boxed op
# by op, that gather runs inside each reading op, synchronously, and again in the backward
# (autograd saves the op's input as passed, split). ``fully_shard``'s runtime does the same
# moves better: one all_gather per module, started one module ahead, and one flat
# reduce_scatter overlapping the backward. So the plan lists such parameters by module
# (``ShardedModule``) and ``Plan.apply`` hands them to that runtime, which frees them after
# the forward and gathers them again, one module ahead, for the backward: the plan counts
# no memory for a gathered parameter (the view that reads it is not kept), so the peak stays
# that of the op-by-op gathers, and the second all_gather, which the plan does not price
# (as it did not price the op-by-op one), overlaps the backward of the module after it.
# A parameter qualifies when it is one module's alone (not tied), no later axis splits its
# dim (``fully_shard`` gathers on axis 0 alone, NOTE [fully sharded layouts] in
# nn/parallel/_fsdp_param.py), and every reader inside that module reads it broadcast on
# axis 0, directly or through ops of one input that keep it split there (a transpose, a
# view: those run on the gathered parameter, left to propagation). Freed after the forward,
# the gathered parameter must not outlive its module: every op that reads it, or a view of
# it (followed through every op whose schema may return an input or a view of one), runs
# inside the module, and neither it nor such a view is an output of the module or of the
# model (a module returning ``self.weight.unsqueeze(0)`` or ``(y, self.weight.t())`` keeps
# its parameter on the op-by-op path). An op that computes a new tensor (addmm, embedding)
# ends the walk. The module's other parameters stay as planned. Layouts never change
# values, so this moves collectives only.


def _fully_sharded(problem: Problem, solution: Solution) -> tuple[ShardedModule, ...]:
    """The modules whose parameters the plan fully shards (NOTE [fully sharded modules of a
    plan]), innermost first."""
    graph = problem.graph
    chosen = _chosen_strategy(problem, solution)
    readers = _readers(graph)
    names: dict[int, list[str]] = {}
    for name, n in graph.param_nodes.items():
        names.setdefault(n, []).append(name)
    found: dict[str, list[tuple[str, int, list[int]]]] = {}
    for n, tied in names.items():
        layout = chosen(n).outputs[0]
        data = layout[0]
        if (
            len(tied) != 1
            or not isinstance(data, Split)
            or any(isinstance(s, Split) and s.dim == data.dim for s in layout[1:])
            or any(isinstance(s, Partial) for s in layout)
        ):
            continue
        module = tied[0].rpartition(".")[0]
        between = _read_whole(graph, readers, chosen, n, module)
        if between is not None:
            found.setdefault(module, []).append((tied[0], data.dim, between))
    sharded = []
    for module, params in found.items():
        dtypes = {graph.nodes[graph.param_nodes[name]].out_dtypes[0] for name, _, _ in params}
        if len(dtypes) > 1:  # fully_shard moves one module's parameters in one dtype
            continue
        sharded.append(
            ShardedModule(
                module,
                tuple(name for name, _, _ in params),
                tuple(dim for _, dim, _ in params),
                tuple(sorted(i for _, _, ops in params for i in ops)),
            )
        )
    return tuple(sorted(sharded, key=lambda m: (-m.module.count(".") - bool(m.module), m.module)))


def _read_whole(
    graph: Graph,
    readers: dict[tuple[int, int], list[tuple[int, int]]],
    chosen: Callable[[int], Strategy],
    param: int,
    module: str,
) -> list[int] | None:
    """The ops between parameter node ``param`` and its readers, if every reader is inside
    ``module`` and reads it broadcast on axis 0, and no view of the gathered parameter
    leaves ``module`` (NOTE [fully sharded modules of a plan]); None if some reader computes
    with it split there, a view of it is an output of ``module`` or of the model, or nothing
    reads it."""
    escapes = set(graph.outputs)
    for _, outs in graph.module_io.get(module, []):
        escapes.update(ref for ref in outs if ref is not None)
    between: list[int] = []
    pending = [(param, 0)]
    if not readers.get(pending[0]):
        return None
    while pending:
        ref = pending.pop()
        if ref in escapes:  # the module or the model returns it: read after it is freed
            return None
        for v, i in readers.get(ref, []):
            node = graph.nodes[v]
            if node.kind != "op" or not _within(node.module, module):
                return None
            strategy = chosen(v)
            if isinstance(strategy.inputs[i][0], Broadcast):
                if _may_alias(node.target):  # a view of the gathered parameter: follow it
                    pending.extend((v, j) for j in range(len(node.out_shapes)))
                continue
            if (
                len(node.inputs) == 1
                and len(node.out_shapes) == 1
                and isinstance(strategy.outputs[0][0], Split)
                and readers.get((v, 0))
            ):
                between.append(v)
                pending.append((v, 0))
                continue
            return None
    return between


def _may_alias(target: str) -> bool:
    """Whether an op recorded as ``target`` may return one of its inputs or a view of it:
    its schema says so, or it has no aten schema to tell (SDPA's outputs are its own)."""
    if target == SDPA:
        return False
    namespace, _, rest = target.partition(".")
    name, _, overload = rest.rpartition(".")
    try:
        schema = getattr(getattr(getattr(torch.ops, namespace), name), overload)._schema
    except (AttributeError, RuntimeError):
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _chosen_strategy(problem: Problem, solution: Solution) -> Callable[[int], Strategy]:
    """The strategy ``solution`` chose for each node (through its tied representative)."""

    def chosen(n: int) -> Strategy:
        rep = problem.reps[n]
        return problem.choices[rep][solution.chosen[rep]]

    return chosen


def _readers(graph: Graph) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per tensor (node, output): the (node, input position) of every op reading it."""
    readers: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for node in graph.nodes:
        for i, ref in enumerate(node.inputs):
            readers.setdefault(ref, []).append((node.index, i))
    return readers
