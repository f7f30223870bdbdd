"""Creating global tensors: factories, broadcast from local tensors, and Module.to_global.

Compared with single-process references: a factory's logical value (boxed to
B) must equal the same factory on a one-rank placement with the same seed, on
worlds of 1, 2 and 4 ranks and for every SBP (random values depend only on the
seed); ``to_global(placement, B)`` must hand every rank the first rank's data
without touching the callers' tensors; ``Module.to_global`` must convert
parameters and buffers in place, a plain tensor read as the whole logical tensor (rank 0's)
unless ``local_pieces=True`` reads it as this rank's piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import SbpParallel, broadcast, partial_sum, split
from sbpflow.testing import DistributedPool

SBPS: tuple[SbpParallel, ...] = (split(0), split(1), broadcast, partial_sum)


def _factories() -> dict[str, Callable[..., sbpflow.GlobalTensor]]:
    """Each factory takes (placement, sbp); 2-D except arange; torch's argument forms."""
    return {
        "randn": lambda pl, s: sbpflow.randn(6, 5, placement=pl, sbp=s),
        "rand": lambda pl, s: sbpflow.rand((6, 5), placement=pl, sbp=s, dtype=torch.float64),
        "zeros": lambda pl, s: sbpflow.zeros(6, 5, placement=pl, sbp=s),
        "ones": lambda pl, s: sbpflow.ones(6, 5, placement=pl, sbp=s, dtype=torch.float16),
        "full": lambda pl, s: sbpflow.full((6, 5), 2.5, placement=pl, sbp=s),
        "arange": lambda pl, s: sbpflow.arange(2, 23, 3, placement=pl, sbp=s),
        "arange_float": lambda pl, s: sbpflow.arange(0.5, 3.0, 0.25, placement=pl, sbp=s),
        # *_like of a global input keep its placement and SBP (P included: ones, not ranks)
        "ones_like": lambda pl, s: sbpflow.ones_like(sbpflow.empty(6, 5, placement=pl, sbp=s)),
        "full_like": lambda pl, s: sbpflow.full_like(sbpflow.zeros(6, 5, placement=pl, sbp=s), 3),
        "randn_like": lambda pl, s: sbpflow.randn_like(sbpflow.zeros(6, 5, placement=pl, sbp=s)),
    }


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def create_everything(seed: int) -> dict[str, Any]:
    """Worker: every factory with every SBP; return logical values and this rank's B locals."""
    rank, pl = sbpflow.env.get_rank(), _world()
    alone = sbpflow.placement("cpu", [rank])  # this rank alone: the single-process reference
    logical: dict[str, torch.Tensor] = {}
    broadcast_locals: dict[str, torch.Tensor] = {}
    for name, make in _factories().items():
        sbpflow.manual_seed(seed)
        reference = make(alone, broadcast).to_local()
        for s in SBPS:
            if name.startswith("arange") and s == split(1):
                continue
            sbpflow.manual_seed(seed)
            t = make(pl, s)
            assert t.shape == reference.shape and t.dtype == reference.dtype, (name, s, t)
            assert t.placement == pl and t.sbp == (s,)
            value = t.to_global(sbp=broadcast).to_local()
            assert torch.equal(value, reference), f"{name} with {s} on {pl}: {value} != {reference}"
            if s == broadcast:
                broadcast_locals[name] = t.to_local()
        logical[name] = reference
    return {"logical": logical, "broadcast_locals": broadcast_locals}


