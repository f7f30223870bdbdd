"""Distributed mistakes become a clear error on every rank, in bounded time, not a hang.

Each case runs on a shared 2-rank pool with ``run_expect_errors``: every rank
must raise ``ValueError``/``TypeError`` naming the bad value within 30 s, and
the pool must still box tensors afterwards (no rank was left inside a
collective). The timeout cases use a private pool whose ranks start with
``SBPFLOW_TIMEOUT=3``, because the default group's timeout is fixed when the
world is created.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch

import sbpflow
from sbpflow.comm.collectives import CollectiveError
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool, RemoteError

WITHIN_S = 30.0


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def _rank() -> int:
    return sbpflow.env.get_rank()


# -- the mistakes (each runs on every rank) ------------------------------------------


def _split_dim_out_of_range() -> None:
    torch.ones(4, 3).to_global(_world(), split(2))


def _rank_not_in_world() -> None:
    torch.ones(4, 3).to_global(sbpflow.placement("cpu", [0, 5]), broadcast)


def _sbp_tuple_longer_than_placement() -> None:
    torch.ones(4, 3).to_global(_world(), (split(0), broadcast))


def _sbp_tuple_shorter_than_mesh() -> None:
    torch.ones(4, 3).to_global(sbpflow.placement("cpu", [[0, 1]]), split(0))


def _not_an_sbp() -> None:
    torch.ones(4, 3).to_global(_world(), "S(0)")


def _sparse_local() -> None:
    torch.eye(4).to_sparse().to_global(_world(), broadcast)


def _unbalanced_shards() -> None:
    torch.ones(2 if _rank() == 0 else 4, 3).to_global(_world(), split(0))


def _broadcast_locals_of_different_shapes() -> None:
    torch.ones(4 + _rank(), 3).to_global(_world(), broadcast)


def _module_parameters_of_different_shapes() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2 + _rank()))
    layers.to_global(_world(), broadcast)


def _different_sbps_for_a_local() -> None:
    torch.ones(4, 3).to_global(_world(), split(0) if _rank() == 0 else broadcast)


def _different_placements_for_a_local() -> None:
    ranks = [0, 1] if _rank() == 0 else [1, 0]
    torch.ones(4, 3).to_global(sbpflow.placement("cpu", ranks), broadcast)


def _different_dtypes_for_a_local() -> None:
    dtype = torch.float32 if _rank() == 0 else torch.float64
    torch.ones(4, 3, dtype=dtype).to_global(_world(), broadcast)


def _global_of_different_shapes() -> None:
    g = sbpflow.zeros(4 + _rank(), 3, placement=_world(), sbp=broadcast)  # makes no collective
    g.to_global(sbp=split(0))


def _different_sbps_for_a_global() -> None:
    g = torch.ones(4, 3).to_global(_world(), broadcast)
    g.to_global(sbp=split(0) if _rank() == 0 else split(1))


def _different_placements_for_a_global() -> None:
    g = torch.ones(4, 3).to_global(_world(), split(0))
    g.to_global(sbpflow.placement("cpu", [0] if _rank() == 0 else [1]), broadcast)


def _global_split_dim_out_of_range() -> None:
    torch.ones(4, 3).to_global(_world(), broadcast).to_global(sbp=split(-3))


MISTAKES: dict[str, tuple[Callable[[], None], type[Exception], str]] = {
    "split dim out of range": (
        _split_dim_out_of_range,
        ValueError,
        r"split\(2\) is out of range for a tensor with 2 dims",
    ),
    "rank not in the world": (
        _rank_not_in_world,
        ValueError,
        r"names rank\(s\) \[5\] but the world has 2 ranks",
    ),
    "sbp tuple too long": (
        _sbp_tuple_longer_than_placement,
        ValueError,
        r"\(S\(0\), B\) has 2 entries but the placement has 1 axes",
    ),
    "sbp tuple too short": (
        _sbp_tuple_shorter_than_mesh,
        ValueError,
        r"S\(0\) has 1 entry but the placement has 2 axes",
    ),
    "not an sbp": (
        _not_an_sbp,
        ValueError,
        r"sbp must be an SBP value or a tuple of them, got str 'S\(0\)'",
    ),
    "sparse local": (
        _sparse_local,
        TypeError,
        r"expects a dense \(strided\) tensor, got a torch.sparse_coo one.*to_dense\(\)",
    ),
    "unbalanced shards": (
        _unbalanced_shards,
        ValueError,
        r"\{0: \[2, 3\], 1: \[4, 3\]\}.*rank 0 passed shape \[2, 3\], expected \[3, 3\]",
    ),
    "B locals of different shapes": (
        _broadcast_locals_of_different_shapes,
        ValueError,
        r"\{0: \[4, 3\], 1: \[5, 3\]\}.*rank 1 passed shape \[5, 3\], expected \[4, 3\]\. "
        r"With SBP B every rank passes the whole tensor",
    ),
    "module parameters of different shapes": (
        _module_parameters_of_different_shapes,
        ValueError,
        r"module.to_global: parameter '1.weight': .*rank 1 passed shape \[3, 3\], expected \[2, 3\]",
    ),
    "different sbps (local)": (
        _different_sbps_for_a_local,
        ValueError,
        r"sbp: rank 0 passed S\(0\), rank 1 passed B",
    ),
    "different placements (local)": (
        _different_placements_for_a_local,
        ValueError,
        r"placement: rank 0 passed .*\[0, 1\].*rank 1 passed .*\[1, 0\]",
    ),
    "different dtypes (local)": (
        _different_dtypes_for_a_local,
        ValueError,
        r"dtype: rank 0 passed torch.float32, rank 1 passed torch.float64",
    ),
    "different shapes (global)": (
        _global_of_different_shapes,
        ValueError,
        r"shape: rank 0 passed \[4, 3\], rank 1 passed \[5, 3\]",
    ),
    "different sbps (global)": (
        _different_sbps_for_a_global,
        ValueError,
        r"sbp: rank 0 passed B -> S\(0\), rank 1 passed B -> S\(1\)",
    ),
    "different placements (global)": (
        _different_placements_for_a_global,
        ValueError,
        r"placement: rank 0 passed .*-> placement\('cpu', \[0\]\), rank 1 passed .*-> placement\('cpu', \[1\]\)",
    ),
    "global split dim out of range": (
        _global_split_dim_out_of_range,
        ValueError,
        r"split\(-3\) is out of range for a tensor with 2 dims",
    ),
}


def run_mistake(name: str) -> None:
    if name in MISTAKES_ONE_RANK:
        MISTAKES_ONE_RANK[name]()
        return
    MISTAKES[name][0]()


def box_something() -> list[float]:
    """A small S(0) -> B boxing, to show the ranks are still in step."""
    x = torch.arange(4.0).reshape(2, 2) + 10 * _rank()
    return x.to_global(_world(), split(0)).to_global(sbp=broadcast).to_local().flatten().tolist()


@pytest.mark.parametrize("name", list(MISTAKES))
@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_every_rank_raises_a_clear_error(dist_pool: DistributedPool, name: str) -> None:
    _, error, match = MISTAKES[name]
    outcomes = dist_pool.run_expect_errors(run_mistake, name, timeout=WITHIN_S)
    outcomes.assert_all_raised(error, match=match, within=WITHIN_S)
    expected = [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    assert dist_pool.run(box_something) == [expected, expected]


def _ignored_outside(shape: tuple[int, ...]) -> list[float]:
    """Rank 1 is outside the placement: its tensor is neither used nor validated."""
    x = torch.arange(6.0).reshape(2, 3) if _rank() == 0 else torch.full(shape, -1.0)
    g = x.to_global(sbpflow.placement("cpu", [0]), split(1))
    assert g.shape == (2, 3)
    return g.to_global(_world(), broadcast).to_local().flatten().tolist()


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_a_rank_outside_the_placement_is_not_validated(dist_pool: DistributedPool) -> None:
    expected = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert dist_pool.run(_ignored_outside, (7, 7)) == [expected, expected]
    assert dist_pool.run(_ignored_outside, (0, 0)) == [expected, expected]


# -- a rank that skips a call: the others time out with a named CollectiveError ------


def _skip_on_rank_one(check_meta: bool) -> str:
    """Box once in step, then rank 1 skips the next ``to_global``.

    Without the meta check the wait is in the boxing's all_gather on the group
    of placement [1, 0]; with it, in the metadata check's all_reduce over the world.
    The two cases use different process groups, so the first timeout cannot
    disturb the second in the same pool.
    """
    ranks = [0, 1] if check_meta else [1, 0]
    pl = sbpflow.placement("cpu", ranks)
    g = sbpflow.zeros(4, 3, placement=pl, sbp=split(0))  # no collective
    if not check_meta:
        g.to_global(sbp=split(1), check_meta=False)  # in step: creates the group
    if _rank() == 1:
        return "skipped"
    g.to_global(sbp=broadcast, check_meta=check_meta)
    return "finished"


@pytest.fixture
def short_timeout_pool() -> Iterator[DistributedPool]:
    """A private 2-rank pool whose groups time out after 3 s."""
    with DistributedPool(2, timeout=60.0, env={"SBPFLOW_TIMEOUT": "3"}) as pool:
        yield pool


def test_a_rank_skipping_to_global_times_out_with_the_op_named(
    short_timeout_pool: DistributedPool,
) -> None:
    for check_meta, op in [
        (False, r"sbpflow: all_gather over ranks \[1, 0\] failed"),
        (True, r"sbpflow: metadata check \(all_reduce\) over ranks \[0, 1\] failed"),
    ]:
        outcomes = short_timeout_pool.run_expect_errors(
            _skip_on_rank_one, check_meta, timeout=WITHIN_S
        )
        assert outcomes.elapsed < WITHIN_S
        assert outcomes[1] == "skipped"
        error = outcomes[0]
        if isinstance(error, RemoteError):
            assert error.type_name == "CollectiveError", error
        else:
            assert isinstance(error, CollectiveError), error
        assert re.search(op, str(error)), str(error)
        assert "timed out after the collective timeout (3 s)" in str(error)


@pytest.mark.parametrize("dist_pool", [1], indirect=True)
def test_one_process_names_the_ranks_it_lacks(dist_pool: DistributedPool) -> None:
    """A placement of two ranks in a world of one (a script started without the launcher):
    a ValueError naming the missing rank, not an IndexError from inside the shape check."""
    outcomes = dist_pool.run_expect_errors(run_mistake, "two ranks in a world of one", timeout=WITHIN_S)
    outcomes.assert_all_raised(ValueError, match=r"names rank\(s\) \[1\] but the world has 1 rank")


def _two_ranks_in_a_world_of_one() -> None:
    torch.nn.Linear(2, 2).to_global(sbpflow.placement("cpu", [0, 1]), broadcast)


MISTAKES_ONE_RANK = {"two ranks in a world of one": _two_ranks_in_a_world_of_one}
