"""A pipelined step runs with Python's cyclic garbage collector paused (NOTE [no garbage
collection inside a step] in sbpflow/nn/pipeline/runtime/_step.py): ``build`` sees it off on
every rank, and it is back as it was after the step (on, or off if the program had turned it
off)."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast
from sbpflow.testing import get_pool


class Watching(sbpflow.nn.Graph):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for s in (0, 1):
            placement = sbpflow.placement("cpu", [s])
            self.model[s].to_global(placement, broadcast)
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(2)
        self.seen: list[bool] = []

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def collector_job() -> dict[str, list[bool]]:
    graph = Watching()
    x = torch.ones(4, 4).to_global(sbpflow.placement("cpu", [0]), broadcast)
    y = torch.zeros(4, 4).to_global(sbpflow.placement("cpu", [1]), broadcast)
    after = []
    graph(x, y)
    after.append(gc.isenabled())
    gc.disable()
    try:
        graph(x, y)
        after.append(gc.isenabled())
    finally:
        gc.enable()
    return {"in build": graph.seen, "after": after}


def test_the_collector_is_paused_in_a_step_and_restored_after() -> None:
    for rank, got in enumerate(get_pool(2).run(collector_job)):
        assert got["in build"] == [False] * 4, (rank, got)  # 2 steps x 2 micro-batches
        assert got["after"] == [True, False], (rank, got)
