"""to_global_batch and DistributedSampler on real ranks: the logical batch is the ranks' batches.

Compared with single-process references computed in each worker: the global batch read back
as broadcast must equal ``torch.cat`` of every rank's local batch (each rank rebuilds the
others' batches, which depend only on the rank); fed by ``DistributedSampler`` through a
``DataLoader``, the logical batch of each step must equal the concatenation of the batches
torch's own ``DistributedSampler`` deals to each replica. Also asserts which collectives ran.
"""

from __future__ import annotations

import collections
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

import sbpflow
from sbpflow.sbp import broadcast, split
from sbpflow.testing import DistributedPool
from sbpflow.utils.data import DistributedSampler, to_global_batch

Pair = namedtuple("Pair", ["features", "labels"])

# Local batch sizes per rank: uneven as the balanced rule allows (the first rank one more).
_BATCH_SIZES = (3, 2)


def _local_batch(rank: int) -> dict[str, Any]:
    """The loader batch rank ``rank`` holds: a dict with a tensor, a namedtuple and a list."""
    n = _BATCH_SIZES[rank]
    x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 100 * rank
    y = torch.arange(n) + 10 * rank
    mask = torch.arange(n * 2).reshape(n, 2) % 2 == rank
    return {"x": x, "pair": Pair(x * 2, y), "extra": [mask, y.double()]}


def _logical(t: sbpflow.GlobalTensor) -> torch.Tensor:
    return t.to_global(sbp=(broadcast,) * t.placement.ndim).to_local()


def concatenates_local_batches() -> dict[str, Any]:
    """Worker (2 ranks): the global batch of the ranks' uneven batches is their torch.cat."""
    rank = sbpflow.env.get_rank()
    pl = sbpflow.placement("cpu", [0, 1])
    mine = _local_batch(rank)
    with sbpflow.boxing.trace() as converting:
        batch = to_global_batch(mine, pl)
    assert isinstance(batch, dict) and list(batch) == ["x", "pair", "extra"]
    assert isinstance(batch["pair"], Pair) and isinstance(batch["extra"], list)
    references = [_local_batch(r) for r in (0, 1)]
    leaves = {
        "x": (batch["x"], [b["x"] for b in references], mine["x"]),
        "features": (batch["pair"].features, [b["pair"].features for b in references], None),
        "labels": (batch["pair"].labels, [b["pair"].labels for b in references], None),
        "mask": (batch["extra"][0], [b["extra"][0] for b in references], None),
        "double": (batch["extra"][1], [b["extra"][1] for b in references], None),
    }
    for name, (value, shards, own) in leaves.items():
        expected = torch.cat(shards)
        assert isinstance(value, sbpflow.GlobalTensor), name
        assert value.placement == pl and value.sbp == (split(0),), (name, value.sbp)
        assert value.shape == expected.shape and value.dtype == expected.dtype, name
        assert torch.equal(value.to_local(), shards[rank]), name
        with sbpflow.boxing.trace() as reading:
            assert torch.equal(_logical(value), expected), name
        assert reading.collectives() == {"all_gather": 1}, (name, reading.collectives())
        if own is not None:
            assert torch.equal(own, shards[rank]), "the caller's tensor was modified"
    single = to_global_batch(mine["x"], pl)
    assert torch.equal(_logical(single), leaves["x"][0].to_global(sbp=broadcast).to_local())
    return {"collectives": dict(converting.collectives())}


def loads_global_batches(mesh_shape: tuple[int, ...], axis: int) -> dict[str, Any]:
    """Worker: sampler -> DataLoader -> to_global_batch matches torch's sampler per replica."""
    rank, world_size = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    pl = sbpflow.placement("cpu", torch.arange(world_size).reshape(mesh_shape))
    num_replicas = mesh_shape[axis]
    features = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)
    labels = torch.arange(11) * 7
    dataset = TensorDataset(features, labels)
    sampler = DistributedSampler(dataset, pl, seed=9, axis=axis)  # rank from the environment
    assert sampler.rank == rank and sampler.replica == pl.coords_of(rank)[axis]
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    steps_seen = []
    collectives: collections.Counter[str] = collections.Counter()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        # The single-process reference: torch's sampler for every replica, batches of 2.
        shares = []
        for replica in range(num_replicas):
            reference = TorchSampler(dataset, num_replicas, replica, seed=9)
            reference.set_epoch(epoch)
            shares.append(list(reference))
        steps = 0
        for step, (x, y) in enumerate(loader):
            with sbpflow.boxing.trace() as converting:
                gx, gy = to_global_batch((x, y), pl, axis=axis)
            collectives += converting.collectives()
            assert gx.sbp == tuple(split(0) if a == axis else broadcast for a in range(pl.ndim))
            indices = [i for share in shares for i in share[2 * step : 2 * step + 2]]
            assert torch.equal(_logical(gx), features[indices]), (epoch, step)
            assert torch.equal(_logical(gy), labels[indices]), (epoch, step)
            steps += 1
        assert steps == len(loader) == -(-len(shares[0]) // 2)
        steps_seen.append(steps)
    return {"steps": steps_seen, "collectives": dict(collectives)}


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_global_batch_is_the_concatenation_of_local_batches(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(concatenates_local_batches)
    # A local batch becomes S(0) with no collective that moves data (the shards stay put).
    assert all(r["collectives"] == {} for r in results), results


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_sampler_feeds_global_batches_on_two_ranks(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(loads_global_batches, (2,), 0)
    # 2 epochs of 3 steps; an S(0) batch from local shards needs no data-moving collective.
    assert results == [{"steps": [3, 3], "collectives": {}}] * 2, results


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
@pytest.mark.parametrize("axis", [0, 1])
def test_sampler_feeds_global_batches_on_a_mesh(dist_pool: DistributedPool, axis: int) -> None:
    """2x2 mesh: partners along the other axis read the same samples; the batch is S(0) x B."""
    results = dist_pool.run(loads_global_batches, (2, 2), axis)
    # 2 epochs x 3 steps x 2 tensors, each broadcast once from the first partner on the other axis.
    assert results == [{"steps": [3, 3], "collectives": {"broadcast": 12}}] * 4, results


def bad_batches() -> list[str]:
    """Worker: a non-tensor leaf and a 0-dim tensor are named errors, the same on every rank."""
    pl = sbpflow.placement("cpu", [0, 1])
    messages = []
    for batch in ((torch.ones(2), ["a", "b"]), {"loss": torch.tensor(1.0)}):
        try:
            to_global_batch(batch, pl)
        except (TypeError, ValueError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_bad_batches_are_named(dist_pool: DistributedPool) -> None:
    for messages in dist_pool.run(bad_batches):
        assert len(messages) == 2, messages
        assert messages[0].startswith("TypeError: batch[1][0] is a str")
        assert messages[1].startswith("ValueError: batch['loss'] is a 0-dim tensor")
