"""At exit every process group is freed while the interpreter still runs (NOTE [teardown]).

A group left alive into interpreter finalization keeps gloo worker threads, and one that
lets go of a finished work then needs the GIL and aborts the process ("terminate called
without an active exception"). Whether that moment is hit is a matter of timing (the
soak tool, ``tools/soak.py``, counts the aborts); what decides it is not: after the exit
handlers no gloo thread of sbpflow's may be left, whatever the script still holds (a model
whose gradient sync reduces on a group, a global tensor). Here sbpflow created the default
group; a group the user created is theirs, and only its threads are left
(tests/dist/test_user_process_group.py).
Reference: a process with no process group has no gloo thread (``_gloo_threads`` counts
``pt_gloo_*`` and ``gloo_*`` threads in /proc, outside torch).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import sbpflow
from sbpflow.comm import _groups, _world
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool

_kept: list[object] = []  # what a script still holds at exit


def _gloo_threads() -> int:
    names = [Path(f"/proc/self/task/{t}/comm").read_text() for t in os.listdir("/proc/self/task")]
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def _train_one_data_parallel_step() -> None:
    """One data-parallel step of a small model, kept alive as a script keeps its model."""
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to_global(placement, broadcast)
    x = torch.randn(4, 3).to_global(placement, split(0))
    model(x).sum().backward()  # the gradients are reduced in buckets on a group
    _kept.append(model)


class _TwoStages(sbpflow.nn.Graph):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        for s in (0, 1):
            placement = sbpflow.placement("cpu", [s])
            self.model[s].to_global(placement, broadcast)
            self.model[s].config.set_stage(s, placement)
        self.config.set_gradient_accumulation_steps(2)

    def build(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).sum()
        loss.backward()
        return loss


def _train_two_pipelined_steps() -> None:
    """Two pipelined steps (the second posts receives early), the graph kept alive."""
    graph = _TwoStages()
    for _ in range(2):
        graph(torch.ones(4, 3).to_global(sbpflow.placement("cpu", [0]), broadcast))
    _kept.append(graph)


def _box_train_then_run_the_exit_handlers() -> tuple[bool, int, int]:
    world = sbpflow.env.get_world_size()
    x = torch.ones(2, 3).to_global(sbpflow.placement("cpu", list(range(world))), split(0))
    _kept.append(x.to_global(sbp=broadcast))  # groups, a gathered meta check, an all_gather
    _train_one_data_parallel_step()
    _train_two_pipelined_steps()
    on_default_group = any(h is dist.group.WORLD for h in _groups._groups.values())
    before = _gloo_threads()
    _world._teardown_at_exit()
    return on_default_group, before, _gloo_threads()


def test_exit_handlers_join_every_gloo_thread() -> None:
    """sbpflow created the default group (a launched rank): no gloo thread after the handlers,
    and sbpflow's collectives ran on groups of its own, even over the whole world (anything
    may keep the default group alive past the handlers)."""
    with DistributedPool(2, timeout=60.0) as pool:
        results = pool.run(_box_train_then_run_the_exit_handlers)
    for on_default_group, before, after in results:
        assert not on_default_group
        assert before > 0  # the check can fail: there were threads to join
        assert after == 0
