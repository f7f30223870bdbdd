"""At exit every process group is freed while the interpreter still runs (NOTE [teardown]).

A group left alive into interpreter finalization keeps gloo worker threads
that can abort the process ("terminate called without an active exception").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import sbpflow
from sbpflow.comm import _world
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool


def _gloo_threads() -> int:
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return sum(name.startswith("pt_gloo") for name in names)


def _box_then_run_the_exit_handlers() -> tuple[int, int]:
    world = sbpflow.env.get_world_size()
    x = torch.ones(2, 3).to_global(sbpflow.placement("cpu", list(range(world))), split(0))
    x.to_global(sbp=broadcast)  # groups, a gathered meta check, an all_gather
    before = _gloo_threads()
    _world._destroy_at_exit()
    _world._forget_at_exit()
    return before, _gloo_threads()


def test_exit_handlers_join_every_gloo_thread() -> None:
    with DistributedPool(2, timeout=60.0) as pool:
        results = pool.run(_box_then_run_the_exit_handlers)
    for before, after in results:
        assert before > 0  # the check can fail: there were threads to join
        assert after == 0
