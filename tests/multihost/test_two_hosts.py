"""Two simulated hosts: the 2-D boxing matrix and a DP x TP training step across a network.

Each host is a network namespace joined to the other by a veth pair, with its own
hostname and its own /dev/shm (UTS and mount namespaces), and runs
``python -m sbpflow.distributed.launch --nnodes 2 --nproc_per_node 2`` of
``two_host_job.py``, which compares every result with a single-process reference.
The test repeats the whole job and requires every run to end cleanly: every process
exits 0, none aborts, none hangs past the limit. Skipped where network namespaces
cannot be made (not root, no ``ip``, or a sandbox that forbids them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("two_host_job.py")
RUNS = int(os.environ.get("SBPFLOW_TWO_HOST_RUNS", "20"))
RUN_LIMIT_S = (
    240  # one run takes ~10 s on a 2-core machine; a hang is caught well before CI's limit
)
SUBNET = "10.231.7"
PORT = 29611

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair: ``[(namespace, interface, address)] * 2``."""
    tag = f"{os.getpid() % 100000}"
    hosts = [
        (f"sbpflow-a{tag}", f"sbpa{tag}", f"{SUBNET}.1"),
        (f"sbpflow-b{tag}", f"sbpb{tag}", f"{SUBNET}.2"),
    ]
    made: list[str] = []
    try:
        for namespace, _, _ in hosts:
            _ip("netns", "add", namespace)
            made.append(namespace)
        (_, if_a, _), (_, if_b, _) = hosts
        _ip("link", "add", if_a, "type", "veth", "peer", "name", if_b)
        for namespace, interface, address in hosts:
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace in made:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _can_make_namespaces() -> str | None:
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs the ip and unshare commands"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    try:
        with two_hosts():
            pass
    except subprocess.CalledProcessError as error:
        return f"cannot make network namespaces here: {error.stderr.strip()}"
    return None


def _launch(
    host: int, namespace: str, interface: str, master: str, hostname: str
) -> subprocess.Popen:
    """One host's launcher, inside its namespace, with its own hostname and /dev/shm."""
    launcher = (
        f"hostname {hostname} && mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -m "
        f"sbpflow.distributed.launch --nnodes 2 --node_rank {host} --nproc_per_node 2 "
        f"--master_addr {master} --master_port {PORT} {JOB}"
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        GLOO_SOCKET_IFNAME=interface,
        SBPFLOW_TIMEOUT="60",
        OMP_NUM_THREADS="1",
    )
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, "unshare", "--uts", "--mount", "--propagation",
         "private", "sh", "-c", launcher],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _one_run(hosts: list[tuple[str, str, str]]) -> str | None:
    """Run the job once on both hosts; ``None`` if it ended cleanly, else what went wrong."""
    master = hosts[0][2]
    procs = [
        _launch(h, ns, interface, master, f"sbpflow-host{h}")
        for h, (ns, interface, _) in enumerate(hosts)
    ]
    deadline = time.monotonic() + RUN_LIMIT_S
    outputs, problems = [], []
    for h, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            problems.append(f"host {h} hung past {RUN_LIMIT_S} s")
        outputs.append(out)
        if proc.returncode != 0:
            problems.append(f"host {h} exited {proc.returncode}")
    text = "\n".join(outputs)
    missing = [r for r in range(4) if f"two-host job ok on rank {r}" not in text]
    if missing:
        problems.append(f"ranks {missing} did not report success")
    if problems:
        return "; ".join(problems) + "\n" + text[-3000:]
    return None


def test_boxing_matrix_and_dp_tp_training_across_two_hosts() -> None:
    """Every run: all 4 processes exit 0, every case equals the single-process reference."""
    reason = _can_make_namespaces()
    if reason is not None:
        pytest.skip(reason)
    failures = []
    with two_hosts() as hosts:
        for run in range(RUNS):
            problem = _one_run(hosts)
            if problem is not None:
                failures.append(f"run {run + 1} of {RUNS}: {problem}")
    assert not failures, f"{len(failures)} of {RUNS} runs did not end cleanly:\n" + "\n\n".join(
        failures
    )
