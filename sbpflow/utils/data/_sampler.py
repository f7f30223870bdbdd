"""``DistributedSampler``: PyTorch's sampler, with the replicas read off a placement's data axis.

# NOTE [replicas from the data axis]
# torch.utils.data.DistributedSampler splits a data set over ``num_replicas`` processes, and
# ``rank`` picks the share. On a mesh only one axis carries data parallelism: along the others
# (tensor-parallel partners, say) the ranks must read the SAME samples, because the batch is
# split on the data axis and broadcast on the others. So the replicas are the coordinates on
# the data axis: ``num_replicas = placement.shape[axis]`` and this rank's share is its
# coordinate there. Everything else (the seeded shuffle, padding by repetition, drop_last,
# the strided deal) is torch's algorithm, step for step, so on a 1-D placement of all ranks
# the indices equal torch's for every epoch. Nothing here talks to other ranks: every rank
# computes the same permutation from ``seed + epoch``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from ... import env
from ...placement import Placement

__all__ = ["DistributedSampler"]


def _check_int(name: str, value: object, fix: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}. {fix}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {type(value).__name__}: {value!r}. "
            f"Pass {name}=True or {name}=False."
        )
    return value


def normalize_axis(axis: object, placement: Placement) -> int:
    """``axis`` as a non-negative placement axis of ``placement`` (negative counts from the end)."""
    axis = _check_int("axis", axis, "Pass the placement axis that carries data parallelism.")
    if not -placement.ndim <= axis < placement.ndim:
        raise ValueError(
            f"axis={axis} is not an axis of {placement}, which has {placement.ndim} "
            f"(valid: 0..{placement.ndim - 1}). Pass the placement axis that carries data "
            "parallelism, e.g. axis=0 for a (data, tensor) mesh."
        )
    return axis % placement.ndim


def samples_per_replica(num_items: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each replica gets per epoch (torch's ``num_samples``)."""
    if drop_last and num_items % num_replicas != 0:
        return math.ceil((num_items - num_replicas) / num_replicas)
    return math.ceil(num_items / num_replicas)


def replica_indices(
    num_items: int,
    num_replicas: int,
    replica: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    drop_last: bool,
) -> list[int]:
    """The indices replica ``replica`` of ``num_replicas`` reads in ``epoch``: torch's algorithm."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        indices = torch.randperm(num_items, generator=generator).tolist()
    else:
        indices = list(range(num_items))
    total_size = samples_per_replica(num_items, num_replicas, drop_last) * num_replicas
    if drop_last:
        indices = indices[:total_size]
    elif total_size > num_items:
        # Pad by repeating the (shuffled) order from its start, as many times as needed.
        padding = total_size - num_items
        indices += (indices * math.ceil(padding / num_items))[:padding]
    assert len(indices) == total_size, (len(indices), total_size)
    return indices[replica:total_size:num_replicas]


class DistributedSampler(Sampler[int]):
    """Each data-parallel replica's share of a data set, as ``torch.utils.data.DistributedSampler``.

    The replicas are the coordinates along ``placement``'s data axis ``axis``: with a 2x2
    mesh ``[[0, 1], [2, 3]]`` and ``axis=0`` there are two replicas, ranks 0 and 1 read one
    share and ranks 2 and 3 the other. ``placement=None`` means every rank of the world, one
    replica each; then the indices equal ``torch.utils.data.DistributedSampler(dataset,
    world_size, rank, shuffle, seed, drop_last)``'s in every epoch.

    Without ``drop_last`` the data set is padded by repeating its (shuffled) order so every
    replica gets ``len(self)`` indices; with it the tail that does not divide evenly is
    dropped. Call ``set_epoch(epoch)`` before each epoch to reshuffle: every rank draws the
    same permutation from ``seed + epoch``, so no process group is needed.

    ``rank`` is this process's rank (``sbpflow.env.get_rank()`` when ``None``); pass it to
    build another rank's sampler, e.g. in a single-process test. A rank outside the
    placement has no share and is an error.
    """

    def __init__(
        self,
        dataset: Sized,
        placement: Placement | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        axis: int = 0,
        *,
        rank: int | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                f"DistributedSampler needs a data set with a length (a map-style Dataset), got "
                f"{type(dataset).__name__}, which has no __len__. An IterableDataset must shard "
                "itself; wrap the data in a map-style Dataset to use this sampler."
            )
        if placement is None:
            placement = Placement("cpu", list(range(env.get_world_size())))
        elif not isinstance(placement, Placement):
            raise TypeError(
                f"placement must be an sbpflow.placement or None, got "
                f"{type(placement).__name__}: {placement!r}. Pass the placement the batch goes "
                "to, e.g. sbpflow.placement('cpu', [0, 1]), or None for every rank of the world."
            )
        self.shuffle = _check_bool("shuffle", shuffle)
        self.drop_last = _check_bool("drop_last", drop_last)
        self.seed = _check_int("seed", seed, "Pass the same integer seed on every rank.")
        self.axis = normalize_axis(axis, placement)
        if rank is None:
            rank = env.get_rank()
        rank = _check_int("rank", rank, "Pass a rank of the placement, or None for this process.")
        if rank not in placement:
            raise ValueError(
                f"rank {rank} is not in {placement}, so it has no share of the data set. Build "
                "the sampler with a placement that contains this rank (placement=None means "
                "every rank of the world), or only on the ranks of the placement."
            )
        self.dataset = dataset
        self.placement = placement
        self.rank = rank
        self.num_replicas = placement.shape[self.axis]
        self.replica = placement.coords_of(rank)[self.axis]
        self.epoch = 0
        self._num_items = len(dataset)
        self.num_samples = samples_per_replica(self._num_items, self.num_replicas, self.drop_last)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        num_items = len(self.dataset)
        if num_items != self._num_items:
            raise ValueError(
                f"the data set had {self._num_items} items when the DistributedSampler was built "
                f"and has {num_items} now; build a new sampler after changing the data set."
            )
        return iter(
            replica_indices(
                num_items,
                self.num_replicas,
                self.replica,
                shuffle=self.shuffle,
                seed=self.seed,
                epoch=self.epoch,
                drop_last=self.drop_last,
            )
        )

    def __len__(self) -> int:
        """Indices per replica and epoch (the same on every rank)."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``: every rank draws the same order from ``seed + epoch``."""
        self.epoch = _check_int("epoch", epoch, "Pass the epoch number, e.g. set_epoch(epoch).")

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(num_items={self._num_items}, placement={self.placement}, "
            f"axis={self.axis}, rank={self.rank}, replica={self.replica}/{self.num_replicas}, "
            f"num_samples={self.num_samples}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )
