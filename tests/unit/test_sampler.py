"""DistributedSampler: each replica's share of a data set, computed without a process group.

The reference is PyTorch's own ``torch.utils.data.DistributedSampler`` built in the same test
with explicit ``num_replicas`` and ``rank``: on a 1-D placement our indices must equal its
indices for every epoch; on a mesh, the replica is the rank's coordinate on the data axis.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import DistributedSampler as TorchSampler

import sbpflow
from sbpflow.sbp import broadcast, split
from sbpflow.utils.data import DistributedSampler
from sbpflow.utils.data._global_batch import batch_sbp


def _placement(ranks: object) -> sbpflow.Placement:
    return sbpflow.placement("cpu", ranks)


def _indices(sampler: Iterable[int]) -> list[int]:
    return list(sampler)


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("num_items", [0, 1, 2, 3, 4, 5, 7, 10, 17])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_torch_sampler_every_epoch(
    num_items: int, num_replicas: int, shuffle: bool, drop_last: bool
) -> None:
    """Against torch's DistributedSampler(num_replicas, rank) built here: same len, same indices."""
    data = list(range(num_items))
    placement = _placement(list(range(num_replicas)))
    for rank, seed in itertools.product(range(num_replicas), (0, 123)):
        ours = DistributedSampler(data, placement, shuffle, seed, drop_last, rank=rank)
        theirs = TorchSampler(data, num_replicas, rank, shuffle, seed, drop_last)
        assert len(ours) == len(theirs)
        for epoch in range(4):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert _indices(ours) == _indices(theirs), (rank, seed, epoch)


def test_small_data_sets_over_two_ranks() -> None:
    """1, 2 and 3 items over 2 ranks, unshuffled: the exact shares torch's sampler deals."""
    pl = _placement([0, 1])
    expected = {
        # num_items: ((rank 0, rank 1) without drop_last, (rank 0, rank 1) with drop_last)
        1: (([0], [0]), ([], [])),
        2: (([0], [1]), ([0], [1])),
        3: (([0, 2], [1, 0]), ([0], [1])),
    }
    for num_items, (padded, dropped) in expected.items():
        for drop_last, shares in ((False, padded), (True, dropped)):
            got = tuple(
                _indices(
                    DistributedSampler(range(num_items), pl, False, drop_last=drop_last, rank=r)
                )
                for r in (0, 1)
            )
            assert got == shares, (num_items, drop_last)
            reference = tuple(
                _indices(TorchSampler(range(num_items), 2, r, False, drop_last=drop_last))
                for r in (0, 1)
            )
            assert got == reference


def test_three_items_over_two_ranks_pad_to_two_each() -> None:
    """3 items over 2 ranks: 2 each (one repeated), and together they cover the data set."""
    pl = _placement([0, 1])
    for epoch in range(5):
        shares = []
        for rank in (0, 1):
            sampler = DistributedSampler(range(3), pl, rank=rank)
            sampler.set_epoch(epoch)
            assert len(sampler) == 2
            shares.append(_indices(sampler))
        assert all(len(share) == 2 for share in shares)
        combined = shares[0] + shares[1]
        assert sorted(set(combined)) == [0, 1, 2]
        assert len(combined) - len(set(combined)) == 1  # exactly one padded repeat


