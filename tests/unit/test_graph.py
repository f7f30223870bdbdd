"""``sbpflow.nn.Graph`` in one process, no process group: proxies, settings, schedules, accumulation.

Modules here hold plain local tensors and no stage, so a graph step is ordinary
PyTorch; the single-process reference is the same model trained directly in the test
(full batch, or micro-batches accumulated by hand). Stage placements are pure values,
so the schedule a graph builds is compared with ``build_schedule`` called directly.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.nn import Block, BlockConfig, Graph
from sbpflow.nn.pipeline import SCHEDULE_NAMES, build_schedule
from sbpflow.nn.pipeline.runtime._microbatch import mean_outputs, split_microbatches

P = [sbpflow.placement("cpu", [r]) for r in range(4)]


class WithConfig(nn.Module):
    """A model that, like Hugging Face's, has a ``config`` attribute of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"hidden": 4}
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class Holder(Graph):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class Step(Graph):
    """Mean-squared-error training step; returns (loss, batch mean of the outputs)."""

    def __init__(self, model: nn.Module, steps: int, opt: torch.optim.Optimizer | None) -> None:
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(steps)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, x: torch.Tensor, *, target: torch.Tensor) -> Any:
        out = self.model(x)
        loss = F.mse_loss(out, target)
        loss.backward()
        return {"loss": loss, "mean_out": out.mean()}


# -- the Block proxy ----------------------------------------------------------------------


def test_modules_become_blocks_and_the_module_is_left_alone() -> None:
    """A block's config is its own even when the module has one; submodules come back as the
    same Block every time; calling a block calls the module; the module gains no attribute."""
    model = WithConfig()
    before = set(vars(model)) | {n for n, _ in model.named_modules()}
    graph = Holder(model)
    assert isinstance(graph.model, Block) and graph.model.origin is model
    assert isinstance(graph.model.config, BlockConfig)
    assert graph.model.origin.config == {"hidden": 4}
    assert graph.model.encoder is graph.model.encoder
    assert (
        isinstance(graph.model.encoder[0], Block)
        and graph.model.encoder[0].origin is model.encoder[0]
    )
    assert [b.origin for b in graph.model.encoder] == list(model.encoder)
    assert graph.model.to(nn.Module) is model
    graph.model.encoder.config.set_stage(stage_id=0, placement=P[0])
    assert graph.model.encoder.config.stage_id == 0
    assert graph.model.encoder.config.stage_placement == P[0]
    assert set(vars(model)) | {n for n, _ in model.named_modules()} == before
    x = torch.randn(3, 4)
    torch.testing.assert_close(graph.model(x), model(x))
    assert "stage 0" in repr(graph.model.encoder)


def test_set_stage_checks_its_arguments() -> None:
    config = BlockConfig()
    with pytest.raises(TypeError, match=r"stage_id must be a non-negative int .* got int: -1"):
        config.set_stage(-1, P[0])
    with pytest.raises(TypeError, match=r"stage_id .* got bool"):
        config.set_stage(True, P[0])
    with pytest.raises(TypeError, match=r"placement must be an sbpflow.placement, got list: \[0\]"):
        config.set_stage(0, [0])  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="BlockConfig has no 'activation_checkpointing'"):
        _ = config.activation_checkpointing


def test_graph_needs_super_init_and_build() -> None:
    class Forgot(Graph):
        def __init__(self) -> None:
            self.model = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match=r"call super\(\).__init__\(\) first"):
        Forgot()
    with pytest.raises(NotImplementedError, match="does not define build"):
        Holder(nn.Linear(2, 2))(torch.randn(2, 2))


# -- configuration --------------------------------------------------------------------------


