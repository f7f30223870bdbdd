"""``sbpflow.nn.Graph``: OneFlow's training-step API, run eagerly on global tensors.

A graph is a class whose ``build(*args)`` is one training step. Modules
assigned to it become ``Block`` proxies, so their pipeline stages can be set
without touching the modules; ``self.config`` holds the step's settings; the
optimizers given to ``add_optimizer`` step once per call::

    class TrainGraph(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.model.stage0.config.set_stage(stage_id=0, placement=P0)
            self.model.stage1.config.set_stage(stage_id=1, placement=P1)
            self.config.set_gradient_accumulation_steps(4)
            self.add_optimizer(optimizer)

        def build(self, x, y):
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss


    loss = TrainGraph()(x, y)  # the mean of the 4 micro-batch losses

# NOTE [pipelined micro-batches]
# With two or more pipeline stages a call runs the pipeline schedule
# (``set_pipeline_schedule``, default ``'1f1b'``; ``'gpipe'`` when it is left
# unset and there are fewer micro-batches than stages): each rank runs its
# action list from ``Graph.schedule()``, the forwards of ``build`` on
# micro-batches and their recorded backwards interleaved as the schedule says
# (runtime/, NOTE [deferred backward] in runtime/_scope.py), with sends that do
# not wait for their receiver, and computes only the stages it holds (NOTE
# [stages held elsewhere] in runtime/_held_elsewhere.py). ``Graph.last_step()``
# is the record of what this rank ran, with times. Without stages (data or
# tensor parallelism alone) the micro-batches run one after another through
# ``build``. Either way micro-batch k draws its random numbers from a stream of
# its own (NOTE [micro-batch random streams] in runtime/_scope.py).

# NOTE [gradient accumulation]
# The step's gradient is the mean over micro-batches of each micro-batch
# loss's gradient: the gradients ``build`` accumulates are divided by the
# number of micro-batches before the optimizers step. With a mean loss this is
# exactly training on the whole batch. Gradients already present when the call
# starts are set aside and added back unscaled, as plain accumulation would.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..._global import GlobalTensor
from ...env import get_rank
from ._block import Block, BlockConfig
from .runtime import (
    Carriers,
    EarlyReceives,
    HeldElsewhere,
    HeldHere,
    Stage,
    box_to_stage,
    check_stage_ids,
    check_stages,
    compile_forwards,
    finish_streams,
    mean_outputs,
    microbatch_contexts,
    refuse_if_out_of_step,
    run_step,
    split_microbatches,
    stage_ranks,
)
from .schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, Schedule, StepRecord, build_schedule

__all__ = ["Block", "BlockConfig", "Graph", "GraphConfig"]


class GraphConfig:
    """The settings of a graph's step: gradient accumulation and the pipeline schedule."""

    __slots__ = ("_compile_options", "_early_receives", "_num_microbatches", "_schedule")

    def __init__(self) -> None:
        self._num_microbatches = 1
        self._schedule: str | None = None
        self._compile_options: dict[str, Any] | None = None
        self._early_receives = True

    def enable_compile(self, enabled: bool = True, **options: Any) -> None:
        """Run each pipeline stage's forward (and so its backward) compiled with ``torch.compile``.

        ``options`` go to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ...). A graph
        without stages compiles the forward of each module assigned to it. NOTE [compiled
        stages] says what is compiled and what stays eager.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enable_compile takes True or False, got {enabled!r}.")
        self._compile_options = dict(options) if enabled else None

    @property
    def compile_enabled(self) -> bool:
        return self._compile_options is not None

    def enable_early_receives(self, enabled: bool = True) -> None:
        """Post each pipeline action's receives while the previous action computes (the default).

        It needs a ``build`` that moves the same tensors between stages whenever its
        inputs have the same shapes; turn it off for one whose transfers depend on its
        data (NOTE [next action's receives]).
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enable_early_receives takes True or False, got {enabled!r}.")
        self._early_receives = enabled

    @property
    def early_receives_enabled(self) -> bool:
        return self._early_receives

    def set_gradient_accumulation_steps(self, value: int) -> None:
        """Cut each batch argument into ``value`` micro-batches along dim 0; step once after the last."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"gradient accumulation steps must be an int, got {type(value).__name__}: "
                f"{value!r}."
            )
        if value < 1:
            raise ValueError(
                f"gradient accumulation steps must be at least 1, got {value}; use 1 to run "
                "each batch whole."
            )
        self._num_microbatches = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._num_microbatches

    def set_pipeline_schedule(self, name: str) -> None:
        """The schedule a step with pipeline stages runs (NOTE [pipelined micro-batches])."""
        if name not in SCHEDULE_NAMES:
            raise ValueError(
                f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULE_NAMES)}."
            )
        self._schedule = name

    @property
    def pipeline_schedule(self) -> str:
        """The schedule set with ``set_pipeline_schedule``, else the default (``'1f1b'``)."""
        return self._schedule or DEFAULT_SCHEDULE

    def _schedule_for(self, num_stages: int) -> str:
        """The schedule a step runs: the one set, else 1f1b, or gpipe for fewer micro-batches than stages."""
        if self._schedule is None and self._num_microbatches < num_stages:
            return "gpipe"
        return self.pipeline_schedule

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"sbpflow's GraphConfig has no {name!r}; it offers "
            "set_gradient_accumulation_steps(n), set_pipeline_schedule(name) and "
            "enable_compile(True, **torch_compile_options). (OneFlow's other compiler options "
            "have no counterpart: leave them out.)"
        )

    def __repr__(self) -> str:
        return (
            f"GraphConfig(gradient_accumulation_steps={self._num_microbatches}, "
            f"pipeline_schedule={self.pipeline_schedule!r}, compile={self.compile_enabled})"
        )


class Graph:
    """One training step as a class: subclass it, assign modules, override ``build``.

    Calling the graph runs ``build`` once per micro-batch (in the pipeline
    schedule's order: NOTE [pipelined micro-batches]), averages the gradients over the
    micro-batches (NOTE [gradient accumulation]), steps and zero_grads the
    optimizers given to ``add_optimizer``, and returns what ``build`` returned,
    averaged over the micro-batches and detached: for a loss, the mean of the
    micro-batch losses, a global tensor on the loss's placement.
    """

    _blocks: dict[int, Block]  # id(module) -> its Block
    _top_blocks: list[Block]  # the Blocks assigned to the graph
    _graph_config: GraphConfig
    _optimizers: list[tuple[torch.optim.Optimizer, Any]]  # (optimizer, lr scheduler or None)
    _grad_scaler: Any
    _last_step: StepRecord | None
    _held_elsewhere: HeldElsewhere  # stand-ins of the stages other ranks hold
    _held_here: HeldHere  # this rank's stages that run on their pieces
    _early_receives: EarlyReceives  # the receives each action made, per kind of step
    _carriers: Carriers  # the worker threads of a rank holding several stages
    _warned_no_stages: bool
    _schedules: dict[tuple[Any, ...], Schedule]  # built for (name, stages, ranks, micro-batches)

    def __init__(self) -> None:
        object.__setattr__(self, "_blocks", {})
        object.__setattr__(self, "_top_blocks", [])
        object.__setattr__(self, "_graph_config", GraphConfig())
        object.__setattr__(self, "_optimizers", [])
        object.__setattr__(self, "_grad_scaler", None)
        object.__setattr__(self, "_last_step", None)
        object.__setattr__(self, "_held_elsewhere", HeldElsewhere())
        object.__setattr__(self, "_held_here", HeldHere())
        object.__setattr__(self, "_early_receives", EarlyReceives())
        carriers = Carriers()  # NOTE [worker threads kept across steps]: end with the graph
        object.__setattr__(self, "_carriers", carriers)
        weakref.finalize(self, carriers.close)
        object.__setattr__(self, "_warned_no_stages", False)
        object.__setattr__(self, "_schedules", {})

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """One step on one micro-batch: forward, loss, ``loss.backward()``; return the loss."""
        raise NotImplementedError(
            f"{type(self).__name__} does not define build(self, ...); override it with the "
            "training step (forward, loss, loss.backward(), return loss)."
        )

    @property
    def config(self) -> GraphConfig:
        return self._graph_config

    def add_optimizer(self, optimizer: torch.optim.Optimizer, lr_sch: Any = None) -> None:
        """Step ``optimizer`` (then ``lr_sch``) once per call, after the last micro-batch, then zero_grad."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"add_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if lr_sch is not None:
            if not callable(getattr(lr_sch, "step", None)):
                raise TypeError(
                    f"lr_sch must be a learning-rate scheduler (with .step()), got "
                    f"{type(lr_sch).__name__}."
                )
            bound = getattr(lr_sch, "optimizer", optimizer)
            if bound is not optimizer:
                raise ValueError(
                    f"lr_sch {type(lr_sch).__name__} schedules another optimizer "
                    f"({type(bound).__name__}), not the {type(optimizer).__name__} it is added "
                    "with; build the scheduler on this optimizer."
                )
        self._optimizers.append((optimizer, lr_sch))

    def set_grad_scaler(self, scaler: Any) -> None:
        """Step through ``scaler`` (``scaler.step(opt)``, ``scaler.update()``) for ``build``s that
        call ``scaler.scale(loss).backward()`` (mixed precision with ``torch.amp``)."""
        if not (
            callable(getattr(scaler, "step", None)) and callable(getattr(scaler, "update", None))
        ):
            raise TypeError(
                f"set_grad_scaler takes a torch.amp.GradScaler, got {type(scaler).__name__}."
            )
        object.__setattr__(self, "_grad_scaler", scaler)

    def schedule(self) -> Schedule:
        """The pipeline schedule for the stages and micro-batches configured (built and validated).

        Pure: needs no process group. A stage on several ranks is represented
        by its placement's first rank, and its other ranks run the same list.
        ``last_step()`` shows how the latest call ran it.
        """
        stages = self._stages()
        if not stages:
            raise ValueError(
                f"{type(self).__name__} has no pipeline stages; mark them with "
                "self.<module>.config.set_stage(stage_id, placement) in __init__."
            )
        check_stage_ids(stages)
        key = (
            self.config._schedule_for(len(stages)),
            len(stages),
            tuple(stage_ranks(stages)),
            self.config.gradient_accumulation_steps,
        )
        built = self._schedules.get(key)
        if built is None:  # a schedule is a value: build and validate it once per configuration
            built = self._schedules[key] = build_schedule(*key)
        return built

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stages = self._stages()
        check_stages(stages)  # the same verdict on every rank, before any communication
        if len(stages) > 1:
            refuse_if_out_of_step()  # NOTE [a failed step's messages] in runtime/_failed_step.py
        params = self._parameters()
        if not stages:
            self._warn_if_placed_like_stages(params)
        num_microbatches = self.config.gradient_accumulation_steps
        microbatches = split_microbatches(args, kwargs, num_microbatches)
        compile_forwards(self._compiled_modules(stages), self.config._compile_options)
        contexts = microbatch_contexts(num_microbatches)  # NOTE [micro-batch random streams]
        with _gradients_kept_if_failed(params) as earlier, _stage_inputs(stages):
            if len(stages) > 1:
                schedule = self.schedule()
                self._early_receives.enabled = self.config.early_receives_enabled
                outputs, record = run_step(
                    self.build,
                    microbatches,
                    contexts,
                    schedule,
                    stages,
                    self._held_elsewhere,
                    self._held_here,
                    self._early_receives,
                    self._carriers,
                )
                object.__setattr__(self, "_last_step", record)
            else:
                outputs = [
                    context.run(self.build, *a, **k)
                    for (a, k), context in zip(microbatches, contexts, strict=True)
                ]
        finish_streams(contexts)
        _average_grads(params, earlier, num_microbatches)
        self._step()
        return mean_outputs(outputs)

    def last_step(self) -> StepRecord:
        """What this rank ran in the latest pipelined call: its actions in order, with times.

        Prints as the order run; draws as a timeline in a notebook. Combine the
        records of several ranks with ``StepRecord.combine`` for the whole
        pipeline's picture.
        """
        if self._last_step is None:
            stages = self._stages()
            if len(stages) < 2:
                why = (
                    f"it has {'one pipeline stage' if stages else 'no pipeline stages'}, so its "
                    "calls run the micro-batches one after another and record nothing; mark two "
                    "or more stages with self.<module>.config.set_stage(stage_id, placement) to "
                    "pipeline them"
                )
            else:
                why = "it has not been called yet; call the graph first, then read last_step()"
            raise ValueError(f"{type(self).__name__} has no pipelined step to show: {why}.")
        return self._last_step

    # -- internals -------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if "_blocks" not in self.__dict__:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ set {name!r} before calling "
                "super().__init__(); call super().__init__() first."
            )
        if isinstance(value, torch.nn.Module):
            value = self._block(value, name)
            self._top_blocks.append(value)
        object.__setattr__(self, name, value)

    def _block(self, module: torch.nn.Module, name: str) -> Block:
        """The graph's one Block for ``module`` (made on first sight, under its first name)."""
        block = self._blocks.get(id(module))
        if block is None:
            block = self._blocks[id(module)] = Block(module, name, self._block)
        return block

    def _stages(self) -> list[Stage]:
        found = []
        for block in self._blocks.values():
            cfg: BlockConfig = block.config
            if cfg.stage_id is not None and cfg.stage_placement is not None:
                found.append(Stage(block._name, block.origin, cfg.stage_id, cfg.stage_placement))
        return found

    def _warn_if_placed_like_stages(self, params: list[torch.Tensor]) -> None:
        """Warn once when the parameters sit on several placements but no stage is set."""
        if self._warned_no_stages:
            return
        placements = list(dict.fromkeys(p.placement for p in params if isinstance(p, GlobalTensor)))
        if len(placements) < 2:
            return
        object.__setattr__(self, "_warned_no_stages", True)
        shown = ", ".join(str(p) for p in placements[:4]) + (", ..." if len(placements) > 4 else "")
        warnings.warn(
            f"{type(self).__name__}'s parameters sit on {len(placements)} placements ({shown}) "
            "but no pipeline stage is set, so each call runs build on the micro-batches one "
            "after another, every stage waiting for the previous one. To pipeline them, mark "
            "each stage's module in __init__ with "
            "self.<module>.config.set_stage(stage_id, placement).",
            stacklevel=2,
        )

    def _compiled_modules(self, stages: list[Stage]) -> list[torch.nn.Module]:
        """The modules ``enable_compile`` compiles on this rank: the stages it holds, or (with
        no stages) the graph's modules."""
        if not stages:
            return [block.origin for block in self._top_blocks]
        rank = get_rank()
        return [stage.module for stage in stages if rank in stage.placement]

    def _parameters(self) -> list[torch.Tensor]:
        """Every parameter the step trains: the graph's modules' and the optimizers', once each."""
        seen: dict[int, torch.Tensor] = {}
        for block in self._top_blocks:
            for p in block.origin.parameters():
                seen.setdefault(id(p), p)
        for optimizer, _ in self._optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _step(self) -> None:
        scaler = self._grad_scaler
        for optimizer, lr_sch in self._optimizers:
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
            if lr_sch is not None:
                lr_sch.step()
        if scaler is not None and self._optimizers:
            scaler.update()
        for optimizer, _ in self._optimizers:
            optimizer.zero_grad()

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}(", f"  config: {self.config!r}"]
        lines += [f"  {block!r}" for block in self._blocks.values()]
        lines += [f"  optimizer: {type(opt).__name__}" for opt, _ in self._optimizers]
        return "\n".join([*lines, ")"])


def _average_grads(
    params: list[torch.Tensor], earlier: list[tuple[torch.Tensor, torch.Tensor]], n: int
) -> None:
    """Divide the step's gradients by ``n`` and add back those set aside (NOTE [gradient accumulation])."""
    with torch.no_grad():
        if n > 1:
            for p in params:
                grad = p.grad
                if isinstance(grad, GlobalTensor) and grad.grad_fn is None and not grad._is_view():
                    # Dividing every piece divides the logical value, whatever the layout
                    # (split, broadcast, partial sum or max), with no dispatch. (A view, which
                    # may hold a copy, or a gradient with a graph goes through dispatch.)
                    grad._local.div_(n)
                elif grad is not None:
                    grad.div_(n)
        for p, old in earlier:
            p.grad = old if p.grad is None else old.add_(p.grad)


@contextlib.contextmanager
def _gradients_kept_if_failed(
    params: list[torch.Tensor],
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Set the parameters' gradients aside for the step (yielding them) and, when the step
    raises, leave each as it was before the call: the micro-batches that ran before the
    failure accumulated only part of the step's gradient, which the next step would
    otherwise add to its own."""
    earlier = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in earlier:
        p.grad = None
    try:
        yield earlier
    except BaseException:
        for p in params:
            p.grad = None
        for p, old in earlier:
            p.grad = old
        raise


@contextlib.contextmanager
def _stage_inputs(stages: list[Stage]) -> Iterator[None]:
    """While the step runs, move each stage's global inputs onto its placement (OneFlow's behaviour)."""
    handles = []
    try:
        for stage in stages:

            def hook(
                module: torch.nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                stage: Stage = stage,
            ) -> tuple[Any, Any]:
                return box_to_stage(args, stage.placement), box_to_stage(kwargs, stage.placement)

            handles.append(stage.module.register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
