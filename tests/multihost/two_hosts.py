"""Two simulated hosts on one machine, and one run of ``two_host_job.py`` across them.

Each host is a network namespace joined to the other by a veth pair, with its own
hostname and its own /dev/shm (UTS and mount namespaces), and runs
``python -m sbpflow.distributed.launch --nnodes 2 --nproc_per_node 2`` of
``two_host_job.py``. Used by ``test_two_hosts.py`` (a few runs) and by the soak tool
(``tools/soak.py two-hosts``, many runs). Needs root and the ``ip`` and ``unshare``
commands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("two_host_job.py")
RUN_LIMIT_S = 240  # one run takes ~10 s on a 2-core machine; a hang is caught well before CI's
SUBNET = "10.231.7"
PORT = 29611
NUM_RANKS = 4

Host = tuple[str, str, str]  # (namespace, interface, address)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[list[Host]]:
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


def why_unavailable() -> str | None:
    """Why two hosts cannot be simulated here, or ``None`` when they can."""
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
    host: int, namespace: str, interface: str, master: str, cwd: Path, wrapper: tuple[str, ...]
) -> subprocess.Popen:
    """One host's launcher, inside its namespace, with its own hostname and /dev/shm."""
    launcher = (
        f"hostname sbpflow-host{host} && mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} "
        f"-m sbpflow.distributed.launch --nnodes 2 --node_rank {host} --nproc_per_node 2 "
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
        [*wrapper, "ip", "netns", "exec", namespace, "unshare", "--uts", "--mount", "--propagation",
         "private", "sh", "-c", launcher],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@dataclass(frozen=True)
class JobResult:
    """What one run of the job across both hosts left: each launcher's exit status and output."""

    returncodes: tuple[int | None, ...]  # None: the host hung past RUN_LIMIT_S and was killed
    output: str

    def problems(self) -> list[str]:
        """What went wrong, in words; empty when every process exited 0 and every rank passed."""
        found = [
            f"host {h} hung past {RUN_LIMIT_S} s" if rc is None else f"host {h} exited {rc}"
            for h, rc in enumerate(self.returncodes)
            if rc != 0
        ]
        missing = [r for r in range(NUM_RANKS) if f"two-host job ok on rank {r}" not in self.output]
        if missing:
            found.append(f"ranks {missing} did not report success")
        return found


def run_job(hosts: list[Host], cwd: Path = ROOT, wrapper: tuple[str, ...] = ()) -> JobResult:
    """Run ``two_host_job.py`` once on both hosts.

    The processes start in ``cwd``; each host's command line runs under ``wrapper`` (a
    command prefix), if given.
    """
    master = hosts[0][2]
    procs = [
        _launch(h, ns, interface, master, cwd, wrapper)
        for h, (ns, interface, _) in enumerate(hosts)
    ]
    deadline = time.monotonic() + RUN_LIMIT_S
    outputs: list[str] = []
    returncodes: list[int | None] = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            returncodes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            returncodes.append(None)
        outputs.append(out)
    return JobResult(tuple(returncodes), "\n".join(outputs))