def test_config_validates_settings() -> None:
    graph = Holder(nn.Linear(2, 2))
    for bad, error in [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="gradient accumulation steps must"):
            graph.config.set_gradient_accumulation_steps(bad)  # type: ignore[arg-type]
    assert graph.config.gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'; expected one of"):
        graph.config.set_pipeline_schedule("pipedream")
    assert graph.config.pipeline_schedule == "1f1b"
    for name in SCHEDULE_NAMES:
        graph.config.set_pipeline_schedule(name)
        assert graph.config.pipeline_schedule == name
    with pytest.raises(AttributeError, match="GraphConfig has no 'enable_amp'"):
        graph.config.enable_amp(True)


def test_add_optimizer_checks_its_arguments() -> None:
    model = nn.Linear(2, 2)
    graph = Holder(model)
    opt, other = (
        torch.optim.SGD(model.parameters(), lr=1.0),
        torch.optim.SGD(model.parameters(), lr=1.0),
    )
    with pytest.raises(TypeError, match=r"takes a torch\.optim\.Optimizer, got Linear"):
        graph.add_optimizer(model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedules another optimizer"):
        graph.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.StepLR(other, step_size=1))


# -- schedules ------------------------------------------------------------------------------


class Chain(nn.Module):
    def __init__(self, num_stages: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.Linear(2, 2) for _ in range(num_stages))


def _staged(placements: list[sbpflow.Placement], ids: list[int], steps: int) -> Holder:
    graph = Holder(Chain(len(placements)))
    for stage, placement, stage_id in zip(graph.model.stages, placements, ids, strict=True):
        stage.config.set_stage(stage_id=stage_id, placement=placement)
    graph.config.set_gradient_accumulation_steps(steps)
    return graph


def test_last_step_before_a_pipelined_call_says_why() -> None:
    """Without stages it names set_stage; with stages but no call yet it says to call first."""
    with pytest.raises(
        ValueError, match=r"Holder has no pipelined step.*no pipeline stages.*set_stage"
    ):
        Holder(Chain(2)).last_step()
    with pytest.raises(ValueError, match=r"has not been called yet; call the graph first"):
        _staged([P[0], P[1]], [0, 1], steps=2).last_step()


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_schedule_is_the_pure_schedule_for_the_configured_stages(name: str) -> None:
    """graph.schedule() equals build_schedule for the stages' first ranks and micro-batches."""
    placements = [P[0], P[1], P[0], P[1]] if name == "interleaved_1f1b" else [P[0], P[1], P[2]]
    if name in ("zbv", "dualpipev"):  # two stages per rank, as a V
        placements = [P[0], P[1], P[1], P[0]]
    graph = _staged(placements, list(range(len(placements))), steps=4)
    graph.config.set_pipeline_schedule(name)
    want = build_schedule(name, len(placements), [p.flat_ranks[0] for p in placements], 4)
    assert graph.schedule() == want


