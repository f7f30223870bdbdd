"""What a plan is: every parameter's, input's and op's layout, with its predicted costs.

Pure data (frozen dataclasses): the same inputs give equal plans on every rank and machine.
``Plan.apply`` is the only part that touches a model.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..boxing.plan import _fmt_bytes, _fmt_seconds
from ..placement import Placement
from ..sbp import NdSbp, broadcast, normalize, sbp_str

__all__ = ["Boundary", "Collective", "Memory", "OpChoice", "ParamLayout", "Plan", "ShardedModule"]


@dataclass(frozen=True)
class Collective:
    """One boxing step the plan predicts: where, which collective, how many bytes, how long."""

    phase: str  # "forward" or "backward"
    op: str  # all_gather, all_reduce, reduce_scatter, all_to_all, slice, zero, ...
    axes: tuple[int, ...]
    bytes_per_rank: int
    seconds: float
    shape: tuple[int, ...]
    src: str
    dst: str
    tensor: str  # what is boxed: "fc1.weight", "input0", or the producing op
    # an all_reduce of a parameter's gradient into the parameter (broadcast on its axes),
    # which data-parallel buckets reduce together with others in one collective
    parameter_gradient: bool = False

    @property
    def is_collective(self) -> bool:
        return self.op not in ("slice", "zero", "copy")

    def __str__(self) -> str:
        axes = ",".join(map(str, self.axes)) or "-"
        return (
            f"{self.phase:<8} {self.op:<14} axis {axes:<4} {self.src} -> {self.dst}  "
            f"{self.tensor} {list(self.shape)}  {_fmt_bytes(self.bytes_per_rank)}/rank  "
            f"~{_fmt_seconds(self.seconds)}"
        )


@dataclass(frozen=True)
class ParamLayout:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sbp: NdSbp
    bytes_per_rank: float  # the parameter alone (its gradient and optimizer state are alike)


@dataclass(frozen=True)
class OpChoice:
    """One op's strategy and the boxing of its inputs (forward) and their gradients."""

    index: int
    op: str
    module: str
    inputs: tuple[NdSbp, ...]
    outputs: tuple[NdSbp, ...]
    compute_seconds: float  # forward and backward, one rank
    activation_bytes: float
    collectives: tuple[Collective, ...]
    fallback: bool  # no rule: computed broadcast on every rank
    # the shapes of its tensor arguments, as ``tree_flatten`` orders them: how a call at
    # run time is known to be this op (NOTE [following the plan] in _follow.py)
    in_shapes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Boundary:
    """A tensor a module is given or returns, with the layouts the plan gives it there.

    ``position`` counts the tensor leaves of the module's ``(args, kwargs)`` (``where ==
    "input"``) or of its output, flattened by ``torch.utils._pytree``; ``num_leaves`` is how
    many there were when the step was captured. ``grad_sbp`` is the layout its gradient is
    handed back in (None: it gets none). NOTE [following the plan] in _follow.py.
    """

    module: str
    where: str  # "input" or "output"
    position: int
    num_leaves: int
    shape: tuple[int, ...]
    sbp: NdSbp
    grad_sbp: NdSbp | None


