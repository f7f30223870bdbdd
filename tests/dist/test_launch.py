"""The launcher (``python -m sbpflow.distributed.launch``) and plain torchrun, end to end.

Each test starts real processes the way a user would and checks what a user sees: one line
per rank on success; on failure a non-zero exit within seconds, the failing rank's traceback
on the console, and no process left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from sbpflow.distributed import launch

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 60
FAIL_FAST_BOUND_S = 30

OK_SCRIPT = """
    import sys

    import torch
    import torch.distributed as dist

    import sbpflow.env

    sbpflow.env.ensure_initialized()
    rank = sbpflow.env.get_rank()
    world_size = sbpflow.env.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"rank {rank} of {world_size}: sum of ranks {int(total.item())}", flush=True)
"""

FAILING_SCRIPT = """
    import time

    import torch
    import torch.distributed as dist

    import sbpflow.env

    sbpflow.env.ensure_initialized()
    rank = sbpflow.env.get_rank()
    if rank == 2:
        time.sleep(0.5)
        # CLOCK_MONOTONIC is system-wide on Linux: the test compares it with its own clock.
        print(f"raising at {time.monotonic()}", flush=True)
        raise RuntimeError("boom from rank 2")
    if rank == 3:
        time.sleep(300)  # blocks outside any collective: only the launcher can end it
    dist.barrier()  # blocks in a collective that rank 2 never joins
    time.sleep(300)
"""


ONE_RANK_READS_SCRIPT = """
    import torch

    import sbpflow
    from sbpflow.sbp import partial_sum

    rank = sbpflow.env.get_rank()
    placement = sbpflow.placement("cpu", [0, 1])
    loss = torch.tensor(2.0 if rank == 0 else 0.5).to_global(placement, partial_sum)
    if rank == 0:
        print(loss.item())  # only rank 0 reads; rank 1 finishes the program
"""


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["SBPFLOW_TIMEOUT"] = "120"
    # Keep a launch from the test runner's own torchrun environment (if any) out of these runs.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _pids_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (this one excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def _run(argv: list[str], marker: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``argv``; return the result and the ``time.monotonic()`` at which it ended.

    On timeout kill everything carrying ``marker`` and fail the test.
    """
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in _pids_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{argv} did not finish in {RUN_TIMEOUT_S}s\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
    ended = time.monotonic()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), ended


def _assert_one_line_per_rank(result: subprocess.CompletedProcess[str], world_size: int) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    # Ranks share one stdout pipe, so their lines may interleave: match, don't split.
    lines = set(re.findall(r"rank \d+ of \d+: sum of ranks \d+", result.stdout))
    expected_sum = sum(range(world_size))
    expected = {
        f"rank {rank} of {world_size}: sum of ranks {expected_sum}" for rank in range(world_size)
    }
    assert lines == expected, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_launcher_runs_four_ranks(tmp_path: Path) -> None:
    script = _write(tmp_path, "ok.py", OK_SCRIPT)
    marker = f"marker-{uuid.uuid4().hex}"
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", "4"]
    result, _ = _run([*argv, str(script), marker], marker)
    _assert_one_line_per_rank(result, 4)


def test_torchrun_runs_four_ranks(tmp_path: Path) -> None:
    script = _write(tmp_path, "ok.py", OK_SCRIPT)
    marker = f"marker-{uuid.uuid4().hex}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    result, _ = _run([*argv, str(script), marker], marker)
    _assert_one_line_per_rank(result, 4)


THREADS_SCRIPT = """
    import os

    import torch

    rank = os.environ["RANK"]
    print(f"rank {rank}: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"torch threads {torch.get_num_threads()}", flush=True)
"""


