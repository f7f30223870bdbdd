"""Rules users register: one registered after an op has already run replaces the dispatcher's
cached decisions, and docs/ops.md's example (a rule for a custom op, through the public
``sbpflow.ops``) runs as written on 2 ranks and checks itself against one process."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.ops import _registry
from sbpflow.ops._registry import OpInfo, Strategy, register
from sbpflow.sbp import Broadcast, split
from sbpflow.testing import DistributedPool

aten = torch.ops.aten


def _neg_twice_with_a_new_rule_between() -> list[Any]:
    world = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    full = torch.arange(4.0 * world * 3).reshape(4 * world, 3)
    x = full.to_global(placement, sbpflow.sbp.broadcast).to_global(sbp=split(0))
    for _ in range(3):  # repeated calls: the decision is cached and the fast path taken
        with sbpflow.boxing.trace() as before:
            y = torch.neg(x)
    saved = {
        op: _registry._rules[op] for op in (aten.neg, aten.neg.default) if op in _registry._rules
    }

    @register(aten.neg.default, family="test: broadcast only")
    def broadcast_only(info: OpInfo) -> list[Strategy]:
        return [Strategy((Broadcast(),), (Broadcast(),))]

    try:
        with sbpflow.boxing.trace() as after:
            z = torch.neg(x)
    finally:
        _registry._rules.pop(aten.neg.default, None)
        _registry._rules.update(saved)
        _registry._changed()
    with sbpflow.boxing.trace() as restored:
        w = torch.neg(x)
    return [
        (y.sbp == (split(0),), dict(before.collectives())),
        (z.sbp == (sbpflow.sbp.broadcast,), dict(after.collectives())),
        (w.sbp == (split(0),), dict(restored.collectives())),
        torch.equal(z.to_global(sbp=sbpflow.sbp.broadcast).to_local(), -full),
    ]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_a_rule_registered_later_is_used_at_once(dist_pool: DistributedPool) -> None:
    for result in dist_pool.run(_neg_twice_with_a_new_rule_between):
        before, after, restored, correct = result
        assert before == (True, {})  # S(0) stays S(0): no collective
        assert after == (True, {"all_gather": 1})  # the new rule boxes to B
        assert restored == (True, {})
        assert correct


_OPS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def _docs_example() -> str:
    """The Python block between the custom-op example's markers in docs/ops.md."""
    found = re.search(
        r"<!-- custom-op-example:start -->\n<!-- run: launch 2 -->\n```python\n(.*?)```\n"
        r"<!-- custom-op-example:end -->",
        _OPS_PAGE.read_text(),
        re.S,
    )
    assert found, "docs/ops.md lost its custom-op example markers"
    return found.group(1)


def run_docs_example(code: str) -> dict[str, Any]:
    """Worker: run the example as a script would (its asserts compare with one process)."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(_OPS_PAGE), "exec"), namespace)
    out, trace = namespace["out"], namespace["t"]
    return {
        "printed": printed.getvalue(),
        "sbp": out.sbp,
        "collectives": dict(trace.collectives()),
        "fallbacks": list(trace.fallbacks),
    }


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_the_custom_op_example_in_the_docs_runs(dist_pool: DistributedPool) -> None:
    """docs/ops.md's custom op with its rule runs on split pieces, with no collective and no
    fallback, and equals the op on the whole tensors in one process (values and gradients:
    the example's own asserts)."""
    results = dist_pool.run(run_docs_example, _docs_example())
    for rank, got in enumerate(results):
        assert got["sbp"] == (split(1),), (rank, got)
        assert got["collectives"] == {} and got["fallbacks"] == [], (rank, got)
    assert results[0]["printed"].strip().endswith("equal to one process"), results[0]
