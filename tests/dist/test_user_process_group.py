"""A default process group the user created stays theirs (NOTE [teardown] in comm/_world.py).

Scripts run on 2 ranks under plain ``torchrun``; each calls ``init_process_group("gloo")``
itself, as torch's tutorials do, and uses sbpflow (boxing, a data-parallel step, a transfer
to another placement; the model and tensors are still held at exit), with values checked
against plain torch in the script:

- a script that calls ``destroy_process_group()`` itself at the end exits 0 on both ranks,
  with nothing on stderr (no error, no warning, no "terminate called");
- a script that never destroys its group finds it, in an exit handler that runs after
  sbpflow's, still initialised and working (an all_reduce on it gives the sum), with no
  gloo thread left but the default group's own (as many as after ``init_process_group``
  and a barrier, once their number holds, before sbpflow made any group), then destroys it
  itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300

USE_SBPFLOW = """
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import sbpflow
    from sbpflow.sbp import broadcast, split


    def gloo_threads():
        names = [Path(f"/proc/self/task/{t}/comm").read_text() for t in os.listdir("/proc/self/task")]
        return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


    def settled_gloo_threads():
        # Once their number has held for a second: a thread is counted once it has named
        # itself, which a busy machine may delay.
        counts = [gloo_threads()]
        while len(counts) < 100 and (len(counts) < 11 or len(set(counts[-11:])) > 1):
            time.sleep(0.1)
            counts.append(gloo_threads())
        return counts[-1]


    def use_sbpflow():
        rank = dist.get_rank()
        placement = sbpflow.placement("cpu", [0, 1])
        value = torch.arange(12.0).reshape(6, 2)
        x = value.to_global(placement, broadcast).to_global(sbp=split(0))
        assert torch.equal(x.to_global(sbp=broadcast).to_local(), value)
        moved = x.to_global(sbpflow.placement("cpu", [1]), broadcast)  # a transfer group
        if rank == 1:
            assert torch.equal(moved.to_local(), value)
        torch.manual_seed(0)
        plain = torch.nn.Linear(2, 1)
        model = torch.nn.Linear(2, 1).to_global(placement, broadcast)
        model.load_state_dict(plain.state_dict())
        y = value.sum(1, keepdim=True)
        F.mse_loss(plain(value), y).backward()
        F.mse_loss(model(x), y.to_global(placement, broadcast).to_global(sbp=split(0))).backward()
        assert torch.allclose(model.weight.grad.to_local(), plain.weight.grad), rank
        return model, x, moved  # a script holds its model and tensors to the end
"""

DESTROYS_ITS_GROUP = (
    """
    import os
    from pathlib import Path
"""
    + USE_SBPFLOW
    + """

    dist.init_process_group("gloo")
    kept = use_sbpflow()
    print(f"rank {dist.get_rank()}: done", flush=True)
    dist.destroy_process_group()
"""
)

KEEPS_ITS_GROUP = (
    """
    import atexit
    import os
    from pathlib import Path

    own_threads = []  # the gloo threads right after init_process_group


    def after_sbpflow_exit_handler():
        # Registered before sbpflow is imported (which registers its own), so it runs last.
        threads = gloo_threads()
        alive = dist.is_initialized()
        total = torch.ones(1) * (dist.get_rank() + 1)
        if alive:
            dist.all_reduce(total)
        print(
            f"rank {os.environ['RANK']}: at exit initialized {alive}, all_reduce {total.item()}, "
            f"gloo threads {threads} of {own_threads[0]}", flush=True
        )
        dist.destroy_process_group()


    atexit.register(after_sbpflow_exit_handler)
"""
    + USE_SBPFLOW
    + """

    dist.init_process_group("gloo")
    dist.barrier()
    own_threads.append(settled_gloo_threads())
    kept = use_sbpflow()
    print(f"rank {dist.get_rank()}: done with {gloo_threads()} gloo threads", flush=True)
"""
)


def _torchrun(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_group.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # else torchrun warns that it sets it
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run(
        [*argv, str(script)],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def test_a_script_that_destroys_its_own_group_exits_cleanly(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, DESTROYS_ITS_GROUP)
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    assert sorted(re.findall(r"rank (\d): done", result.stdout)) == ["0", "1"], output
    assert result.stderr.strip() == "", output


def test_sbpflow_leaves_a_group_the_user_created_to_them(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, KEEPS_ITS_GROUP)
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    done = dict(re.findall(r"rank (\d): done with (\d+) gloo threads", result.stdout))
    at_exit = re.findall(
        r"rank (\d): at exit initialized (\w+), all_reduce ([\d.]+), gloo threads (\d+) of (\d+)",
        result.stdout,
    )
    assert sorted(done) == ["0", "1"], output
    assert sorted(rank for rank, *_ in at_exit) == ["0", "1"], output
    for rank, alive, total, threads, own in at_exit:
        assert alive == "True" and float(total) == 3.0, output  # 1 + 2: the group still works
        assert int(done[rank]) > int(own) > 0, output  # sbpflow's groups had threads of theirs
        assert threads == own, output  # only the user's group's threads are left
    assert result.stderr.strip() == "", output
