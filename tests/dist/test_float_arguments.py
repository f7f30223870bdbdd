"""A rule that reads a float argument is asked again for another value (NOTE [rules]).

Float arguments reach rules as ``FloatArg``s recording whether they were read:
a decision whose rule read one is cached under the exact value, one whose rule
read none serves every value (learning rates change every step). Values are
compared with plain single-process PyTorch computed in the same job.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import GlobalTensor, _dispatch
from sbpflow.ops import _registry
from sbpflow.ops._registry import OpInfo, Strategy, register
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool

aten = torch.ops.aten


def _slope_decides_the_layout() -> list[Any]:
    """leaky_relu under a test rule: a slope above 0.5 gathers to B, else S(0) stays S(0)."""
    world = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    full = torch.randn(4 * world, 3, generator=torch.Generator().manual_seed(0))
    x = full.to_global(placement, broadcast).to_global(sbp=split(0))
    asked: list[float] = []
    saved = {op: _registry._rules[op] for op in (aten.leaky_relu,) if op in _registry._rules}

    @register(aten.leaky_relu.default, family="test: slope decides")
    def by_slope(info: OpInfo) -> list[Strategy]:
        slope = info.arg(1, "negative_slope")
        asked.append(float(slope))
        s = broadcast if slope > 0.5 else split(0)
        return [Strategy((s,), (s,))]

    out = []
    try:
        for slope in (0.1, 0.1, 0.9, 0.9, 0.1):
            with sbpflow.boxing.trace() as t:
                y = torch.nn.functional.leaky_relu(x, slope)
            expected = torch.nn.functional.leaky_relu(full, slope)
            got = y.to_global(sbp=broadcast).to_local()
            out.append((slope, str(y.sbp[0]), dict(t.collectives()), torch.equal(got, expected)))
    finally:
        _registry._rules.pop(aten.leaky_relu.default, None)
        _registry._rules.update(saved)
        _registry._changed()
    return [asked, out]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_a_rule_reading_a_float_decides_per_value(dist_pool: DistributedPool) -> None:
    for asked, out in dist_pool.run(_slope_decides_the_layout):
        assert asked == [0.1, 0.9]  # once per value: repeats reuse the decision
        assert [o[:3] for o in out] == [
            (0.1, "S(0)", {}),
            (0.1, "S(0)", {}),
            (0.9, "B", {"all_gather": 1}),
            (0.9, "B", {"all_gather": 1}),
            (0.1, "S(0)", {}),
        ]
        assert all(o[3] for o in out)


def _adam_with_changing_lr() -> list[Any]:
    """Data-parallel Adam whose learning rate changes every step; counts new decisions.

    The step's ops take the general path here: the handler that runs same-layout pointwise
    ops on the pieces first (NOTE [same-layout pointwise]) is set aside meanwhile."""
    world = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 2)
    model = copy.deepcopy(plain).to_global(placement, broadcast)
    data = torch.randn(4 * world, 3, generator=torch.Generator().manual_seed(1))
    x = data.to_global(placement, broadcast).to_global(sbp=split(0))
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (plain, model)]
    decided = 0
    propagator = GlobalTensor._op_dispatcher.propagator
    decide = propagator.decide

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal decided
        decided += 1
        return decide(*args, **kwargs)

    dispatcher = GlobalTensor._op_dispatcher
    run_rule = dispatcher._run_rule
    full_path = 0  # calls of the optimizer's step that missed the fast path

    def counting_full_path(*args: Any, **kwargs: Any) -> Any:
        nonlocal full_path
        full_path += 1
        return run_rule(*args, **kwargs)

    per_step, full_per_step = [], []
    propagator.decide = counting  # type: ignore[method-assign]
    set_aside = {op._op: _dispatch._special.pop(op._op) for op in _dispatch.SAME_LAYOUT_OPS}
    try:
        for step in range(5):
            before, full_before = decided, full_path
            for m, opt, inp in ((plain, optimizers[0], data), (model, optimizers[1], x)):
                for group in opt.param_groups:
                    group["lr"] = 0.05 / (step + 1)  # a new float every step
                opt.zero_grad()
                m(inp).square().mean().backward()
                if m is model:
                    dispatcher._run_rule = counting_full_path  # type: ignore[method-assign]
                try:
                    opt.step()
                finally:
                    vars(dispatcher).pop("_run_rule", None)  # the method again
            per_step.append(decided - before)
            full_per_step.append(full_path - full_before)
    finally:
        del propagator.decide  # the method again
        _dispatch._special.update(set_aside)
    same = all(
        torch.allclose(g.to_global(sbp=broadcast).to_local(), p, atol=1e-5)
        for g, p in zip(model.parameters(), plain.parameters(), strict=True)
    )
    return [per_step, full_per_step, same]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_the_learning_rate_path_keeps_its_decisions(dist_pool: DistributedPool) -> None:
    for per_step, full_per_step, same in dist_pool.run(_adam_with_changing_lr):
        assert per_step[0] > 0  # the first step decides its ops
        assert per_step[2:] == [0, 0, 0], per_step  # new learning rates: no new decision
        # ... and its calls with new step sizes take the fast path (NOTE [fast path])
        assert full_per_step[0] > 0
        assert full_per_step[2:] == [0, 0, 0], full_per_step
        assert same
