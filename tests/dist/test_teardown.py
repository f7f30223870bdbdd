"""At exit every process group is freed while the interpreter still runs (NOTE [teardown]).

A group left alive into interpreter finalization keeps gloo worker threads, and one that
lets go of a finished work then needs the GIL and aborts the process ("terminate called
without an active exception"). Whether that moment is hit is a matter of timing (the
soak tool, ``tools/soak.py``, counts the aborts); what decides it is not: after the exit
handlers no gloo thread may be left, whoever created the default group and whatever the
script still holds (a model whose gradient sync reduces on a group, a global tensor).
Reference: a process with no process group has no gloo thread (``_gloo_threads`` counts
``pt_gloo_*`` and ``gloo_*`` threads in /proc, outside torch).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

import sbpflow
from sbpflow.comm import _groups, _world
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120
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


# The script of a user who creates the gloo group as torch's tutorials do and never
# destroys it. Its first exit handler, registered before sbpflow is imported, runs last
# (handlers run in reverse order) and reports the gloo threads still alive then.
USER_GROUP_SCRIPT = """
    import atexit
    import os
    from pathlib import Path


    def report():
        names = [Path(f"/proc/self/task/{t}/comm").read_text() for t in os.listdir("/proc/self/task")]
        alive = sum(name.startswith(("pt_gloo", "gloo_")) for name in names)
        print(f"rank {os.environ['RANK']}: {alive} gloo threads after the exit handlers", flush=True)


    atexit.register(report)

    import torch
    import torch.distributed as dist

    import sbpflow
    from sbpflow.sbp import broadcast, split
    from tests.dist.test_teardown import _gloo_threads, _train_one_data_parallel_step

    dist.init_process_group("gloo")
    placement = sbpflow.placement("cpu", [0, 1])
    x = torch.arange(6.0).reshape(3, 2).to_global(placement, split(0))
    y = x.to_global(sbp=broadcast)
    z = x.to_global(sbpflow.placement("cpu", [1]), broadcast)  # a transfer group
    _train_one_data_parallel_step()
    print(f"rank {dist.get_rank()}: {_gloo_threads()} gloo threads at the end", flush=True)
"""


def test_a_group_the_user_created_is_freed_at_exit(tmp_path: Path) -> None:
    """The user ran ``init_process_group("gloo")`` under torchrun and never destroyed it; the
    script still holds global tensors and a data-parallel model: no gloo thread is left
    after the exit handlers, on either rank."""
    script = tmp_path / "user_group.py"
    script.write_text(textwrap.dedent(USER_GROUP_SCRIPT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*argv, str(script)],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    at_end = dict(re.findall(r"rank (\d): (\d+) gloo threads at the end", result.stdout))
    after = dict(
        re.findall(r"rank (\d): (\d+) gloo threads after the exit handlers", result.stdout)
    )
    assert sorted(at_end) == sorted(after) == ["0", "1"], output
    assert all(int(n) > 0 for n in at_end.values()), output  # there were threads to join
    assert after == {"0": "0", "1": "0"}, output
