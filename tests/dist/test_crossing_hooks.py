"""The generic extension points a caller plugs its own transfers into (NOTE [transports] in
sbpflow/boxing/executor.py, NOTE [crossing hooks] in sbpflow/boxing/_redistribute.py).

On 2 ranks, a 4 x 3 tensor split along dim 0 on rank 0 and broadcast on rank 1's placement:

- ``box_below_autograd`` with a transport hands that transport every message (rank 0 sends
  its rows to rank 1, rank 1 receives them) and gives the value plain torch has;
- with step hooks installed in a ``contextvars.Context``, ``to_global`` across placements
  shows the crossing to ``crossing_forward`` (whose transport moves the data) and hands the
  gradient to ``crossing_backward``; the gradient it moves back equals plain torch's.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

import sbpflow
from sbpflow import _step_context
from sbpflow._layout import Layout
from sbpflow.boxing._redistribute import Redistribute, box_below_autograd
from sbpflow.comm import collectives
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

B = Broadcast()


def _value() -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(4, 3)


class Recording:
    """A transport that records each call's messages and moves them with comm's exchange."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], str, tuple[int, ...]]] = []

    def __call__(self, sends: Any, recvs: Any, device_type: str, members: Any) -> None:
        self.calls.append(([p for p, _ in sends], [p for p, _ in recvs], device_type, members))
        collectives.exchange(sends, recvs, device_type, members)


def _source() -> sbpflow.GlobalTensor:
    return _value().to_global(sbpflow.placement("cpu", [0]), Split(0))


def transport_job() -> dict[str, Any]:
    transport = Recording()
    dst = Layout(sbpflow.placement("cpu", [1]), (B,))
    y = box_below_autograd(_source(), dst, transport)
    return {"calls": transport.calls, "local": y.to_local()}


def test_a_transport_moves_every_message_of_a_change_of_placement() -> None:
    for rank, got in enumerate(get_pool(2).run(transport_job)):
        sends, recvs = ([1], []) if rank == 0 else ([], [0])
        assert got["calls"] == [(sends, recvs, "cpu", (0, 1))], rank
        if rank == 1:
            assert torch.equal(got["local"], _value())
        else:
            assert got["local"].numel() == 0


class Hooks:
    """Step hooks that move each crossing with a recording transport."""

    def __init__(self) -> None:
        self.forward = Recording()
        self.backward = Recording()
        self.crossings: list[str] = []

    def take_backward(self, *args: Any) -> bool:
        return False

    def crossing_forward(self, ctx: Any, x: Any, dst: Layout) -> Any:
        self.crossings.append(f"{x.placement} -> {dst.placement}")
        return self.forward

    def crossing_backward(self, ctx: Any, grad: Any) -> Any:
        return Redistribute.apply(grad, ctx.src, self.backward)


def hooks_job() -> dict[str, Any]:
    hooks = Hooks()
    x = _source().requires_grad_()

    def step() -> torch.Tensor:
        y = x.to_global(sbpflow.placement("cpu", [1]), B)
        (y * y).sum().backward()
        return y

    context = contextvars.copy_context()
    context.run(_step_context.current.set, hooks)
    context.run(step)
    grad = x.grad.to_global(sbpflow.placement("cpu", [0, 1]), B).to_local()
    return {
        "crossings": hooks.crossings,
        "forward": len(hooks.forward.calls),
        "backward": len(hooks.backward.calls),
        "grad": grad,
        "outside": _step_context.current.get() is None,
    }


def test_step_hooks_see_each_crossing_and_move_its_gradient() -> None:
    expected = 2 * _value()  # d/dx of sum(x * x), plain torch
    for rank, got in enumerate(get_pool(2).run(hooks_job)):
        assert got["crossings"] == ["placement('cpu', [0]) -> placement('cpu', [1])"], (
            rank,
            got["crossings"],
        )
        assert (got["forward"], got["backward"]) == (1, 1), rank
        assert torch.equal(got["grad"], expected), rank
        assert got["outside"], rank
