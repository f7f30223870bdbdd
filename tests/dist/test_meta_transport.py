"""The metadata check on both of its transports (NOTE [shared-memory meta check]).

On one host the ranks gather through a shared-memory table; with
``SBPFLOW_SHARED_MEMORY=0`` (as on a multi-host world) they gather over gloo.
The mistakes of ``test_errors`` must become the same clear error on every rank
either way, and a rank that dies must not leave the others waiting for the
whole collective timeout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
import torch

import sbpflow
from sbpflow.comm import collectives
from sbpflow.comm.collectives import CollectiveError
from sbpflow.sbp import split
from sbpflow.testing import DistributedPool, RemoteError
from tests.dist.test_errors import MISTAKES, WITHIN_S, box_something, run_mistake


def _uses_shared_table() -> bool:
    torch.ones(2, 2).to_global(sbpflow.placement("cpu", [0, 1]), split(0))  # one checked call
    tables = list(collectives._shared_tables.values())
    return len(tables) == 1 and tables[0] is not None


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_one_host_checks_through_shared_memory(dist_pool: DistributedPool) -> None:
    assert dist_pool.run(_uses_shared_table) == [True, True]


@pytest.fixture(scope="module")
def gloo_check_pool() -> Iterator[DistributedPool]:
    """A private 2-rank pool whose ranks start with ``SBPFLOW_SHARED_MEMORY=0``."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_SHARED_MEMORY": "0"}) as pool:
        yield pool


@pytest.mark.parametrize("name", list(MISTAKES))
def test_the_gloo_path_raises_the_same_errors(gloo_check_pool: DistributedPool, name: str) -> None:
    assert gloo_check_pool.run(_uses_shared_table) == [False, False]
    _, error, match = MISTAKES[name]
    outcomes = gloo_check_pool.run_expect_errors(run_mistake, name, timeout=WITHIN_S)
    outcomes.assert_all_raised(error, match=match, within=WITHIN_S)
    expected = [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    assert gloo_check_pool.run(box_something) == [expected, expected]


def _rank_one_exits() -> str:
    if sbpflow.env.get_rank() == 1:
        os._exit(3)
    torch.ones(2, 2).to_global(sbpflow.placement("cpu", [0, 1]), split(0))
    return "finished"


def test_a_rank_that_exits_is_noticed_long_before_the_timeout() -> None:
    env = {"SBPFLOW_TIMEOUT": "120", "SBPFLOW_SHARED_MEMORY": "1"}
    with DistributedPool(2, timeout=60.0, env=env) as pool:
        assert pool.run(_uses_shared_table) == [True, True]
        outcomes = pool.run_expect_errors(_rank_one_exits, timeout=WITHIN_S)
    assert outcomes.elapsed < 15, outcomes.elapsed
    error = outcomes[0]
    if isinstance(error, RemoteError):
        assert error.type_name == "CollectiveError", error
    else:
        assert isinstance(error, CollectiveError), error
    assert re.search(
        r"sbpflow: metadata check \(all_gather\) over ranks \[0, 1\] failed\..*rank 1 \(pid \d+\) "
        r"exited while the others waited",
        str(error),
    ), str(error)


def _mismatch_without_numpy() -> str:
    """Rank-dependent SBPs with ``Tensor.numpy`` failing as it does where numpy is missing."""
    real = torch.Tensor.numpy

    def unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Numpy is not available")

    torch.Tensor.numpy = unavailable  # type: ignore[method-assign,assignment]
    try:
        sbp = split(0) if sbpflow.env.get_rank() == 0 else sbpflow.sbp.broadcast
        torch.ones(2, 2).to_global(sbpflow.placement("cpu", [0, 1]), sbp)
    except ValueError as error:
        return str(error)
    finally:
        torch.Tensor.numpy = real  # type: ignore[method-assign]
    return "no error"


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_the_mismatch_report_needs_no_numpy(dist_pool: DistributedPool) -> None:
    for message in dist_pool.run(_mismatch_without_numpy):
        assert "ranks disagree in to_global" in message, message
        assert "sbp: rank 0 passed" in message, message
