"""The propagator decides from metadata alone, in one process with no process group (NOTE
[decide, then run] in sbpflow/_decisions.py).

A 2-rank placement's calls are decided here without any rank existing: the decisions are the
layouts DESIGN.md's matmul table names, the meta kernel's shapes equal plain torch's on
tensors of the logical shapes, and the cache serves a repeated call (and a call differing
only in a float the rule does not read) without deciding again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

import sbpflow
from sbpflow._decisions import Decision, Propagator, call_key, metadata_of
from sbpflow._global import GlobalTensor, meta_of
from sbpflow._layout import Layout
from sbpflow.ops import _registry
from sbpflow.sbp import Broadcast, Partial, Split

aten = torch.ops.aten
PLACEMENT = sbpflow.placement("cpu", [0, 1])
S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")


def _stand_in(shape: tuple[int, ...], sbp: Any) -> GlobalTensor:
    """A global tensor of ``shape`` laid out as ``sbp`` on 2 ranks; only its metadata is read."""
    meta = meta_of(Layout(PLACEMENT, (sbp,)), shape, torch.float32)
    return sbpflow._global.wrap(torch.empty(0), meta)


def _decide(propagator: Propagator, func: Any, *args: Any) -> Decision | None:
    flat, spec = tree_flatten((args, {}))
    registered = _registry.lookup(func)
    assert registered is not None
    return propagator.propagate(
        registered, func, args, {}, metadata_of(flat), spec, PLACEMENT, kept=[]
    )


def test_matmul_decisions_follow_the_table_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the propagator called torch.distributed")

    for name in ("new_group", "get_rank", "get_world_size", "all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, refuse)
    propagator = Propagator()
    x, w = _stand_in((8, 4), S0), _stand_in((4, 6), B)
    decision = _decide(propagator, aten.mm.default, x, w)
    assert decision is not None
    assert [layout.sbp for layout in decision.input_layouts] == [(S0,), (B,)]
    assert [layout.sbp for layout in decision.output_layouts] == [(S0,)]
    assert decision.output_metas[0].shape == tuple(
        torch.mm(torch.ones(8, 4), torch.ones(4, 6)).shape
    )
    a, b = _stand_in((8, 4), S1), _stand_in((4, 6), S0)
    decision = _decide(propagator, aten.mm.default, a, b)
    assert decision is not None
    assert [layout.sbp for layout in decision.output_layouts] == [(P,)]


def test_a_repeated_call_is_decided_once() -> None:
    propagator = Propagator()
    made = []
    decide = propagator.decide

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args[1])
        return decide(*args, **kwargs)

    propagator.decide = counting  # type: ignore[method-assign]
    x = _stand_in((8, 4), S0)
    first = _decide(propagator, aten.mul.Tensor, x, 0.5)
    again = _decide(propagator, aten.mul.Tensor, x, 0.25)  # a float mul's rule does not read
    assert first is again and made == [aten.mul.Tensor]
    _decide(propagator, aten.mul.Tensor, _stand_in((8, 4), B), 0.5)
    assert len(made) == 2


def test_call_key_tells_apart_what_a_decision_depends_on() -> None:
    x = _stand_in((8, 4), S0)
    add = aten.add.Tensor
    assert call_key(add, (x, x), {"alpha": 1}, False) != call_key(
        add, (x, x), {"alpha": 1.0}, False
    )
    assert call_key(add, (x, x), {"alpha": 1}, False) != call_key(
        add, (x, x), {"alpha": True}, False
    )
    assert call_key(add, (x, 0.5), {}, True) == call_key(add, (x, 0.25), {}, True)
    assert call_key(add, (x, 0.5), {}, False) != call_key(add, (x, 0.25), {}, False)
    y = _stand_in((8, 4), B)
    assert call_key(add, (x, x), {}, False) != call_key(add, (x, y), {}, False)
    plain = torch.ones(())
    assert call_key(add, (x, plain), {}, False) == call_key(add, (x, torch.zeros(())), {}, False)
    cat = aten.cat.default
    assert call_key(cat, ([x, y], 0), {}, False) != call_key(cat, ([y, x], 0), {}, False)


@pytest.mark.parametrize(
    "placement",
    [PLACEMENT, sbpflow.placement("cpu", [[0, 1], [2, 3]]), sbpflow.placement("cpu", [[0], [1]])],
    ids=["2 ranks", "2x2", "2x1"],
)
def test_the_fallback_decision_broadcasts_every_input(placement: sbpflow.placement) -> None:
    """Every input, and the outputs, laid out so that each rank of the placement holds the
    whole tensor (its box is the whole shape) and no rank a partial part."""
    shape = (7, 5)
    whole = ((0, 7), (0, 5))
    decision = Decision.broadcast_everything(placement, 3)
    assert decision.fallback is not None and len(decision.input_layouts) == 3
    for layout in (*decision.input_layouts, decision.fallback):
        assert layout.placement == placement
        assert not any(isinstance(s, Partial) for s in layout.sbp), layout
        assert all(layout.box(shape, rank) == whole for rank in placement.flat_ranks), layout
    assert not decision.gradients