@pytest.mark.parametrize(
    ("nproc", "user_setting", "threads"),
    [(1, None, 1), (2, None, 1), (1, "2", 2), (2, "2", 2)],
    ids=["1rank", "2ranks", "1rank-user-set", "2ranks-user-set"],
)
def test_every_rank_gets_the_same_threads_for_one_process_and_many(
    tmp_path: Path, nproc: int, user_setting: str | None, threads: int
) -> None:
    """One thread per rank by default, with one process as with several (so a run with
    ``--nproc_per_node 1`` is the single-rank run of the same script, not one that fights for
    the cores); an OMP_NUM_THREADS the user set is kept."""
    script = _write(tmp_path, "threads.py", THREADS_SCRIPT)
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", str(nproc)]
    env = _env()
    env.pop("OMP_NUM_THREADS", None)
    if user_setting is not None:
        env["OMP_NUM_THREADS"] = user_setting
    result = subprocess.run(
        [*argv, str(script)],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = set(re.findall(r"rank \d+: OMP_NUM_THREADS=\S+ torch threads \d+", result.stdout))
    assert lines == {
        f"rank {rank}: OMP_NUM_THREADS={threads} torch threads {threads}" for rank in range(nproc)
    }, f"{result.stdout}\n{result.stderr}"


def test_failing_rank_stops_the_run(tmp_path: Path) -> None:
    script = _write(tmp_path, "fails.py", FAILING_SCRIPT)
    marker = f"marker-{uuid.uuid4().hex}"
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", "4"]
    result, ended = _run([*argv, str(script), marker], marker)

    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    raised = re.search(r"raising at (\d+\.\d+)", result.stdout)
    assert raised, output
    elapsed = ended - float(raised[1])
    assert 0 < elapsed < FAIL_FAST_BOUND_S, f"exited {elapsed:.1f}s after rank 2 raised\n{output}"
    assert "Traceback" in output, output
    assert 'raise RuntimeError("boom from rank 2")' in output, output
    assert "RuntimeError: boom from rank 2" in output, output

    deadline = time.monotonic() + 2.0
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = _pids_with(marker)
    for pid in leftover:  # do not leak them into the rest of the suite
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not leftover, f"processes still running after the launcher exited: {leftover}"


def test_a_peer_that_exited_is_named_with_the_collective_call(tmp_path: Path) -> None:
    """Rank 0 reads a value alone and rank 1 exits: rank 0's error names its call and line as a
    collective every rank must reach, and says the peer may have finished without it."""
    script = _write(tmp_path, "reads_alone.py", ONE_RANK_READS_SCRIPT)
    marker = f"marker-{uuid.uuid4().hex}"
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", "2"]
    result, _ = _run([*argv, str(script), marker], marker)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    reading = "print(loss.item())  # only rank 0 reads; rank 1 finishes the program"
    lines = [text.strip() for text in script.read_text().splitlines()]
    site = f"reads_alone.py:{lines.index(reading) + 1}"
    assert f"failed in item() at {site}, a collective: every rank in it must reach it" in output, (
        output
    )
    assert "finished the program without making this call" in output, output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc_per_node", "0", "x.py"], "--nproc_per_node must be an integer >= 1, got 0"),
        (["--nproc_per_node", "two", "x.py"], "--nproc_per_node must be an integer >= 1"),
        (["--nproc_per_node", "2"], "the following arguments are required: script"),
        (["--nproc_per_node", "2", "no/such/script.py"], "'no/such/script.py' not found"),
        (["--nnodes", "2", "--node_rank", "2", "x.py"], "--node_rank must be in 0..1"),
        (["--master_port", "70000", "x.py"], "--master_port must be a TCP port"),
    ],
)
def test_bad_arguments_are_clear_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_single_node_uses_a_free_port_and_fast_monitoring() -> None:
    parsed = launch._parser().parse_args(["--nproc_per_node", "3", "train.py", "--lr", "1"])
    argv = launch.to_torchrun_argv(parsed)
    assert "--standalone" in argv
    assert "--monitor_interval=0.1" in argv
    assert argv[-3:] == ["train.py", "--lr", "1"]


def test_multi_node_uses_static_rendezvous() -> None:
    parsed = launch._parser().parse_args(
        ["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.1.2.3", "train.py"]
    )
    argv = launch.to_torchrun_argv(parsed)
    assert "--standalone" not in argv
    assert {"--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3", "--master_port=29500"} <= set(
        argv
    )


def test_options_an_older_torchrun_lacks_are_dropped() -> None:
    parser = launch._parser()  # knows --nproc_per_node but not --shutdown_timeout
    argv = ["--nproc_per_node=2", "--shutdown_timeout=5", "train.py", "--shutdown_timeout=7"]
    assert launch._drop_unknown_options(argv, parser) == [
        "--nproc_per_node=2",
        "train.py",
        "--shutdown_timeout=7",
    ]