def test_schedule_of_stages_set_out_of_order_and_on_several_ranks() -> None:
    """Stage ids, not attribute order, give the pipeline order; a multi-rank stage is its first rank."""
    pair = sbpflow.placement("cpu", [2, 3])
    graph = _staged([pair, P[0], P[1]], [2, 0, 1], steps=3)
    assert graph.schedule() == build_schedule("1f1b", 3, [0, 1, 2], 3)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (
            [0, 2],
            r"stage ids must be 0\.\.1 with none skipped, got \[0, 2\] \(0: 'model.stages.0', 2: 'model.stages.1'\); stage id\(s\) \[1\] are missing",
        ),
        ([1, 1], r"stage id 1 is set on 2 modules \('model.stages.0', 'model.stages.1'\)"),
        ([1, 2], r"got \[1, 2\] .* stage id\(s\) \[0\] are missing"),
    ],
)
def test_stage_ids_that_skip_or_repeat(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _staged([P[0], P[1]], ids, steps=2).schedule()


def test_default_schedule_with_fewer_microbatches_than_stages_is_gpipe() -> None:
    """Left unset, the schedule is 1f1b, or gpipe when 1f1b would need more micro-batches."""
    assert _staged([P[0], P[1], P[2]], [0, 1, 2], steps=2).schedule() == build_schedule(
        "gpipe", 3, [0, 1, 2], 2
    )
    assert _staged([P[0], P[1]], [0, 1], steps=2).schedule().name == "1f1b"


def test_schedule_errors() -> None:
    with pytest.raises(ValueError, match="has no pipeline stages"):
        Holder(nn.Linear(2, 2)).schedule()
    few = _staged([P[0], P[1], P[2]], [0, 1, 2], steps=2)
    few.config.set_pipeline_schedule("1f1b")
    with pytest.raises(ValueError, match="1f1b needs at least as many micro-batches as stages"):
        few.schedule()
    overlapping = [sbpflow.placement("cpu", [0, 1]), P[0]]
    with pytest.raises(ValueError, match="both start with rank 0"):
        _staged(overlapping, [0, 1], steps=2).schedule()


def test_stage_with_local_parameters_is_an_error() -> None:
    """A stage's parameters must be global tensors on its placement (checked before any step)."""
    graph = _staged([P[0], P[1]], [0, 1], steps=1)
    with pytest.raises(
        ValueError,
        match=r"parameter 'weight' of module 'model.stages.0' \(stage 0\) is a local tensor",
    ):
        graph(torch.randn(2, 2))


def test_nested_stages_are_an_error() -> None:
    graph = Holder(WithConfig())
    graph.model.config.set_stage(0, P[0])
    graph.model.encoder.config.set_stage(1, P[1])
    with pytest.raises(
        ValueError, match=r"module 'model.encoder' \(stage 1\) is inside module 'model' \(stage 0\)"
    ):
        graph(torch.randn(2, 4))


# -- gradient accumulation ----------------------------------------------------------------


def test_accumulated_step_equals_full_batch_step() -> None:
    """4 micro-batches of a mean loss, SGD with momentum, 3 steps: the graph's returned losses
    and parameters equal plain full-batch training in this process."""
    torch.manual_seed(0)
    model = WithConfig()
    reference = copy.deepcopy(model)
    graph = Step(model, steps=4, opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        got = graph(x, target=y)
        ref_opt.zero_grad()
        out = reference(x)
        want = F.mse_loss(out, y)
        want.backward()
        ref_opt.step()
        assert not got["loss"].requires_grad
        torch.testing.assert_close(got["loss"], want.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got["mean_out"], out.mean().detach(), atol=1e-6, rtol=1e-6)
        assert all(p.grad is None for p in model.parameters())  # zero_grad after the step
    for got_p, want_p in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got_p, want_p, atol=1e-6, rtol=1e-6)


def test_gradient_is_the_mean_of_micro_batch_gradients_plus_what_was_there() -> None:
    """Without an optimizer the graph leaves .grad = earlier gradient + mean over micro-batches
    of each micro-batch loss's gradient (a sum loss makes the mean differ from the full batch)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    earlier = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), earlier, strict=True):
        p.grad = g.clone()

    class SumLoss(Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.config.set_gradient_accumulation_steps(3)

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model(x).sum()
            loss.backward()
            return loss

    x = torch.randn(6, 3)
    loss = SumLoss()(x)
    reference = copy.deepcopy(model)
    grads = [torch.zeros_like(p) for p in reference.parameters()]
    losses = []
    for xm in x.chunk(3):
        reference.zero_grad()
        out = reference(xm).sum()
        out.backward()
        losses.append(out.detach())
        grads = [g + p.grad for g, p in zip(grads, reference.parameters(), strict=True)]
    torch.testing.assert_close(loss, torch.stack(losses).mean())
    for p, g, e in zip(model.parameters(), grads, earlier, strict=True):
        torch.testing.assert_close(p.grad, e + g / 3)


@pytest.mark.parametrize("fails", ["build", "setting up the stage inputs"])
def test_a_step_that_raises_leaves_the_gradients_as_they_were(
    fails: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever part of the call raises, the gradients there before it are left untouched
    (none lost, no partial gradient of the failed step added)."""
    from sbpflow.nn.pipeline import graph as graph_module

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    earlier = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), earlier, strict=True):
        p.grad = g.clone()

    class Failing(Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.config.set_gradient_accumulation_steps(2)

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model(x).sum()
            loss.backward()
            if fails == "build" and x[0, 0] < 100:  # the first micro-batch's gradient is in
                raise RuntimeError("build failed")
            return loss

    def failing_stage_inputs(stages: Any) -> Any:
        raise RuntimeError("stage inputs failed")

    if fails != "build":
        monkeypatch.setattr(graph_module, "_stage_inputs", failing_stage_inputs)
    with pytest.raises(RuntimeError, match="failed"):
        Failing()(torch.randn(4, 3))
    for p, g in zip(model.parameters(), earlier, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g)


def test_batch_that_the_steps_do_not_divide() -> None:
    graph = Step(nn.Linear(4, 2), steps=4, opt=None)
    with pytest.raises(
        ValueError,
        match=r"into 4 micro-batches .* positional argument 0 has batch size 6 \(shape \(6, 4\)\)",
    ):
        graph(torch.randn(6, 4), target=torch.randn(8, 2))
    with pytest.raises(ValueError, match=r"keyword argument 'target' has batch size 7"):
        graph(torch.randn(8, 4), target=torch.randn(7, 2))


def test_split_microbatches_cuts_every_batch_tensor() -> None:
    """Every tensor with a dim, at any depth, is cut along dim 0; scalars and others repeat."""
    x, scale = torch.arange(12.0).reshape(6, 2), torch.tensor(2.0)
    pieces = split_microbatches(([x, {"s": scale}], "tag"), {"y": x[:, 0]}, 3)
    assert len(pieces) == 3
    for k, (args, kwargs) in enumerate(pieces):
        torch.testing.assert_close(args[0][0], x[2 * k : 2 * k + 2])
        assert args[0][1]["s"] is scale and args[1] == "tag"
        torch.testing.assert_close(kwargs["y"], x[2 * k : 2 * k + 2, 0])


def test_mean_outputs_keeps_structure() -> None:
    Pair = namedtuple("Pair", "a b")
    outs = [Pair(torch.tensor(1.0), [2.0, None]), Pair(torch.tensor(3.0), [4.0, None])]
    mean = mean_outputs(outs)
    assert isinstance(mean, Pair) and mean.b == [3.0, None]
    torch.testing.assert_close(mean.a, torch.tensor(2.0))
    with pytest.raises(TypeError, match="build returned a str; with gradient accumulation"):
        mean_outputs(["a", "b"])


def test_enable_compile_sets_and_restores_compiled_forwards() -> None:
    """``compile_forwards`` gives a module a compiled forward (same values as eager), keeps it
    for the same options, and ``None`` (``enable_compile(False)``) puts the module's own back."""
    from sbpflow.nn.pipeline.runtime._compiled import compile_forwards

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    want = module(x)
    compile_forwards([module], {"backend": "eager"})
    compiled = module.__dict__["forward"]
    assert compiled is not type(module).forward
    assert torch.equal(module(x), want)
    compile_forwards([module], {"backend": "eager"})
    assert module.__dict__["forward"] is compiled  # not compiled again
    compile_forwards([module], None)
    assert "forward" not in module.__dict__ and torch.equal(module(x), want)


def test_enable_compile_takes_a_bool() -> None:
    config = sbpflow.nn.GraphConfig()
    assert not config.compile_enabled
    config.enable_compile(True, backend="aot_eager")
    assert config.compile_enabled and config._compile_options == {"backend": "aot_eager"}
    config.enable_compile(False)
    assert not config.compile_enabled
    with pytest.raises(TypeError, match="enable_compile takes True or False, got 'yes'"):
        config.enable_compile("yes")  # type: ignore[arg-type]
