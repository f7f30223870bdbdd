"""Randomness follows the logical program, whatever ops a rank sat out (DESIGN §5b).

Rank 0 alone first runs ten random ops on placement [0] (rank 1 makes the same
calls and skips them, as a pipeline stage does); then a random op on [0, 1]
must give both ranks the same draw. The logical draw is defined by the logical
random state (``sbpflow._rng``): the k-th random op reads positions ``offset ..
offset + numel - 1``; a torch kernel draws the whole logical tensor with a
``torch.Generator`` seeded by ``stream_seed(seed, offset)``, a factory hashes
each position. Every check compares with that draw computed in the same test
by plain single-process PyTorch (a factory: on a one-rank placement):
broadcast ranks hold it whole, split ranks hold slices that assemble into it.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow import _rng
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import DistributedPool

SBPS = {"B": Broadcast(), "S0": Split(0), "S1": Split(1)}
KEEP = 0.75  # dropout(p=0.25)
SHAPE = (8, 6)
SKIPPED = 10  # random ops rank 0 runs alone
SKIPPED_SHAPE = (4, 3)


def _sit_out(kind: str) -> None:
    """Ten random ops on placement [0]: rank 0 computes them, rank 1 skips them."""
    alone = sbpflow.placement("cpu", [0])
    x = sbpflow.ones(*SKIPPED_SHAPE, placement=alone, sbp=Broadcast())
    for _ in range(SKIPPED):
        if kind == "dropout":
            x = F.dropout(x, 0.5)
        else:
            sbpflow.randn(*SKIPPED_SHAPE, placement=alone, sbp=Broadcast())


def random_after_skipped_ops(seed: int, sbp: str, kind: str) -> dict[str, Any]:
    """Worker: after ``_sit_out(kind)``, one random op of each sort on [0, 1]."""
    sbpflow.manual_seed(seed)
    _sit_out(kind)
    both = sbpflow.placement("cpu", [0, 1])
    state = _rng.state()
    x = sbpflow.ones(*SHAPE, placement=both, sbp=SBPS[sbp])
    out: dict[str, Any] = {"state": state}
    out["dropout"] = F.dropout(x, 1 - KEEP).to_local()
    out["native_dropout"] = torch.ops.aten.native_dropout(x, 1 - KEEP, True)[1].to_local()
    w = sbpflow.zeros(*SHAPE, placement=both, sbp=SBPS[sbp])
    out["normal_"] = torch.nn.init.normal_(w).to_local()
    out["randn"] = sbpflow.randn(*SHAPE, placement=both, sbp=SBPS[sbp]).to_local()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # normal(Tensor, float) has no rule: it falls back
        out["normal"] = torch.normal(x, 2.0).to_local()
    out["randint_like"] = torch.randint_like(x, 10).to_local()
    return out


def _draw(seed: int, offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(_rng.stream_seed(seed, offset))


def _expected(seed: int, kind: str) -> dict[str, Any]:
    """The logical draws, one process: the same positions, plain torch kernels."""
    n, skipped = SHAPE[0] * SHAPE[1], SKIPPED * SKIPPED_SHAPE[0] * SKIPPED_SHAPE[1]
    offset = skipped
    mask = torch.empty(SHAPE).bernoulli_(KEEP, generator=_draw(seed, offset))
    want: dict[str, Any] = {"state": (seed, offset), "dropout": mask / KEEP}
    want["native_dropout"] = (
        torch.empty(SHAPE).bernoulli_(KEEP, generator=_draw(seed, offset + n)).bool()
    )
    want["normal_"] = torch.empty(SHAPE).normal_(generator=_draw(seed, offset + 2 * n))
    sbpflow.manual_seed(seed)
    _rng.take(offset + 3 * n)
    one = sbpflow.placement("cpu", [0])  # this process is a world of one
    want["randn"] = sbpflow.randn(*SHAPE, placement=one, sbp=Broadcast()).to_local()
    want["normal"] = torch.normal(torch.ones(SHAPE), 2.0, generator=_draw(seed, offset + 4 * n))
    want["randint_like"] = torch.empty(SHAPE).random_(0, 10, generator=_draw(seed, offset + 5 * n))
    return want


def _assemble(locals_: list[torch.Tensor], sbp: str) -> torch.Tensor:
    if sbp == "B":
        assert torch.equal(locals_[0], locals_[1]), "broadcast ranks drew different values"
        return locals_[0]
    return torch.cat(locals_, dim=SBPS[sbp].dim)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
@pytest.mark.parametrize("kind", ["dropout", "randn"])
def test_random_ops_agree_after_ranks_skipped_ops(dist_pool: DistributedPool, kind: str) -> None:
    """Broadcast: identical draws on both ranks; split: slices of the same logical draw, equal
    to the single-process draw at that program position; the state agrees on every rank."""
    want = _expected(21, kind)
    for sbp in SBPS:
        results = dist_pool.run(random_after_skipped_ops, 21, sbp, kind)
        assert [r["state"] for r in results] == [want["state"]] * 2, (sbp, results[1]["state"])
        for name in ("dropout", "native_dropout", "normal_", "randn", "normal", "randint_like"):
            got = _assemble([r[name] for r in results], sbp if name != "normal" else "B")
            assert torch.equal(got, want[name]), f"{name} with {sbp}:\n{got}\n!=\n{want[name]}"