@dataclass(frozen=True)
class ShardedModule:
    """A module whose parameters ``params`` the plan stores split on the data axis (axis 0)
    and reads whole where they are used: ``apply`` runs them with ``fully_shard``'s runtime
    (NOTE [fully sharded modules of a plan] in _api.py).

    ``params`` are full names, ``dims`` the dim each is split on; ``ops`` the indices of the
    ops between a parameter and its readers (a transpose, a view), which run on the
    gathered parameter instead of their planned layouts.
    """

    module: str
    params: tuple[str, ...]
    dims: tuple[int, ...]
    ops: tuple[int, ...]


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per rank: what the step keeps, and its peak (NOTE [peak memory] in
    _peak.py: the largest sum held at once, transient buffers included; gradients, kept
    activations and transient buffers are not all held at the same time)."""

    parameters: float
    gradients: float
    optimizer_state: float
    activations: float  # every op output autograd may keep, inputs and buffers
    peak: float


@dataclass(frozen=True)
class Plan:
    """A layout for every parameter and input of one training step, with its predictions."""

    placement: Placement
    params: tuple[ParamLayout, ...]
    input_sbp: tuple[NdSbp, ...]
    output_sbp: tuple[NdSbp, ...]
    ops: tuple[OpChoice, ...]
    output_collectives: tuple[Collective, ...]  # handing the outputs to the loss
    # boxing done once at an output read by several ops, for all of them: the output to its
    # shared layout (forward), the summed gradient to the producer's layout (backward)
    producer_collectives: tuple[Collective, ...]
    memory: Memory
    compute_seconds: float
    boxing_seconds: float
    optimizer_seconds: float  # the optimizer's update of every parameter
    memory_budget: float | None
    num_variables: int
    num_constraints: int
    num_tied: int  # nodes sharing a repeated block's decisions
    solve_seconds: float = field(compare=False)
    # where apply() boxes module inputs and outputs to the planned layouts
    boundaries: tuple[Boundary, ...] = ()
    # of boxing_seconds, what data-parallel buckets save by all-reducing parameter
    # gradients together (NOTE [bucketed gradients] in _api.py; not part of the search)
    bucket_savings_seconds: float = 0.0
    # modules run with fully_shard's gather and reduction (innermost first)
    fully_sharded: tuple[ShardedModule, ...] = ()

    @property
    def step_seconds(self) -> float:
        """Predicted seconds of one training step (forward, backward, boxing with parameter
        gradients all-reduced in buckets, optimizer)."""
        return (
            self.compute_seconds
            + self.boxing_seconds
            - self.bucket_savings_seconds
            + self.optimizer_seconds
        )

    @property
    def param_sbp(self) -> dict[str, NdSbp]:
        return {p.name: p.sbp for p in self.params}

    @property
    def fallback_ops(self) -> tuple[str, ...]:
        """Ops with no rule, computed broadcast on every rank."""
        return tuple(dict.fromkeys(op.op for op in self.ops if op.fallback))

    def collectives(self) -> list[Collective]:
        """Every boxing step of a step, forward and backward (local ones included)."""
        found = [c for op in self.ops for c in op.collectives]
        return found + list(self.output_collectives) + list(self.producer_collectives)

    # -- applying -----------------------------------------------------------------
    def apply(self, model: torch.nn.Module, *, follow: bool = True) -> torch.nn.Module:
        """Convert ``model``'s parameters in place to the planned layouts; returns ``model``.

        Every rank must hold the full logical model (as after the same seed): each plain
        parameter is read as the whole logical value and laid out as planned, buffers stay
        broadcast. This goes through ``Module.to_global``, so each parameter stays the same
        object: an optimizer made before ``apply`` keeps working.

        With ``follow`` (the default), each op of the forward takes its planned strategy,
        and forward hooks box each module's inputs and outputs to the planned layouts, and
        their gradients to the planned gradient layouts, so the step boxes where the plan
        says (NOTE [following the plan] in _follow.py);
        ``unfollow(model)`` (``from sbpflow.auto_parallel import unfollow``) removes them.
        ``follow=False`` installs no hooks: it lays out the parameters, and runs the fully
        sharded modules below with ``fully_shard``'s runtime all the same.

        Each module of ``fully_sharded`` (parameters stored split on the data axis and read
        whole) runs with ``fully_shard``'s runtime for those parameters, with or without
        ``follow``: gathered in one all_gather before its forward and again before its
        backward (each started one module ahead), freed after each, gradients
        reduce-scattered back to the split; the model's class then becomes a
        ``FSDPModule`` too. This is then a collective call over the whole world (its ranks
        agree on the parameters they shard): every rank of the world calls ``apply``, with
        the same plan and model, the ranks outside the placement included. Applying the
        same plan again (after ``follow=False`` or ``unfollow``) leaves those modules as
        the first ``apply`` set them; a module that ``fully_shard`` runs otherwise (called
        by hand, or another plan's ``apply``) raises ``ValueError`` before anything changes.
        """
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        planned = self.param_sbp
        if sorted(names) != sorted(planned):
            missing = sorted(set(planned) - set(names))[:5]
            extra = sorted(set(names) - set(planned))[:5]
            raise ValueError(
                f"this plan is for a model with other parameters (missing from the model: "
                f"{missing}, not in the plan: {extra}); apply it to the model it was made for."
            )
        whole = (broadcast,) * self.placement.ndim
        layouts = dict(planned)
        done = self._fully_sharded_before(model)
        for sharded in self.fully_sharded:
            if sharded.module in done:  # an earlier apply: stored as planned, left as it is
                continue
            for name in sharded.params:  # fully_shard takes them whole on the data axis
                layouts[name] = (broadcast, *planned[name][1:])
        model.to_global(self.placement, lambda name, _t: layouts.get(name, whole))  # type: ignore[operator]
        if self.fully_sharded:
            self._fully_shard(model, done)
        if follow:
            from ._follow import follow as install

            free = {i for sharded in self.fully_sharded for i in sharded.ops}
            install(model, self.placement, self.boundaries, self.ops, free)
        return model

    def _fully_sharded_before(self, model: torch.nn.Module) -> set[str]:
        """The modules an earlier ``apply`` of this plan already runs with ``fully_shard``'s
        runtime (the model's root included). Raises, before anything changes, if
        ``fully_shard`` runs on a module in another way."""
        from ..nn.parallel.fsdp import _sharded_by

        wanted: dict[str, frozenset[str]] = {}
        for sharded in self.fully_sharded:
            prefix = sharded.module + "." if sharded.module else ""
            wanted[sharded.module] = frozenset(n.removeprefix(prefix) for n in sharded.params)
        if self.fully_sharded:
            wanted.setdefault("", frozenset())
        done = set()
        for path, module in model.named_modules():
            found = _sharded_by(module)
            if found is None:
                continue
            placement, params = found
            if wanted.get(path) != params or placement != self.placement:
                raise ValueError(
                    f"apply: module {path or '(root)'!r} already runs fully_shard on "
                    f"{placement} for parameters {sorted(params)}, but this plan fully shards "
                    f"{sorted(wanted.get(path, ()))} on {self.placement} there. Apply a plan "
                    "to a model made fresh (not passed to fully_shard or to another plan's "
                    "apply); applying the same plan again is fine."
                )
            done.add(path)
        return done

    def _fully_shard(self, model: torch.nn.Module, done: set[str]) -> None:
        """``fully_shard``'s runtime on each module of ``fully_sharded`` for the planned
        parameters, and on the model with none of its own, so that the modules share one
        step (each gathers the next one ahead, NOTE [prefetch] in nn/parallel/_fsdp_state);
        the modules in ``done`` already run it."""
        from ..nn.parallel.fsdp import _fully_shard

        modules = dict(model.named_modules())
        roots = False
        for sharded in self.fully_sharded:
            roots = roots or not sharded.module
            if sharded.module in done:
                continue
            prefix = sharded.module + "." if sharded.module else ""
            dims = {
                name.removeprefix(prefix): dim
                for name, dim in zip(sharded.params, sharded.dims, strict=True)
            }
            # freed after the forward and gathered again (one module ahead) for the
            # backward: the plan counts no memory for the gathered parameters
            _fully_shard(modules[sharded.module], self.placement, True, None, dims)
        if not roots and "" not in done:
            _fully_shard(model, self.placement, True, None, {})

    # -- inspecting -----------------------------------------------------------------
    def diff(
        self, layout: Mapping[str, Any] | Callable[[str, torch.Tensor], Any]
    ) -> list[tuple[str, NdSbp, NdSbp]]:
        """Parameters whose planned layout differs from ``layout``: (name, planned, given).

        ``layout`` is a dict name -> sbp (missing names read as broadcast) or a callable
        ``(name, tensor) -> sbp`` as ``Module.to_global`` takes (it gets a meta tensor).
        """
        if not callable(layout) and not isinstance(layout, Mapping):
            raise TypeError(
                f"layout must be a dict name -> sbp or a callable (name, tensor) -> sbp, got "
                f"{type(layout).__name__}: {layout!r}."
            )
        whole = (broadcast,) * self.placement.ndim
        found = []
        for p in self.params:
            if callable(layout):
                given = layout(p.name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
            else:
                given = layout.get(p.name, whole)
            given = normalize(given, self.placement.ndim, len(p.shape))
            if given != p.sbp:
                found.append((p.name, p.sbp, given))
        return found

    def explain(self) -> str:
        """Readable text: layouts per parameter and per layer, collectives, time and memory."""
        m = self.memory
        lines = [
            f"Plan on {self.placement}: predicted step ~{_fmt_seconds(self.step_seconds)} "
            f"(compute {_fmt_seconds(self.compute_seconds)}, boxing "
            f"{_fmt_seconds(self.boxing_seconds - self.bucket_savings_seconds)}"
            + (
                f" with gradients bucketed ({_fmt_seconds(self.boxing_seconds)} one by one)"
                if self.bucket_savings_seconds
                else ""
            )
            + ", optimizer "
            f"{_fmt_seconds(self.optimizer_seconds)}), peak memory ~{_fmt_bytes(m.peak)} per rank",
            f"  memory: parameters {_fmt_bytes(m.parameters)}, gradients {_fmt_bytes(m.gradients)}, "
            f"optimizer state {_fmt_bytes(m.optimizer_state)}, activations "
            f"{_fmt_bytes(m.activations)}"
            + (f"; budget {_fmt_bytes(self.memory_budget)}" if self.memory_budget else ""),
            f"  search: {self.num_variables} variables, {self.num_constraints} constraints, "
            f"{self.num_tied} ops tied to repeated blocks",
            "inputs: " + ", ".join(f"input{i} {sbp_str(s)}" for i, s in enumerate(self.input_sbp)),
            "outputs: " + ", ".join(sbp_str(s) for s in self.output_sbp),
            "parameters:",
        ]
        width = max((len(p.name) for p in self.params), default=0)
        for p in self.params:
            lines.append(
                f"  {p.name:<{width}}  {sbp_str(p.sbp):<12} {list(p.shape)}  "
                f"{_fmt_bytes(p.bytes_per_rank)}/rank"
            )
        lines.append("layers:")
        for module, ops in _by_module(self.ops):
            compute = sum(op.compute_seconds for op in ops)
            collectives = [c for op in ops for c in op.collectives if c.is_collective]
            comm = sum(c.seconds for op in ops for c in op.collectives)
            strategies = [
                f"{op.op.removeprefix('aten.').split('.')[0]} "
                + ",".join(sbp_str(s) for s in op.inputs)
                + " -> "
                + ",".join(sbp_str(s) for s in op.outputs)
                for op in ops
                if op.compute_seconds > 0
            ]
            lines.append(
                f"  {module or '(root)'}: compute ~{_fmt_seconds(compute)}, boxing "
                f"~{_fmt_seconds(comm)}"
            )
            for text in strategies[:8]:
                lines.append(f"      {text}")
            if len(strategies) > 8:
                lines.append(f"      ... {len(strategies) - 8} more ops")
            for c in collectives:
                lines.append(f"      {c}")
        for c in self.output_collectives:
            if c.is_collective:
                lines.append(f"  (outputs) {c}")
        once = [c for c in self.producer_collectives if c.is_collective]
        if once:
            lines.append("outputs read by several ops (boxed once for all of them):")
            lines += [f"      {c}" for c in once]
        if self.fully_sharded:
            lines.append(
                "fully sharded modules (gathered before their forward and their backward, "
                "gradients reduce-scattered, by fully_shard's runtime):"
            )
            for sharded in self.fully_sharded:
                lines.append(f"  {sharded.module or '(root)'}: " + ", ".join(sharded.params))
        if self.fallback_ops:
            lines.append(
                "ops with no rule (computed broadcast on every rank): "
                + ", ".join(self.fallback_ops)
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(p.name)}</td><td>{html.escape(sbp_str(p.sbp))}</td>"
            f"<td>{list(p.shape)}</td><td>{_fmt_bytes(p.bytes_per_rank)}</td></tr>"
            for p in self.params
        )
        steps = "".join(
            f"<tr><td>{html.escape(c.phase)}</td><td>{html.escape(c.op)}</td>"
            f"<td>{html.escape(c.tensor)}</td><td>{html.escape(c.src)} &rarr; "
            f"{html.escape(c.dst)}</td><td>{_fmt_bytes(c.bytes_per_rank)}</td>"
            f"<td>{_fmt_seconds(c.seconds)}</td></tr>"
            for c in self.collectives()
            if c.is_collective
        )
        head = html.escape(self.explain().splitlines()[0])
        return (
            f"<div><b>{head}</b><table><tr><th>parameter</th><th>layout</th><th>shape</th>"
            f"<th>bytes/rank</th></tr>{rows}</table><table><tr><th>phase</th><th>collective"
            f"</th><th>tensor</th><th>layouts</th><th>bytes/rank</th><th>est.</th></tr>"
            f"{steps}</table></div>"
        )


def _by_module(ops: tuple[OpChoice, ...]) -> list[tuple[str, list[OpChoice]]]:
    groups: dict[str, list[OpChoice]] = {}
    for op in ops:
        groups.setdefault(op.module, []).append(op)
    return list(groups.items())
