"""Eager pipelining: a chain of stages on different placements trains with plain forward/backward.

Each stage's parameters live on the stage's own placement; the activation moves to
the next stage with ``to_global`` (a send/recv) and its gradient comes back the same
way. Every batch is cut into two micro-batches whose gradients accumulate before one
``optimizer.step()``. Every rank also trains a plain copy of the stages in one process
(the single-process reference): the losses and every parameter must agree within 1e-5.
Each rank must run only the stages whose placement includes it (a rank outside holds
empty pieces), and the boxing trace must show exactly the transfers the layout implies.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

B, S0 = Broadcast(), Split(0)
_STEPS, _MICRO, _TOL = 3, 2, 1e-5


def _make_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(6, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
        nn.Linear(16, 3),
    ]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(_STEPS)
    ]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference(stages: list[nn.Module]) -> list[float]:
    """Single-process training of the same chain, with the same gradient accumulation."""
    opt = _optimizer([p for s in stages for p in s.parameters()])
    losses = []
    for x, y in _data():
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(_MICRO), y.chunk(_MICRO), strict=True):
            h = xm
            for stage in stages:
                h = stage(h)
            loss = F.mse_loss(h, ym) / _MICRO
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def _pipeline_job(stage_ranks: list[list[int]], stage_sbps: list[Any]) -> dict[str, Any]:
    """Train the chain with stage ``i`` on ``stage_ranks[i]``, its input laid out as ``stage_sbps[i]``."""
    rank = sbpflow.env.get_rank()
    reference = _make_stages()
    stages = copy.deepcopy(reference)
    placements = [sbpflow.placement("cpu", ranks) for ranks in stage_ranks]
    for stage, pl in zip(stages, placements, strict=True):
        stage.to_global(pl, B)
    opt = _optimizer([p for s in stages for p in s.parameters()])

    ran: set[int] = set()  # the stages whose forward computed something on this rank
    for i, stage in enumerate(stages):
        stage.register_forward_hook(
            lambda m, args, out, i=i: ran.add(i) if out.to_local().numel() else None
        )

    losses, collectives = [], []
    for x, y in _data():
        with sbpflow.boxing.trace() as t:
            total = None
            for xm, ym in zip(x.chunk(_MICRO), y.chunk(_MICRO), strict=True):
                h = xm.to_global(placements[0], B).to_global(sbp=stage_sbps[0])
                for i, stage in enumerate(stages):
                    h = stage(h.to_global(placements[i], stage_sbps[i]))
                target = ym.to_global(placements[-1], B)
                loss = F.mse_loss(h, target) / _MICRO
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            opt.step()
            opt.zero_grad()
        collectives.append(dict(t.collectives()))
        assert total is not None
        losses.append(total.item())  # a collective: every rank learns the value

    want_losses = _reference(reference)  # trains ``reference`` in place
    param_errors, held = {}, {}
    for i, (stage, ref) in enumerate(zip(stages, reference, strict=True)):
        for (name, p), want in zip(stage.named_parameters(), ref.parameters(), strict=True):
            local = p.to_local().detach()
            held[f"{i}.{name}"] = local.numel() > 0
            if rank in placements[i]:
                param_errors[f"{i}.{name}"] = (local - want.detach()).abs().max().item()
    return {
        "losses": losses,
        "reference": want_losses,
        "param_errors": param_errors,
        "held": held,
        "ran": sorted(ran),
        "collectives": collectives,
    }


def _check_training(results: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(results):
        assert got["losses"] == pytest.approx(got["reference"], abs=_TOL, rel=_TOL), (rank, got)
        bad = {n: e for n, e in got["param_errors"].items() if e > _TOL}
        assert not bad, f"rank {rank}: parameters differ from the reference: {bad}"


def test_two_stages_on_two_ranks() -> None:
    """Stages 0 and 1 on rank 0, stage 2 on rank 1: losses and parameters equal single-process
    training; rank 1 skips stages 0-1 and rank 0 skips stage 2; per step and rank, one send_recv
    per micro-batch forward (the activation) and one per backward (its gradient), nothing else."""
    results = get_pool(2).run(_pipeline_job, [[0], [0], [1]], [B, B, B])
    _check_training(results)
    assert results[0]["ran"] == [0, 1] and results[1]["ran"] == [2], results
    assert results[0]["held"] == {
        "0.0.weight": True,
        "0.0.bias": True,
        "1.0.weight": True,
        "1.0.bias": True,
        "2.weight": False,
        "2.bias": False,
    }
    assert results[1]["held"] == {n: not h for n, h in results[0]["held"].items()}
    for got in results:
        assert got["collectives"] == [{"send_recv": 2 * _MICRO}] * _STEPS, got["collectives"]


def test_three_stages_with_a_data_parallel_stage() -> None:
    """Stage 0 on rank 0, stage 1 on rank 1, stage 2 data parallel on ranks 2-3 (input split on
    the batch dim, parameters broadcast): losses and parameters equal single-process training,
    and each rank runs only its own stage."""
    results = get_pool(4).run(_pipeline_job, [[0], [1], [2, 3]], [B, B, S0])
    _check_training(results)
    assert [got["ran"] for got in results] == [[0], [1], [2], [2]], results
    for rank, got in enumerate(results):
        mine = {0: "0.", 1: "1.", 2: "2.", 3: "2."}[rank]
        assert got["held"] == {n: n.startswith(mine) for n in got["held"]}, (rank, got["held"])
    # Stage 2's broadcast parameters get partial gradients from its split batch, reduced on
    # ranks 2 and 3 only, in their bucket (made in the first backward): one all_reduce per
    # micro-batch (NOTE [data parallel by default]).
    reduces = [[c.get("all_reduce", 0) for c in got["collectives"]] for got in results]
    assert reduces[0] == reduces[1] == [0] * _STEPS, reduces
    assert reduces[2] == reduces[3] == [_MICRO] * _STEPS, reduces