def random_sequence(seed: int) -> list[torch.Tensor]:
    """Worker: successive random tensors on different placements follow one seeded sequence.

    The second tensor lives on rank 0 only; the others must still advance their
    counter, so the third matches the one-rank sequence everywhere.
    """
    rank, pl = sbpflow.env.get_rank(), _world()
    sbpflow.manual_seed(seed)
    first = sbpflow.randn(4, 3, placement=pl, sbp=split(0))
    second = sbpflow.rand(5, placement=sbpflow.placement("cpu", [0]), sbp=broadcast)
    third = sbpflow.randn(3, 4, placement=pl, sbp=split(1))
    sbpflow.manual_seed(seed)
    alone = sbpflow.placement("cpu", [rank])
    expected = [
        sbpflow.randn(4, 3, placement=alone, sbp=broadcast).to_local(),
        sbpflow.rand(5, placement=alone, sbp=broadcast).to_local(),
        sbpflow.randn(3, 4, placement=alone, sbp=broadcast).to_local(),
    ]
    got = [first.to_global(sbp=broadcast).to_local(), third.to_global(sbp=broadcast).to_local()]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[2])
    if rank == 0:
        assert torch.equal(second.to_local(), expected[1])
    else:
        assert second.to_local().numel() == 0
    return got


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_factories_give_the_seeded_logical_tensor_for_every_sbp(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(create_everything, 77)
    first = results[0]
    for rank, result in enumerate(results):
        for name, local in result["broadcast_locals"].items():
            assert torch.equal(local, first["broadcast_locals"][name]), (rank, name)
            assert torch.equal(local, first["logical"][name]), (rank, name)
    dist_pool.run(random_sequence, 5)


_ACROSS_WORLDS: dict[int, dict[str, torch.Tensor]] = {}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_random_values_do_not_depend_on_the_world_size(pool: Any, world_size: int) -> None:
    _ACROSS_WORLDS[world_size] = pool(world_size).run(create_everything, 123)[0]["logical"]
    reference = next(iter(_ACROSS_WORLDS.values()))
    for name, value in _ACROSS_WORLDS[world_size].items():
        assert torch.equal(value, reference[name]), name
    assert not torch.equal(reference["randn"], torch.zeros(6, 5))


def broadcast_local(ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Worker: per-rank torch.randn -> to_global(B); return (mine, global local, untouched)."""
    rank = sbpflow.env.get_rank()
    torch.manual_seed(1000 + rank)
    x = torch.randn(3, 4)
    before = x.clone()
    g = x.to_global(sbpflow.placement("cpu", ranks), broadcast)
    untouched = torch.equal(x, before)
    local = g.to_local().clone()
    g.to_local().add_(1)  # on non-head ranks this must not reach the caller's tensor
    return before, local, untouched and (rank == ranks[0] or torch.equal(x, before))


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_broadcast_from_local_takes_the_first_rank_data(dist_pool: DistributedPool) -> None:
    n = dist_pool.world_size
    for ranks in (list(range(n)), list(reversed(range(n)))):
        results = dist_pool.run(broadcast_local, ranks)
        head = results[ranks[0]][0]
        for rank, (mine, local, untouched) in enumerate(results):
            assert untouched, f"rank {rank}: to_global modified the caller's tensor"
            assert torch.equal(local, head), (
                f"rank {rank} holds {local}, expected rank {ranks[0]}'s {head}"
            )
            if rank != ranks[0]:
                assert not torch.equal(mine, head)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))


def module_to_global() -> dict[str, Any]:
    """Worker: per-rank init, then Module.to_global with one SBP and with a callable."""
    rank, pl = sbpflow.env.get_rank(), _world()
    n = pl.num_ranks
    torch.manual_seed(rank)
    model = _model()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params_before = {k: p.requires_grad for k, p in model.named_parameters()}
    assert model.to_global(pl, broadcast) is model
    for name, p in model.named_parameters():
        assert isinstance(p, torch.nn.Parameter) and sbpflow.is_global(p), name
        assert p.requires_grad == params_before[name] and p.sbp == (broadcast,)
    for name, b in model.named_buffers():
        assert sbpflow.is_global(b), name
    synced = {k: v.to_local().clone() for k, v in model.state_dict().items()}

    # Global -> global: boxing keeps the logical values (tensor-parallel weight split).
    def tp_sbp(name: str, t: torch.Tensor) -> SbpParallel:
        return split(0) if name == "0.weight" else broadcast

    model.to_global(pl, tp_sbp)
    weight = model[0].weight
    assert weight.sbp == (split(0),) and weight.shape == (6, 4)
    assert torch.equal(weight.to_local(), torch.tensor_split(synced["0.weight"], n)[rank])
    assert torch.equal(weight.to_global(sbp=broadcast).to_local(), synced["0.weight"])

    # Local -> global with a callable: a plain parameter given split is the whole logical
    # tensor (rank 0's), each rank keeping its slice; local_pieces=True reads each rank's
    # tensor as its own shard.
    def split_weights(name: str, t: torch.Tensor) -> SbpParallel:
        return split(0) if t.ndim == 2 else broadcast

    torch.manual_seed(rank)
    whole = _model().to_global(pl, split_weights)
    assert whole[0].weight.shape == (6, 4) and whole[0].bias.sbp == (broadcast,)
    whole_weight = whole[0].weight.to_global(sbp=broadcast).to_local()
    torch.manual_seed(rank)
    fresh = _model().to_global(pl, split_weights, local_pieces=True)
    assert fresh[0].weight.shape == (6 * n, 4)
    assert torch.equal(fresh[0].weight.to_local(), original["0.weight"])
    assert fresh[0].bias.sbp == (broadcast,)
    return {"original": original, "synced": synced, "whole_weight": whole_weight}


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_module_to_global_converts_params_and_buffers_in_place(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(module_to_global)
    head = results[0]["original"]
    for rank, result in enumerate(results):
        for key, value in result["synced"].items():
            assert torch.equal(value, head[key]), f"rank {rank} {key} is not rank 0's"
        assert torch.equal(result["whole_weight"], head["0.weight"]), f"rank {rank}"
