"""A rank holding several stages runs its micro-batches' workers on threads kept across steps.

NOTE [worker threads kept across steps] in sbpflow/nn/pipeline/runtime/_carriers.py: on 2
ranks, 4 stages dealt round-robin (stages 0 and 2 on rank 0, 1 and 3 on rank 1) under
``interleaved_1f1b`` with 4 micro-batches, trained 3 steps with SGD with momentum. Each
stage notes the thread that runs its forward on the rank holding it. From the second step
on, every worker runs on a thread that already ran one in the first step, and no more
threads than micro-batches ever run them. Once the program drops the graph, it is collected
(what a step leaves behind keeps no reference to it) and those threads end.
The losses and final parameters agree within 1e-5 with a plain copy of the model trained
on the whole batch in one process (the single-process reference).
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast
from sbpflow.testing import get_pool

B = Broadcast()
_STEPS, _M, _ROWS, _TOL = 3, 4, 2, 1e-5
_RANKS = [0, 1, 0, 1]


class Noted(nn.Module):
    """A stage that notes, per step, the thread running its forward where it is held."""

    def __init__(self, inner: nn.Module, log: list[list[threading.Thread]]) -> None:
        super().__init__()
        self.inner = inner
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if isinstance(x, sbpflow.GlobalTensor) else x
        if local.numel():  # this rank holds the stage
            self.log[-1].append(threading.current_thread())
        return self.inner(x)


def _plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in _RANKS))


class TrainGraph(sbpflow.nn.Graph):
    def __init__(self, model: nn.Sequential, log: list[list[threading.Thread]]) -> None:
        super().__init__()
        self.model = nn.Sequential(*(Noted(stage, log) for stage in model))
        for s, rank in enumerate(_RANKS):
            placement = sbpflow.placement("cpu", [rank])
            self.model[s].to_global(placement, B)
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(_M)
        self.config.set_pipeline_schedule("interleaved_1f1b")
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def threads_job() -> dict[str, Any]:
    plain = _plain_model()
    log: list[list[threading.Thread]] = []
    graph = TrainGraph(copy.deepcopy(plain), log)
    reference_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    first, last = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    everyone = sbpflow.placement("cpu", [0, 1])
    loss_errors = []
    for _ in range(_STEPS):
        x, y = torch.randn(_M * _ROWS, 6, generator=gen), torch.randn(_M * _ROWS, 6, generator=gen)
        log.append([])
        loss = graph(x.to_global(first, B), y.to_global(last, B))
        reference_opt.zero_grad()
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        reference_opt.step()
        got = loss.to_global(everyone, B).to_local()
        loss_errors.append((got - expected.detach()).abs().max().item())
    param_error = max(
        (mine.detach().to_global(everyone, B).to_local() - theirs.detach()).abs().max().item()
        for mine, theirs in zip(graph.model.parameters(), plain.parameters(), strict=True)
    )
    threads = [t for step in log for t in step]
    result = {
        "forwards per step": [len(step) for step in log],
        "threads": len({id(t) for t in threads}),
        "later steps on first step's threads": all(
            any(t is seen for seen in log[0]) for step in log[1:] for t in step
        ),
        "loss errors": loss_errors,
        "param error": param_error,
    }
    ran, collected = [weakref.ref(t) for t in threads], weakref.ref(graph)
    del graph, threads, loss
    log.clear()
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(ran):
        time.sleep(0.01)
    result["graph collected"] = collected() is None
    result["threads alive after the graph"] = _alive(ran)
    return result


def _alive(refs: list[weakref.ref[threading.Thread]]) -> int:
    """How many of the threads are still running."""
    return len({id(t) for t in (r() for r in refs) if t is not None and t.is_alive()})


def test_workers_run_on_the_same_threads_every_step() -> None:
    for rank, got in enumerate(get_pool(2).run(threads_job)):
        assert got["forwards per step"] == [2 * _M] * _STEPS, (rank, got)  # 2 stages x 4
        assert got["later steps on first step's threads"], (rank, got)
        assert 1 <= got["threads"] <= _M, (rank, got)
        assert all(e < _TOL for e in got["loss errors"]), (rank, got)
        assert got["param error"] < _TOL, (rank, got)
        assert got["graph collected"] and got["threads alive after the graph"] == 0, (rank, got)