@pytest.mark.parametrize("num_items", [5, 8, 11])
def test_shares_partition_the_data_set(num_items: int) -> None:
    """With drop_last=False the shares cover every index; unpadded sizes have no repeats."""
    pl = _placement([0, 1, 2, 3])
    sampler_of = {r: DistributedSampler(range(num_items), pl, seed=7, rank=r) for r in range(4)}
    for epoch in (0, 1, 9):
        for sampler in sampler_of.values():
            sampler.set_epoch(epoch)
        combined = [i for r in range(4) for i in _indices(sampler_of[r])]
        assert set(combined) == set(range(num_items))
        assert len(combined) == 4 * -(-num_items // 4)
        if num_items % 4 == 0:
            assert sorted(combined) == list(range(num_items))


def test_set_epoch_reshuffles_identically_on_all_ranks() -> None:
    """Two samplers per rank (as on two processes) agree in every epoch; epochs differ."""
    pl = _placement([0, 1])
    orders = []
    for epoch in range(4):
        per_rank = []
        for rank in (0, 1):
            a = DistributedSampler(range(20), pl, seed=3, rank=rank)
            b = DistributedSampler(range(20), pl, seed=3, rank=rank)
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            assert _indices(a) == _indices(b)
            per_rank.append(_indices(a))
        # Interleaving the shares recovers the epoch's one permutation of the data set.
        order = [i for pair in zip(*per_rank, strict=True) for i in pair]
        assert sorted(order) == list(range(20))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == len(orders), "set_epoch did not reshuffle"
    same = DistributedSampler(range(20), pl, seed=3, rank=0)
    assert _indices(same) == orders[0][0::2], "without set_epoch the order is epoch 0's"


def test_iteration_does_not_depend_on_global_rng() -> None:
    """The order comes from seed + epoch only, not from torch's global generator."""
    pl = _placement([0, 1])
    torch.manual_seed(1)
    first = _indices(DistributedSampler(range(9), pl, rank=1))
    torch.manual_seed(2)
    torch.rand(10)
    assert _indices(DistributedSampler(range(9), pl, rank=1)) == first


def test_mesh_partners_along_other_axis_agree() -> None:
    """2x2 mesh, data axis 0: ranks 0,1 share replica 0 and ranks 2,3 replica 1 (torch's ranks)."""
    mesh = _placement([[0, 1], [2, 3]])
    for epoch in range(3):
        got = {}
        for rank in range(4):
            sampler = DistributedSampler(range(7), mesh, seed=5, rank=rank)
            sampler.set_epoch(epoch)
            assert sampler.num_replicas == 2 and len(sampler) == 4
            got[rank] = _indices(sampler)
        assert got[0] == got[1] and got[2] == got[3]
        for replica, rank in ((0, 0), (1, 2)):
            torch_sampler = TorchSampler(range(7), 2, replica, seed=5)
            torch_sampler.set_epoch(epoch)
            assert got[rank] == _indices(torch_sampler)


def test_mesh_data_axis_one() -> None:
    """axis=1 on [[0, 1], [2, 3]]: the columns are replicas, so 0,2 agree and 1,3 agree."""
    mesh = _placement([[0, 1], [2, 3]])
    got = {r: _indices(DistributedSampler(range(6), mesh, axis=1, rank=r)) for r in range(4)}
    assert got[0] == got[2] == _indices(TorchSampler(range(6), 2, 0))
    assert got[1] == got[3] == _indices(TorchSampler(range(6), 2, 1))
    assert got[0] != got[1]
    last = {r: _indices(DistributedSampler(range(6), mesh, axis=-1, rank=r)) for r in range(4)}
    assert last == got


def test_mesh_keeps_the_users_rank_order() -> None:
    """The replica is the mesh coordinate, not the rank number: [[3, 1], [0, 2]]."""
    mesh = _placement([[3, 1], [0, 2]])
    replica_of = {3: 0, 1: 0, 0: 1, 2: 1}
    for rank, replica in replica_of.items():
        sampler = DistributedSampler(range(9), mesh, rank=rank)
        assert sampler.replica == replica
        assert _indices(sampler) == _indices(TorchSampler(range(9), 2, replica))


def test_placement_none_is_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """placement=None (and rank=None) read the world from sbpflow.env, like torch's default.

    sbpflow.env is patched: another test may have made this process a world of one.
    """
    monkeypatch.setattr(sbpflow.env, "get_world_size", lambda: 3)
    monkeypatch.setattr(sbpflow.env, "get_rank", lambda: 2)
    sampler = DistributedSampler(range(10), seed=4)
    assert sampler.placement == _placement([0, 1, 2])
    assert sampler.rank == 2 and sampler.num_replicas == 3
    assert _indices(sampler) == _indices(TorchSampler(range(10), 3, 2, seed=4))


def test_works_with_a_data_loader() -> None:
    """DataLoader(sampler=...) reads exactly the sampler's indices, in order."""
    data = torch.arange(10) * 10
    sampler = DistributedSampler(data, _placement([0, 1]), seed=1, rank=1)
    sampler.set_epoch(2)
    loaded = torch.cat(list(DataLoader(data, batch_size=2, sampler=sampler)))
    assert loaded.tolist() == [int(data[i]) for i in _indices(sampler)]


def test_rank_outside_the_placement_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"rank 2 is not in placement\('cpu', \[0, 1\]\)"):
        DistributedSampler(range(4), _placement([0, 1]), rank=2)


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"placement": [0, 1]}, TypeError, r"placement must be an sbpflow.placement.*got list"),
        ({"axis": 2}, ValueError, r"axis=2 is not an axis of .* has 1"),
        ({"axis": 0.0}, TypeError, r"axis must be an int, got float"),
        ({"seed": "0"}, TypeError, r"seed must be an int, got str"),
        ({"shuffle": 1}, TypeError, r"shuffle must be True or False, got int"),
        ({"drop_last": None}, TypeError, r"drop_last must be True or False, got NoneType"),
        ({"rank": 1.0}, TypeError, r"rank must be an int, got float"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    arguments: dict[str, object] = {"placement": _placement([0, 1]), "rank": 0, **kwargs}
    with pytest.raises(error, match=message):
        DistributedSampler(range(4), **arguments)  # type: ignore[arg-type]


def test_bad_data_sets_and_epochs() -> None:
    pl = _placement([0, 1])
    with pytest.raises(TypeError, match=r"got _Stream, which has no __len__"):
        DistributedSampler(_Stream(), pl, rank=0)  # type: ignore[arg-type]
    sampler = DistributedSampler(range(4), pl, rank=0)
    with pytest.raises(TypeError, match=r"epoch must be an int, got str"):
        sampler.set_epoch("1")  # type: ignore[arg-type]
    growing = [0, 1, 2]
    sampler = DistributedSampler(growing, pl, rank=0)
    growing.append(3)
    with pytest.raises(ValueError, match=r"had 3 items .* and has 4 now"):
        iter(sampler)


def test_batch_sbp_splits_the_data_axis_only() -> None:
    """The global batch's layout: S(0) on the data axis, B on the others."""
    assert batch_sbp(_placement([0, 1])) == (split(0),)
    mesh = _placement([[0, 1], [2, 3]])
    assert batch_sbp(mesh) == (split(0), broadcast)
    assert batch_sbp(mesh, axis=1) == (broadcast, split(0))
    with pytest.raises(ValueError, match=r"axis=2 is not an axis"):
        batch_sbp(mesh, axis=2)
