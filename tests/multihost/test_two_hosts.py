"""Two simulated hosts: the 2-D boxing matrix and a DP x TP training step across a network.

Each host is a network namespace with its own hostname and /dev/shm (``two_hosts.py``)
and runs ``python -m sbpflow.distributed.launch --nnodes 2 --nproc_per_node 2`` of
``two_host_job.py``, which compares every result with a single-process reference.
The test runs the whole job once (``SBPFLOW_TWO_HOST_RUNS`` for more) and requires every
run to end cleanly: every process exits 0, none aborts, none hangs past the limit. Many
runs (the exit is where rare aborts show) are the soak tool's:
``python tools/soak.py --runs 20 two-hosts``.
Skipped where network namespaces cannot be made (not root, no ``ip``, or a sandbox that
forbids them).
"""

from __future__ import annotations

import os

import pytest

from .two_hosts import run_job, two_hosts, why_unavailable

RUNS = int(os.environ.get("SBPFLOW_TWO_HOST_RUNS", "1"))

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_boxing_matrix_and_dp_tp_training_across_two_hosts() -> None:
    """Every run: all 4 processes exit 0, every case equals the single-process reference."""
    reason = why_unavailable()
    if reason is not None:
        pytest.skip(reason)
    failures = []
    with two_hosts() as hosts:
        for run in range(RUNS):
            result = run_job(hosts)
            problems = result.problems()
            if problems:
                failures.append(
                    f"run {run + 1} of {RUNS}: {'; '.join(problems)}\n{result.output[-3000:]}"
                )
    assert not failures, f"{len(failures)} of {RUNS} runs did not end cleanly:\n" + "\n\n".join(
        failures
    )
